"""TileLang GDN kernels for Hopper (sm_90a).

* prefill (prefill_api.py, prefill_prep.py, prefill_main.py): chunked prefill, strategies in
  ``SUPPORTED_STRATEGIES``.
* decode / verify (decode.py): single-token and speculative-verify steps.

``kernel_variants`` is the union of both modules' variants; ``build`` dispatches on the
variant's ``op`` ("prefill_prep"/"prefill_main" here, decode's own ops otherwise).
decode.py is imported lazily so that prefill works on its own.
"""

import importlib
import sys

from . import prefill_api as _prefill
from .prefill_api import SUPPORTED_STRATEGIES, prefill

ARCH = "sm_90a"

__all__ = ["ARCH", "SUPPORTED_STRATEGIES", "prefill", "decode", "verify", "kernel_variants", "build"]


def _decode_module():
    mod = sys.modules.get(__name__ + ".decode")
    if mod is None:
        # importing a submodule sets the package attribute of the same name; keep the
        # package-level wrapper functions `decode`/`verify` in place.
        wrappers = globals()["decode"], globals()["verify"]
        mod = importlib.import_module(__name__ + ".decode")
        globals()["decode"], globals()["verify"] = wrappers
    return mod


def decode(*args, **kwargs):
    """See qla_serve.kernels.hopper.decode.decode."""
    return _decode_module().decode(*args, **kwargs)


def verify(*args, **kwargs):
    """See qla_serve.kernels.hopper.decode.verify."""
    return _decode_module().verify(*args, **kwargs)


def kernel_variants(num_v_heads: int, num_k_heads: int) -> list[dict]:
    """Prefill variants followed by decode/verify variants for these TP-local head counts."""
    out = _prefill.kernel_variants(num_v_heads, num_k_heads)
    try:
        dec = _decode_module()
    except ImportError:  # decode.py not present in this checkout: prefill variants only
        return out
    return out + dec.kernel_variants(num_v_heads, num_k_heads)


def build(variant: dict, target: str = ARCH):
    """Compile one variant (from kernel_variants) for "sm_90a" or "sm_100a"."""
    if str(variant.get("op", "")).startswith("prefill"):
        return _prefill.build(variant, target)
    return _decode_module().build(variant, target)
