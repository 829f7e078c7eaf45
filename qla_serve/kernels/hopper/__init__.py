"""TileLang GDN kernels for Hopper (sm_90a).

* prefill (prefill_launch.py runs what prefill_api.py defines -> prefill_prep.py, prefill_main.py,
  prefill_scan.py): chunked prefill; the strategies it implements are in ``SUPPORTED_STRATEGIES``
  (the planner picks only those).
* prefill_inputs (prefill_inputs.py): a prefill step's L2-normalised q/k and gates from raw
  a, b in one launch (what the engines' layers hand over, made into what prefill takes).
* decode / verify / verify_slots / commit_verified (decode.py; its tiles in decode_tiles.py):
  single-token and speculative-verify steps (verify_slots: states straight into per-token pool
  slots).
* conv_prefill / conv_decode / conv_spec / conv_verify (conv.py; conv_prefill's program in conv_prefill.py): the GDN layer's causal conv over the
  engine's conv state; conv_prefill also does what prefill_inputs does (split, L2 norm, gates).
* slot_ids (slot_ids.py): an engine step's slot tensors -> the ops' int32 ids, one launch.

common.py holds what they share: dtype names, the gate formulas as TIR expressions, and the one
compile-and-launch path (TileLang's cache with an explicit target, raw tvm-ffi functions).

``kernel_variants`` is the union of the modules' variants (what ``qla-serve precompile``
compiles); ``build`` dispatches on the variant's ``op``.
"""

from . import conv as _conv
from . import decode as _decode
from . import prefill_api as _prefill
from . import prefill_inputs as _inputs
from . import slot_ids as _slot_ids
from .conv import conv_decode, conv_prefill, conv_spec, conv_verify, conv_window
from .decode import commit_verified, decode, verify, verify_slots
from .prefill_api import SUPPORTED_STRATEGIES
from .prefill_launch import prefill
from .prefill_inputs import prefill_inputs
from .slot_ids import slot_ids

ARCH = "sm_90a"
TARGETS = ("sm_90a",)  # sm_100a builds come from qla_serve.kernels.blackwell

__all__ = ["ARCH", "SUPPORTED_STRATEGIES", "TARGETS", "build", "commit_verified", "conv_decode",
           "conv_prefill", "conv_spec", "conv_verify", "conv_window", "decode", "kernel_variants", "prefill", "prefill_inputs",
           "slot_ids", "verify", "verify_slots"]


def kernel_variants(num_v_heads: int, num_k_heads: int, target: str = ARCH) -> list[dict]:
    """Prefill variants (the stage-2 forms target runs), the prefill-input variants, the
    decode/verify/commit variants, then the layer's conv variants for these TP-local heads."""
    return (_prefill.kernel_variants(num_v_heads, num_k_heads, target)
            + _inputs.kernel_variants(num_v_heads, num_k_heads)
            + _decode.kernel_variants(num_v_heads, num_k_heads)
            + _conv.kernel_variants(num_v_heads, num_k_heads)
            + _slot_ids.kernel_variants(num_v_heads, num_k_heads))


def build(variant: dict, target: str = ARCH):
    """Compile one variant (from kernel_variants) for "sm_90a" or "sm_100a"."""
    if str(variant.get("op", "")).startswith("prefill"):
        return _prefill.build(variant, target)
    if variant.get("op") == "inputs":
        return _inputs.build(variant, target)
    if str(variant.get("op", "")).startswith("conv"):
        return _conv.build(variant, target)
    if variant.get("op") == "slot_ids":
        return _slot_ids.build(variant, target)
    return _decode.build(variant, target)
