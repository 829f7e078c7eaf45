"""Input validation from host metadata only (shapes, dtypes, strides, devices, CPU ints).

Nothing here reads GPU memory: values that live on the device (slot ids, has_initial_state)
are checked only when the caller hands them over on the CPU, or when ``QLA_SERVE_DEBUG=1``
asks for the (syncing) debug checks. Every error names the argument and what was expected:
``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong value, shape or layout.

The layout rules here are what the GPU kernels need (16-byte vectors and TMA tiles), checked
the same way on every path, so that arguments the CPU reference takes also run on the GPU.
This module is the bottom of qla_serve's import graph: it imports torch and nothing of qla_serve.
"""

from __future__ import annotations

import math
import numbers
import operator
import os

import torch

HEAD_DIM = 128
IO_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
POOL_DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
VEC_BYTES = 16   # the kernels' vector loads and TMA tiles: strides and bases in 16-byte units

# The planner's vocabulary (plan.py re-exports these): here, below the planner and the ops
# that both check them.
CP_MODES = ("auto", "off", "exact")
ALL_STRATEGIES = frozenset({"plain", "vsplit", "cp"})


_POSIX = os.name == "posix"


def env(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)`` for switches read on every op call (the forced path,
    the debug checks): looked up in os.environ's own backing dict, which its setters (and
    pytest's monkeypatch) keep current, without os.environ.get's per-call encoding of the key and
    value: ~0.2 us instead of ~1.1 on the CPU machine, and a mixed layer call reads ~6."""
    data = getattr(os.environ, "_data", None) if _POSIX else None
    if not isinstance(data, dict):
        return os.environ.get(name, default)
    value = data.get(name.encode())
    return default if value is None else value.decode()


def debug_checks() -> bool:
    return env("QLA_SERVE_DEBUG", "0") not in ("", "0")


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def as_index(x) -> int | None:
    """``x`` as a Python int where it is an integer (int, numpy integer; not bool, not a tensor
    whose value may live on a GPU), else None."""
    if type(x) is int:
        return x
    if isinstance(x, (bool, torch.Tensor)):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def check_int(name: str, x, *, minimum: int | None = None, what: str = "an int") -> int:
    """An int argument: TypeError if not an integer (bool and floats refused, never truncated),
    ValueError below ``minimum``."""
    n = as_index(x)
    if n is None:
        raise TypeError(f"{name}: expected {what}, got {x!r} ({type(x).__name__})")
    if minimum is not None and n < minimum:
        _fail(name, what, x)
    return n


# --------------------------------------------------------------------------- the planner's inputs

def seq_lens_problem(lens: list[int]) -> str | None:
    """What is wrong with a list of int lengths ("expected ..., got ..."), or None. One rule for
    plan_prefill and the CLI's --seqlens: lengths >= 0 and a total that the int32 token offsets
    (cu_seqlens) can index, checked before anything is allocated."""
    if lens and min(lens) < 0:
        return f"expected lengths >= 0, got {[n for n in lens if n < 0][:4]}"
    total = sum(lens)
    if total > INT32_MAX:
        return (f"expected at most {INT32_MAX} tokens in all (token offsets are int32), got {total}"
                + (f" (largest length {max(lens)})" if len(lens) > 1 else ""))
    return None


def check_seq_lens(seq_lens, name: str = "seq_lens") -> list[int]:
    """CPU ints: a list/tuple (any iterable) of ints, or a 1-D integer CPU tensor. Floats are
    refused, not truncated; a device tensor is refused (reading it would sync the GPU)."""
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.device.type != "cpu":
            raise ValueError(f"{name}: expected CPU ints (a list or a CPU tensor); reading a "
                             f"{seq_lens.device} tensor would sync the GPU")
        if seq_lens.dtype.is_floating_point or seq_lens.dtype.is_complex or seq_lens.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor, got dtype {seq_lens.dtype}")
        if seq_lens.dim() != 1:
            _fail(name, "a 1-D tensor of lengths", f"shape {list(seq_lens.shape)}")
        lens = seq_lens.tolist()
    else:
        if isinstance(seq_lens, (str, bytes)):
            raise TypeError(f"{name}: expected a sequence of ints, got {type(seq_lens).__name__} {seq_lens!r}")
        try:
            lens = list(seq_lens)
        except TypeError:
            raise TypeError(f"{name}: expected a sequence of ints (list, tuple or 1-D CPU tensor), "
                            f"got {type(seq_lens).__name__}") from None
        if set(map(type, lens)) - {int}:   # (the per-element loop only where some are not ints:
            for i, n in enumerate(lens):   # it was half of this check's host time at 256 lengths)
                if type(n) is not int:
                    m = as_index(n)
                    if m is None:
                        raise TypeError(f"{name}: expected ints, got {n!r} ({type(n).__name__}) at index {i}")
                    lens[i] = m
    problem = seq_lens_problem(lens)
    if problem:
        raise ValueError(f"{name}: {problem}")
    return lens


def check_plan_args(seq_lens, num_v_heads, num_k_heads, cp, sm_count) -> list[int]:
    lens = check_seq_lens(seq_lens)
    hv = check_int("num_v_heads", num_v_heads, minimum=1, what="a positive int")
    hk = check_int("num_k_heads", num_k_heads, minimum=1, what="a positive int")
    if hv % hk:
        _fail("num_v_heads", f"a multiple of num_k_heads={hk}", hv)
    if not isinstance(cp, str) or cp not in CP_MODES:
        _fail("cp", f"one of {CP_MODES}", repr(cp))
    if sm_count is not None:
        check_int("sm_count", sm_count, minimum=1, what="a positive int (or None: the GPU's SM count)")
    return lens


def check_strategies(strategies) -> frozenset[str]:
    """plan_prefill's supported_strategies: a non-empty collection of strategy names."""
    if isinstance(strategies, str):
        raise TypeError(f"supported_strategies: expected a collection of names such as {{'plain', 'cp'}}, "
                        f"got the string {strategies!r}")
    try:
        names = frozenset(strategies)
    except TypeError:
        raise TypeError(f"supported_strategies: expected a collection of names, got "
                        f"{type(strategies).__name__}") from None
    if not names or not names <= ALL_STRATEGIES:
        _fail("supported_strategies", f"a non-empty subset of {sorted(ALL_STRATEGIES)}", sorted(map(repr, names)))
    return names


