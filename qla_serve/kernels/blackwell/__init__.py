"""GDN kernels for Blackwell (sm_100a): for now the Hopper TileLang sources compiled for sm_100a.

Prefill: qla_serve.kernels.hopper.prefill_* built with target "sm_100a" (TileLang lowers the
same tile programs -- TMA loads, T.gemm -- for the target; no Hopper-only intrinsic is written by
hand). They compile for sm_100a (tests/kernels/test_prefill_compile.py) but have NOT been run
on Blackwell hardware; no tcgen05/TMEM-specific tuning has been done. Decode/verify, the
prefill inputs and the layer's conv come from qla_serve.kernels.hopper.decode / prefill_inputs /
conv, which pick the target from the device.
"""

import functools

from qla_serve.kernels import hopper as _hopper
from qla_serve.kernels.hopper import prefill_api as _prefill
from qla_serve.kernels.hopper import prefill_launch as _prefill_launch

ARCH = "sm_100a"
SUPPORTED_STRATEGIES = _prefill.SUPPORTED_STRATEGIES
prefill = functools.partial(_prefill_launch.prefill, _target=ARCH)
prefill_inputs = _hopper.prefill_inputs
decode = _hopper.decode
verify = _hopper.verify
verify_slots = _hopper.verify_slots
conv_prefill = _hopper.conv_prefill
conv_decode = _hopper.conv_decode
conv_spec = _hopper.conv_spec
conv_verify = _hopper.conv_verify
conv_window = _hopper.conv_window
slot_ids = _hopper.slot_ids
commit_verified = _hopper.commit_verified
TARGETS = ("sm_100a",)


def kernel_variants(num_v_heads: int, num_k_heads: int) -> list[dict]:
    """Hopper's variant list for sm_100a: the V-first prefill kernel is wgmma-only, so every
    v_split runs the v8 stage 2 here (prefill_api.main_impl_for)."""
    return _hopper.kernel_variants(num_v_heads, num_k_heads, ARCH)


def build(variant: dict, target: str = ARCH):
    return _hopper.build(variant, target)
