"""Input validation from host metadata only (shapes, dtypes, strides, devices, CPU ints).

Nothing here reads GPU memory: values that live on the device (slot ids, has_initial_state)
are checked only when the caller hands them over on the CPU, or when ``QLA_SERVE_DEBUG=1``
asks for the (syncing) debug checks. Every error names the argument and what was expected.
"""

from __future__ import annotations

import os

import torch

HEAD_DIM = 128
IO_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
POOL_DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def debug_checks() -> bool:
    return os.environ.get("QLA_SERVE_DEBUG", "0") not in ("", "0")


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_plan_args(seq_lens, num_v_heads, num_k_heads, cp, sm_count) -> list[int]:
    from qla_serve.plan import CP_MODES
    if torch.is_tensor(seq_lens):
        if seq_lens.device.type != "cpu":
            raise ValueError("seq_lens: expected CPU ints (a list or a CPU tensor); reading a "
                             f"{seq_lens.device} tensor would sync the GPU")
        seq_lens = seq_lens.tolist()
    lens = list(map(int, seq_lens))
    if lens and min(lens) < 0:
        _fail("seq_lens", "non-negative lengths", [n for n in lens if n < 0][:4])
    for name, h in (("num_v_heads", num_v_heads), ("num_k_heads", num_k_heads)):
        if not isinstance(h, int) or h <= 0:
            _fail(name, "a positive int", h)
    if num_v_heads % num_k_heads:
        _fail("num_v_heads", f"a multiple of num_k_heads={num_k_heads}", num_v_heads)
    if cp not in CP_MODES:
        _fail("cp", f"one of {CP_MODES}", repr(cp))
    if sm_count is not None and (not isinstance(sm_count, int) or sm_count <= 0):
        _fail("sm_count", "a positive int or None", sm_count)
    return lens


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


def _check_heads_tensor(name: str, x) -> None:
    check_dtype(name, x, IO_DTYPES)
    if x.dim() != 3:
        _fail(name, "3 dims [tokens, heads, 128]", list(x.shape))
    if x.shape[-1] != HEAD_DIM:
        _fail(name, f"head dim {HEAD_DIM}", x.shape[-1])
    if x.stride(-1) != 1:
        _fail(name, "a contiguous last dim (stride(-1) == 1)", x.stride())


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


def check_pool(pool: torch.Tensor, num_v_heads: int, name: str = "pool") -> None:
    """[S, Hv, 128, 128] fp32/bf16, inner three dims contiguous, stride(0) >= one slot."""
    check_dtype(name, pool, POOL_DTYPES)
    check_shape(name, pool, (None, num_v_heads, HEAD_DIM, HEAD_DIM))
    slot = num_v_heads * HEAD_DIM * HEAD_DIM
    if pool.stride()[1:] != (HEAD_DIM * HEAD_DIM, HEAD_DIM, 1):
        _fail(name, "contiguous [Hv, V, K] inner dims, strides (*, 16384, 128, 1)", pool.stride())
    if pool.shape[0] > 1 and pool.stride(0) < slot:
        _fail(f"{name}.stride(0)", f">= one slot ({slot} elements)", pool.stride(0))


def check_gates(T: int, Hv: int, g, beta, a, b, A_log, dt_bias, *, allow_raw: bool) -> str:
    """Either (g, beta) [T, Hv] fp32, or raw (a, b) [T, Hv] with A_log, dt_bias [Hv]."""
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
        return "g_beta"
    for name, x, shape in (("a", a, (T, Hv)), ("b", b, (T, Hv)),
                           ("A_log", A_log, (Hv,)), ("dt_bias", dt_bias, (Hv,))):
        if x is None:
            raise ValueError(f"{name}: expected a tensor of shape {list(shape)} (raw gating), got None"
                             " — pass either g and beta, or a, b, A_log and dt_bias")
        check_dtype(name, x, (torch.float32, torch.bfloat16, torch.float16))
        check_shape(name, x, shape)
    return "raw"


def check_index(name: str, x, n: int, num_slots: int | None, *, unique_live: bool) -> None:
    """An index vector [n] int32/int64. Values are checked when on the CPU (or in debug mode)."""
    check_dtype(name, x, INDEX_DTYPES)
    check_shape(name, x, (n,))
    if x.device.type != "cpu" and not debug_checks():
        return
    vals = x.tolist()
    if num_slots is not None:
        bad = [s for s in vals if s >= num_slots]
        if bad:
            _fail(name, f"ids < {num_slots} (the pool's slot count) or < 0 for padding", bad[:4])
    if unique_live:
        live = [s for s in vals if s >= 0]
        if len(set(live)) != len(live):
            dup = sorted({s for s in live if live.count(s) > 1})
            _fail(name, "distinct live slot ids (two sequences cannot share a state)", f"duplicates {dup[:4]}")


def check_cu_seqlens(name: str, cu, T: int) -> list[int] | None:
    """[N+1] ints, non-decreasing from 0 to T. Checked when on the CPU (or in debug mode)."""
    check_dtype(name, cu, INDEX_DTYPES)
    if cu.dim() != 1 or cu.numel() < 1:
        _fail(name, "a 1-D [N+1] tensor", list(cu.shape))
    if cu.device.type != "cpu" and not debug_checks():
        return None
    vals = cu.tolist()
    if vals[0] != 0 or vals[-1] != T or any(b < a for a, b in zip(vals, vals[1:])):
        _fail(name, f"non-decreasing offsets from 0 to T={T}", vals[:8] + (["..."] if len(vals) > 8 else []))
    return vals


def output(out, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The caller's ``out`` after checking it, or a new (uninitialised) tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_dtype("out", out, (dtype,))
    check_shape("out", out, shape)
    if out.device != device:
        _fail("out", f"a tensor on {device}", out.device)
    return out