def check_device_arg(device, name: str = "device") -> torch.device:
    """A device argument as a torch.device this process can use: a CUDA device needs CUDA and an
    index below the device count (``cuda`` alone is the current device). Refused by name, never
    an AssertionError from deep inside torch."""
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"{name}: expected a torch.device or a string such as 'cuda:0', got "
                        f"{type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{name}: expected a device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: expected a device this process can use, got {device!r}, but CUDA is "
                             "not available here")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}: expected a CUDA index below the device count "
                             f"{torch.cuda.device_count()}, got {device!r}")
    return dev


# --------------------------------------------------------------------------- scalars of the ops

def check_scale(scale) -> float:
    """The ops' ``scale``: None (128 ** -0.5) or a finite real number; a CPU scalar tensor is
    read, a device one refused (reading it would sync the GPU)."""
    if scale is None:
        return HEAD_DIM ** -0.5
    if type(scale) is float:
        s = scale
    elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        s = float(scale)
    elif (isinstance(scale, torch.Tensor) and scale.device.type == "cpu" and scale.numel() == 1
          and scale.dtype.is_floating_point):
        s = float(scale)
    else:
        what = f"a {scale.device} tensor" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"scale: expected a real number (or None: 128 ** -0.5), got {what}")
    if not math.isfinite(s):
        _fail("scale", "a finite number", s)
    return s


def check_flag(name: str, x) -> bool:
    """A bool switch (use_qk_l2norm): True/False or 0/1, never a tensor (bool() would sync)."""
    if type(x) is bool:
        return x
    if isinstance(x, int) and not isinstance(x, bool) and x in (0, 1):
        return bool(x)
    raise TypeError(f"{name}: expected True or False, got {x!r} ({type(x).__name__})")


# --------------------------------------------------------------------------- tensors

# check_dtype and check_shape run ~15 times per public-op call: written as plain loops (no
# generator, no torch.is_tensor call), they cost about half as much (CPU-measured).
def check_dtype(name: str, x: torch.Tensor, allowed) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in allowed]}, got {x.dtype}")


