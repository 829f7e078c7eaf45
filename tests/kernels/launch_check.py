"""Kernel launches of the Hopper modules recorded on the CPU and checked against the programs
they would run (a helper of tests/kernels, not a test module).

:func:`record_launches` swaps two things, so that every launch path above them runs for real on
CPU or meta-device tensors: ``tilelang.compile`` returns the TileLang program it was given instead of compiling
it (each module's own ``build`` picks that program from the variant, as on the GPU), and the raw
launch function (raw_launch.raw_function) becomes a checker of that program's parameters. Each
launch is then matched, by position, against the program's parameters, as the tvm-ffi host
function matches them on the GPU: the argument count, each tensor's dtype, rank, static extents
and strides, each symbolic extent or stride bound to one value across all arguments (``B`` of q
and of out, ``N + 1`` of cu_seqlens), each scalar's kind. An argument missing, extra, swapped,
of the wrong dtype or shape fails here instead of on the H200. The kernels themselves run in
the ``gpu`` tests.

These are stand-ins (the compiled kernel cannot run without a GPU); the programs, the variants,
the launch code, the ops and the layer are the real ones.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

# the modules (the package's names conv, decode, ... are its functions)
common, conv, decode, prefill_api, prefill_launch, prefill_inputs, slot_ids = (
    importlib.import_module(f"qla_serve.kernels.hopper.{m}")
    for m in ("common", "conv", "decode", "prefill_api", "prefill_launch", "prefill_inputs", "slot_ids"))

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
           torch.int32: "int32", torch.int64: "int64", torch.int8: "int8", torch.uint8: "uint8",
           torch.bool: "bool"}


class Launch(NamedTuple):
    """One recorded launch: the kernel's name, its arguments by parameter name, and the program
    (TileLang PrimFunc) they were checked against."""
    name: str
    args: dict
    program: object

    def __repr__(self) -> str:   # the program's text would bury a failing assertion's message
        return f"Launch({self.name!r})"


class _Program:
    """What the stand-in tilelang.compile returns: the program, uncompiled."""

    def __init__(self, func):
        self.func = func


def _value(expr, bound: dict):
    """An extent or stride expression's value under ``bound`` (Var -> int), or None while one of
    its variables is unbound."""
    from tvm import arith, tirx   # TileLang 0.1.12's bundled TVM (its TIR is tvm.tirx)

    if isinstance(expr, int):
        return expr
    if isinstance(expr, tirx.IntImm):
        return int(expr)
    if isinstance(expr, tirx.Var):
        return bound.get(expr)
    free = tirx.analysis.undefined_vars(expr)
    if any(v not in bound for v in free):
        return None
    sub = tirx.stmt_functor.substitute(expr, {v: tirx.IntImm(v.dtype, bound[v]) for v in free})
    return int(arith.Analyzer().simplify(sub))


def _match(label: str, what: str, expr, actual: int, bound: dict, pending: list) -> None:
    from tvm import tirx

    if isinstance(expr, tirx.Var) and expr not in bound:
        bound[expr] = actual
        return
    want = _value(expr, bound)
    if want is None:
        pending.append((what, expr, actual))
    elif want != actual:
        raise AssertionError(f"{label}: {what} is {actual}, the program has {expr} = {want}")


def check_arguments(func, args: tuple, label: str) -> dict:
    """``args`` matched against PrimFunc ``func``'s parameters; returns {parameter name: argument}.
    Raises AssertionError naming the kernel and parameter on the first mismatch."""
    params = list(func.params)
    names = [func.buffer_map[p].name if p in func.buffer_map else p.name for p in params]
    if len(args) != len(params):
        raise AssertionError(f"{label}: {len(args)} arguments for the parameters {names}")
    bound, pending = {}, []
    for p, name, arg in zip(params, names, args):
        if p not in func.buffer_map:
            kind = str(p.dtype)
            ok = isinstance(arg, float) if kind.startswith("float") else (
                isinstance(arg, int) and not isinstance(arg, bool))
            if not ok:
                raise AssertionError(f"{label}: scalar {name} ({kind}) got {type(arg).__name__} {arg!r}")
            continue
        buf = func.buffer_map[p]
        if not isinstance(arg, torch.Tensor):
            raise AssertionError(f"{label}: {name} expects a tensor, got {type(arg).__name__}")
        if _DTYPES.get(arg.dtype) != str(buf.dtype):
            raise AssertionError(f"{label}: {name} expects {buf.dtype}, got {arg.dtype}")
        if arg.dim() != len(buf.shape):
            raise AssertionError(f"{label}: {name} expects rank {len(buf.shape)} {list(buf.shape)}, "
                                 f"got shape {list(arg.shape)}")
        for i, extent in enumerate(buf.shape):
            _match(label, f"{name}.shape[{i}]", extent, arg.shape[i], bound, pending)
        # a stride only matters along a dimension of more than one element (torch leaves others
        # free; not checking them can miss a mismatch there, never report a false one)
        strides = list(buf.strides) or _compact_strides(buf.shape)
        for i, stride in enumerate(strides):
            if arg.shape[i] > 1:
                _match(label, f"{name}.stride({i})", stride, arg.stride(i), bound, pending)
    for what, expr, actual in pending:
        want = _value(expr, bound)
        if want is not None and want != actual:
            raise AssertionError(f"{label}: {what} is {actual}, the program has {expr} = {want}")
    return dict(zip(names, args))


def _compact_strides(shape) -> list:
    strides, acc = [], 1
    for extent in reversed(list(shape)):
        strides.append(acc)
        acc = acc * extent
    return strides[::-1]


def record_launches(monkeypatch, target: str = "sm_90a") -> list[Launch]:
    """Route every kernel launch of this test to :func:`check_arguments`, the device taken for
    one of ``target`` ("sm_90a", or "sm_100a": Blackwell's module builds the same programs for
    it); returns the list the checked launches are appended to, in launch order."""
    import tilelang

    calls: list[Launch] = []

    def raw_function(kernel, name):
        def launch(*args):
            calls.append(Launch(name, check_arguments(kernel.func, args, name), kernel.func))
        return launch

    monkeypatch.setattr(tilelang, "compile", lambda func, *a, **k: _Program(func))
    for mod in (common, prefill_launch):
        monkeypatch.setattr(mod, "raw_function", raw_function)
    monkeypatch.setattr(common, "_device_target", lambda idx: target)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # the process-wide caches of compiled kernels and launch functions start empty and stay unshared
    for mod in (conv, decode, prefill_inputs, slot_ids):
        monkeypatch.setattr(mod, "_FAST", {})
    monkeypatch.setattr(prefill_launch, "_fns", {})
    monkeypatch.setattr(prefill_api, "_kernels", {})
    return calls


# The arch modules the launch tests drive, and their compile targets: Hopper, and Blackwell (the
# same programs built for sm_100a; its prefill runs the v8 stage 2)
ARCHS = {"sm90": "sm_90a", "sm100": "sm_100a"}


def record_arch_launches(monkeypatch, arch: str) -> list[Launch]:
    """The ops on ``arch``'s TileLang path (:func:`force_tilelang_path`), every launch recorded
    and checked against its program built for that arch's target (:func:`record_launches`)."""
    force_tilelang_path(monkeypatch, arch)
    return record_launches(monkeypatch, ARCHS[arch])


def force_tilelang_path(monkeypatch, arch: str = "sm90") -> None:
    """Dispatch the public ops and the layer ops to the TileLang kernel module of ``arch``
    ("sm90" or "sm100") on CPU or meta tensors (where the path selection answers "reference")."""
    from qla_serve import layer_ops, ops

    monkeypatch.setattr(ops, "_path", lambda op, device, io_dtype: "tilelang")
    monkeypatch.setattr(layer_ops, "_path", lambda op, device, io_dtype: "tilelang")
    monkeypatch.setattr(ops, "device_arch", lambda device: arch)
