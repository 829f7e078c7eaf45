"""Which implementation runs an op on a device: the path selection that the ops (dispatch) and
the planner (which strategies the kernels implement) both read.

Paths, picked per op and device:

* ``tilelang``  — qla_serve's TileLang kernels for the device's arch (kernels/hopper, sm_90a).
* ``fla``       — flash-linear-attention's Triton ops, on CUDA GPUs without qla_serve kernels.
* ``reference`` — the torch reference (kernels/reference.py): CPU tensors, and float32 q/k/v
  (the TileLang kernels take bf16/fp16).

``QLA_SERVE_OP_PATH=tilelang|fla|reference`` forces a path; a forced path that cannot run
raises instead of falling back. Below ops.py and plan.py in the import graph (it imports
neither); ops re-exports these names.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

PATHS = ("tilelang", "fla", "reference")
FLA_OPS = ("prefill", "decode")
# Archs whose TileLang kernels have run on that arch's hardware against the float64 reference
# (the GPU test suite: sm90 on the H200). sm100's are the Hopper tile programs built for sm_100a:
# compiled in CI, never run on a Blackwell GPU (kernels/blackwell/__init__.py).
HARDWARE_VALIDATED_ARCHS = frozenset({"sm90"})


@functools.lru_cache(maxsize=None)
def _arch_of(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def device_arch(device: torch.device) -> str:
    """"sm90", "sm100", ... of a CUDA device (the current one where it has no index)."""
    return _arch_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def kernel_module(arch: str):
    """The TileLang kernel module for ``arch`` ("sm90" / "sm100"), or an import error string."""
    name = {"sm90": "qla_serve.kernels.hopper", "sm100": "qla_serve.kernels.blackwell"}.get(arch)
    if name is None:
        return f"no qla_serve TileLang kernels for {arch}"
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or TileLang failing to load its native library
        return f"{name} failed to import: {type(exc).__name__}: {exc}"


def unvalidated_note(device) -> str | None:
    """For a CUDA device whose arch has qla_serve TileLang kernels that have not run on its
    hardware yet: the sentence that says so (start-up logs it as a warning); else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    arch = device_arch(device)
    if arch in HARDWARE_VALIDATED_ARCHS or isinstance(kernel_module(arch), str):
        return None
    return (f"qla_serve's TileLang kernels for {arch} have not been run on {arch} hardware yet "
            f"(validated: {', '.join(sorted(HARDWARE_VALIDATED_ARCHS))}): run `python -m pytest -m gpu "
            f"tests` on this GPU before serving with them")


@functools.lru_cache(maxsize=None)
def _fla_error() -> str | None:
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
        return None
    except Exception as exc:
        return f"flash-linear-attention unavailable: {type(exc).__name__}: {exc}"


def explain_path(op: str, device, io_dtype=torch.bfloat16) -> tuple[str, str]:
    """(path, reason) that ``op`` ("prefill" | "prefill_inputs" | "decode" | "verify" |
    "commit_verified") takes on ``device`` for q/k/v of ``io_dtype``."""
    device = torch.device(device)
    forced = os.environ.get("QLA_SERVE_OP_PATH", "auto")
    if forced not in PATHS + ("auto",):
        raise ValueError(f"QLA_SERVE_OP_PATH: expected one of {PATHS + ('auto',)}, got {forced!r}")
    candidates = []
    if device.type == "cuda":
        arch = device_arch(device)
        mod = kernel_module(arch)
        if isinstance(mod, str):
            candidates.append(("tilelang", None, mod))
        elif not hasattr(mod, op):
            candidates.append(("tilelang", None, f"{mod.__name__} has no {op} kernel yet"))
        elif io_dtype == torch.float32:  # None: an op without q/k/v (commit_verified)
            candidates.append(("tilelang", None, "TileLang kernels take bf16/fp16 q/k/v, got float32"))
        else:
            untested = "" if arch in HARDWARE_VALIDATED_ARCHS else "; not yet run on this arch's hardware"
            candidates.append(("tilelang", "ok", f"{mod.__name__}.{op}{untested}"))
        if op in FLA_OPS:
            fla_err = _fla_error()
            candidates.append(("fla", None if fla_err else "ok", fla_err or "FLA Triton fallback"))
        else:
            candidates.append(("fla", None, f"FLA has no {op} that writes per-token states"))
    candidates.append(("reference", "ok", "torch reference" + (" (CPU tensors)" if device.type == "cpu" else "")))
    if forced != "auto":
        for path, ok, why in candidates:
            if path == forced:
                if ok:
                    return path, why
                raise RuntimeError(f"QLA_SERVE_OP_PATH={forced}: cannot run {op} on {device}: {why}")
        raise RuntimeError(f"QLA_SERVE_OP_PATH={forced}: not available for {op} on {device}")
    for path, ok, why in candidates:
        if ok:
            return path, why
    raise AssertionError("unreachable: the reference path always runs")


def supported_prefill_strategies(device) -> frozenset[str]:
    """Strategies the prefill path on ``device`` implements (the planner picks among these)."""
    device = torch.device(device)
    if device.type != "cuda":
        return frozenset({"plain", "vsplit", "cp"})  # the reference ignores the strategy
    path, _ = explain_path("prefill", device)
    if path == "tilelang":
        mod = kernel_module(device_arch(device))
        return frozenset(getattr(mod, "SUPPORTED_STRATEGIES", {"plain"}))
    return frozenset({"plain"})