def check_shape(name: str, x: torch.Tensor, shape: tuple) -> None:
    """``shape`` entries may be None (any size)."""
    got = x.shape
    if len(got) == len(shape):
        for e, s in zip(shape, got):
            if e is not None and e != s:
                break
        else:
            return
    want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
    _fail(name, f"shape {want}", list(got))


def check_device(device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            _fail(name, f"a tensor on {device} (like q)", t.device)


def check_vector_layout(name: str, x: torch.Tensor, dims: int) -> None:
    """The first ``dims`` strides in whole 16-byte vectors and a 16-byte aligned base: what the
    GPU kernels' vector loads and TMA tiles need (true of engine pools and of q/k/v views of a
    fused projection). Host metadata only."""
    es = x.element_size()
    st = x.stride()
    for d in range(dims):
        if (st[d] * es) % VEC_BYTES:
            break
    else:
        if x.data_ptr() % VEC_BYTES == 0:
            return
    _fail(name, f"strides {tuple(range(dims))} that are multiples of {VEC_BYTES} bytes "
          f"({VEC_BYTES // es} {x.dtype} elements) and a {VEC_BYTES}-byte aligned base (the GPU kernels' "
          "vector loads)", f"strides {tuple(st)}, base offset {x.data_ptr() % VEC_BYTES} bytes")


def _check_heads_tensor(name: str, x) -> None:
    """[tokens, heads, 128], at least one head, last dim contiguous, 16-byte token/head strides."""
    check_dtype(name, x, IO_DTYPES)
    if x.dim() != 3:
        _fail(name, "3 dims [tokens, heads, 128]", list(x.shape))
    if x.shape[-1] != HEAD_DIM:
        _fail(name, f"head dim {HEAD_DIM}", x.shape[-1])
    if x.shape[1] == 0:
        _fail(name, "at least one head", list(x.shape))
    if x.stride(-1) != 1:
        _fail(name, "a contiguous last dim (stride(-1) == 1)", x.stride())
    check_vector_layout(name, x, 2)


def check_qk(q, k) -> tuple[int, int]:
    """q, k [T, Hk, 128] in one dtype; last dim contiguous (strided views allowed)."""
    for name, x in (("q", q), ("k", k)):
        _check_heads_tensor(name, x)
    T, Hk, _ = q.shape
    check_shape("k", k, (T, Hk, HEAD_DIM))
    if k.dtype != q.dtype:
        raise TypeError(f"k: expected q's dtype {q.dtype}, got {k.dtype}")
    return T, Hk


# The one mixed q/k-vs-model dtype prefill takes: fp16 q/k beside bf16 v, what
# gdn_prefill_inputs(..., qk_dtype=torch.float16) makes of a bf16 model's q/k.
FP16_QK, BF16_MODEL = torch.float16, torch.bfloat16


def check_qk_dtype(qk_dtype, q) -> None:
    """gdn_prefill_inputs' qk_dtype: None, q's dtype, or fp16 for bf16 q."""
    if qk_dtype not in (None, q.dtype) and (qk_dtype, q.dtype) != (FP16_QK, BF16_MODEL):
        raise TypeError(f"qk_dtype: expected None, q's dtype ({q.dtype}) or torch.float16 for bf16 q, "
                        f"got {qk_dtype}")


def check_qkv(q, k, v, *, fp16_qk_ok: bool = False) -> tuple[int, int, int]:
    """q, k [T, Hk, 128], v [T, Hv, 128]; last dim contiguous (strided views allowed). v in q's
    dtype; with fp16_qk_ok (prefill) also bf16 v beside fp16 q/k (FP16_QK, BF16_MODEL)."""
    T, Hk = check_qk(q, k)
    _check_heads_tensor("v", v)
    if v.dtype != q.dtype and not (fp16_qk_ok and (q.dtype, v.dtype) == (FP16_QK, BF16_MODEL)):
        also = " (or torch.bfloat16 beside float16 q/k)" if fp16_qk_ok else ""
        raise TypeError(f"v: expected q's dtype {q.dtype}{also}, got {v.dtype}")
    if v.shape[0] != T:
        _fail("v", f"{T} tokens like q", v.shape[0])
    Hv = v.shape[1]
    if Hv % Hk:
        _fail("v", f"a value-head count that is a multiple of q's {Hk} heads", Hv)
    return T, Hk, Hv


def check_pool(pool: torch.Tensor, num_v_heads: int | None, name: str = "pool") -> int:
    """[S, Hv, 128, 128] fp32/bf16, inner three dims contiguous, stride(0) >= one slot and a
    whole number of 16-byte vectors, 16-byte aligned base. ``num_v_heads`` None: any Hv >= 1
    (commit_verified, which has no q/k/v to take it from). Returns Hv."""
    check_dtype(name, pool, POOL_DTYPES)
    if num_v_heads is None:
        if pool.dim() != 4 or pool.shape[1] == 0:
            _fail(name, f"shape [S, Hv, {HEAD_DIM}, {HEAD_DIM}] with Hv >= 1", list(pool.shape))
        num_v_heads = pool.shape[1]
    check_shape(name, pool, (None, num_v_heads, HEAD_DIM, HEAD_DIM))
    slot = num_v_heads * HEAD_DIM * HEAD_DIM
    if pool.stride()[1:] != (HEAD_DIM * HEAD_DIM, HEAD_DIM, 1):
        _fail(name, "contiguous [Hv, V, K] inner dims, strides (*, 16384, 128, 1)", pool.stride())
    if pool.shape[0] > 1 and pool.stride(0) < slot:
        _fail(f"{name}.stride(0)", f">= one slot ({slot} elements)", pool.stride(0))
    check_vector_layout(name, pool, 1)
    return num_v_heads


def check_intermediate(inter, pool, name: str = "intermediate") -> None:
    """verify's / commit_verified's per-token states [S', D, Hv, 128, 128] in the pool's dtype
    and head count: inner [Hv, V, K] contiguous, slot and draft-token strides (0, 1) in whole
    16-byte vectors, 16-byte aligned base (the kernels move states in 16-byte vectors)."""
    check_dtype(name, inter, POOL_DTYPES)
    if inter.dtype != pool.dtype:
        raise TypeError(f"{name}: expected dtype {pool.dtype} (the pool's), got {inter.dtype}")
    check_shape(name, inter, (None, None, pool.shape[1], HEAD_DIM, HEAD_DIM))
    if inter.stride()[2:] != (HEAD_DIM * HEAD_DIM, HEAD_DIM, 1):
        _fail(name, "contiguous [Hv, V, K] inner dims, strides (*, *, 16384, 128, 1)", inter.stride())
    check_vector_layout(name, inter, 2)


def check_gates(T: int, Hv: int, g, beta, a, b, A_log, dt_bias, *, allow_raw: bool,
                contiguous_gb: bool = False) -> str:
    """Either (g, beta) [T, Hv] fp32, or raw (a, b) [T, Hv] with A_log, dt_bias [Hv].
    ``contiguous_gb``: g and beta contiguous (prefill's kernels read them as dense [T, Hv])."""
    given_gb = g is not None or beta is not None
    given_raw = any(x is not None for x in (a, b, A_log, dt_bias))
    if given_gb and given_raw:
        raise ValueError("g/beta and a/b/A_log/dt_bias: expected one gating form, got both")
    if allow_raw and not given_gb and not given_raw:
        raise ValueError(f"g/beta and a/b/A_log/dt_bias: expected one gating form (g, beta [{T}, {Hv}] "
                         "float32, or raw a, b, A_log, dt_bias), got neither")
    if given_gb or not allow_raw:
        for name, x in (("g", g), ("beta", beta)):
            if x is None:
                raise ValueError(f"{name}: expected a [{T}, {Hv}] float32 tensor, got None")
            check_dtype(name, x, (torch.float32,))
            check_shape(name, x, (T, Hv))
            if contiguous_gb and not x.is_contiguous():
                _fail(name, "a contiguous tensor (the prefill kernels read dense [T, Hv] gates)",
                      f"strides {x.stride()}")
        return "g_beta"
    for name, x, shape in (("a", a, (T, Hv)), ("b", b, (T, Hv)),
                           ("A_log", A_log, (Hv,)), ("dt_bias", dt_bias, (Hv,))):
        if x is None:
            raise ValueError(f"{name}: expected a tensor of shape {list(shape)} (raw gating), got None"
                             " — pass either g and beta, or a, b, A_log and dt_bias")
        check_dtype(name, x, (torch.float32, torch.bfloat16, torch.float16))
        check_shape(name, x, shape)
    return "raw"


def index_vector(name: str, x, n: int | None = None, dtypes=INDEX_DTYPES) -> int:
    """A 1-D contiguous index tensor ([n] where n is given; the kernels read it densely).
    Returns its length."""
    check_dtype(name, x, dtypes)
    if x.dim() != 1 or (n is not None and x.shape[0] != n):
        _fail(name, f"shape [{'*' if n is None else n}]", list(x.shape))
    if x.shape[0] > 1 and x.stride(0) != 1:
        _fail(name, "a contiguous tensor", f"stride {x.stride(0)}")
    return x.shape[0]


def check_index(name: str, x, n: int, upper: int, bound: str, *, unique_live: bool,
                padding: bool = True) -> None:
    """An index vector [n] int32/int64 whose values lie in [0, upper) -- or, with ``padding``,
    are < 0 for padding, down to -2**31 (ids are narrowed to int32 for the kernels; an int64
    id below that would wrap around to a live slot). ``bound`` says what ``upper`` is, for the
    message. Values are checked when on the CPU (or in debug mode)."""
    index_vector(name, x, n)
    if x.device.type != "cpu" and not debug_checks():
        return
    vals = x.tolist()
    if not vals:
        return
    lo, hi = min(vals), max(vals)
    if hi >= upper:
        want = f"ids < {upper} ({bound}), or < 0 for padding" if padding else f"values in [0, {upper - 1}] ({bound})"
        _fail(name, want, [s for s in vals if s >= upper][:4])
    if lo < (INT32_MIN if padding else 0):
        want = ("padding ids >= -2**31 (ids are narrowed to int32; -1 is the usual padding id)"
                if padding else f"values in [0, {upper - 1}] ({bound})")
        _fail(name, want, [s for s in vals if s < (INT32_MIN if padding else 0)][:4])
    if unique_live:
        live = [s for s in vals if s >= 0]
        if len(set(live)) != len(live):
            dup = sorted({s for s in live if live.count(s) > 1})
            _fail(name, "distinct live ids (two sequences cannot share a state)", f"duplicates {dup[:4]}")


def int32_index(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An id vector as the kernels take it: int32 on ``device``. int32 ids as they are (no copy
    where they already are there); int64 ids clamped to [-1, 2**31 - 1] before narrowing, so that
    no id the host could not see becomes another slot (-2**32 would otherwise wrap to slot 0):
    a negative stays padding, a too-large one stays out of range. One device op more for int64
    ids only; no host sync."""
    if x.dtype is torch.int32:   # (dtypes are singletons: `is` is the cheap test, per call)
        return x if x.device == device else x.to(device, non_blocking=True)
    return x.clamp(-1, INT32_MAX).to(device, torch.int32, non_blocking=True)


def check_cu_seqlens(name: str, cu, T: int) -> list[int] | None:
    """[N+1] ints, non-decreasing from 0 to T. Checked when on the CPU (or in debug mode)."""
    check_dtype(name, cu, INDEX_DTYPES)
    if cu.dim() != 1 or cu.numel() < 1:
        _fail(name, "a 1-D [N+1] tensor", list(cu.shape))
    if cu.shape[0] > 1 and cu.stride(0) != 1:
        _fail(name, "a contiguous tensor", f"stride {cu.stride(0)}")
    if cu.device.type != "cpu" and not debug_checks():
        return None
    vals = cu.tolist()
    if vals[0] != 0 or vals[-1] != T or any(b < a for a, b in zip(vals, vals[1:])):
        _fail(name, f"non-decreasing offsets from 0 to T={T}", vals[:8] + (["..."] if len(vals) > 8 else []))
    return vals


def output(out, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The caller's ``out`` after checking it (dtype, shape, device, and the layout the kernels
    write: last dim contiguous, 16-byte token/head strides), or a new (uninitialised) tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_dtype("out", out, (dtype,))
    check_shape("out", out, shape)
    if out.device != device:
        _fail("out", f"a tensor on {device}", out.device)
    if out.stride(-1) != 1:
        _fail("out", "a contiguous last dim (stride(-1) == 1)", out.stride())
    check_vector_layout("out", out, 2)
    return out
