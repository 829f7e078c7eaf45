"""One launch for a GDN layer's decode step: the causal conv over the engine's conv state fused
into decode.py's kernel (its tile, math and argument layout), for one token per sequence.

Math, for sequence i with live slot s (slot ids < 0: zero output rows, nothing read or
written), x = mixed_qkv[i] (q | k | v channels, dim = (2 Hk + Hv) 128), window width W::

    y[c] = act(bias[c] + sum_{j < W-1} w[c, j] conv_state[s, c, j] + w[c, W-1] x[c])
    conv_state[s, c, :W-1] <- [conv_state[s, c, 1:W-1], x[c]]
    q | k | v = y rounded to x's dtype; then decode.py's token with fused gates and the q/k
    L2 norm on pool[s], in place.

That is conv.py's conv_decode followed by decode.py's decode, bit for bit: y is rounded to x's
dtype before the recurrence reads it, as the two-launch form stores it between its launches
(reference: kernels/reference_conv.conv_decode, then kernels/reference.decode).

Grid (NV = 128 / BV V-tiles, Hv, B), as decode. A block convolves what it reads, one channel
per thread at a time into shared memory: the 128 q and 128 k channels of k-head h // G, and its
BV v rows; after a block barrier each lane takes its 16 q/k columns (decode's register layout)
from there. The v channels of (h, the block's rows) belong to that block alone: the thread that
convolved one shifts its window. The q/k channels of a k-head are read by its NV * G blocks, so
their windows may change only after the last of them has read: every block, after the barrier
that follows its reads, adds 1 to ``counters[slot, k-head]`` (device-scope acq_rel atomic); the
block whose add makes it a multiple of NV * G is the last: it shifts the q/k windows and
subtracts NV * G, so the counter is 0 again for the next step (CUDA-graph replays included).
The counters are an int32 [S, Hk] tensor per conv state, zeroed once (:func:`arrival_counters`).

Variants: decode.py's (io, pool, raw-gate dtypes; l2norm on) with the conv's width, conv-state
and weight dtypes, activation and bias; the pool dtype's default tile (q/k in registers).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import importlib

import torch

from . import conv as _conv

_decode = importlib.import_module(f"{__package__}.decode")   # (the package's `decode` is the op)

OP = "decode_conv"
HEAD_DIM = _decode.HEAD_DIM
# The tile per pool dtype (decode.parse_tile); None: decode's default for the pool dtype.
TILES: dict[str, str | None] = {"float32": None, "bfloat16": None}


def variant(hv: int, hk: int, io: str, pool: str, ab: str, param: str, bias_dtype: str | None = None, *,
            width: int = 4, conv_state: str | None = None, weight: str | None = None,
            activation: str = "silu", conv_bias: bool = True, tile: str | None = None) -> dict:
    """A decode_conv variant: decode.py's raw-gate decode variant (l2norm on, default tile) plus
    the conv's width, conv-state and weight dtypes (default io), activation and bias."""
    conv_state, weight = conv_state or io, weight or io
    v = _decode._variant(OP, hv, hk, io, pool, "ab", ab, param, True, tile, bias=bias_dtype)
    if width not in _conv.WIDTHS:
        raise ValueError(f"conv width: expected one of {_conv.WIDTHS}, got {width}")
    if activation not in _conv.ACTIVATIONS:
        raise ValueError(f"activation: expected one of {_conv.ACTIVATIONS}, got {activation!r}")
    for what, dtype in (("conv_state", conv_state), ("conv weight", weight)):
        if dtype not in _conv.CONV_STATE_DTYPES:
            raise ValueError(f"{what} dtype: expected one of {_conv.CONV_STATE_DTYPES}, got {dtype}")
    v.update(width=width, conv_state_dtype=conv_state, weight_dtype=weight, activation=activation,
             conv_bias=bool(conv_bias))
    v["name"] += f"_w{width}_cstate-{conv_state}_wt-{weight}_{activation}_b{int(conv_bias)}"
    return v


def kernel_variants(num_v_heads: int, num_k_heads: int) -> list[dict]:
    """What vLLM's layer hits (width 4, SiLU, conv state and weights in the model dtype, A_log
    fp32 beside a dt_bias in the model dtype): io x pool dtype x conv bias or not. Others compile
    on first use (same cache)."""
    return [variant(num_v_heads, num_k_heads, io, pool, io, "float32", io, conv_bias=has_bias)
            for io in _decode._IO_DTYPES for pool in _decode._POOL_DTYPES for has_bias in (False, True)]


def _program(v: dict):
    p = _decode.kernel_parts(v)
    T, Hv, Hk, G, NV, W, R, NCH, VEC, BV = p.T, p.Hv, p.Hk, p.G, p.NV, p.W, p.R, p.NCH, p.VEC, p.BV
    NT = W * 32                                   # threads per block
    if p.QK_SMEM:
        raise ValueError(f"decode_conv: expected a tile with q/k in registers, got {v['tile']!r}")
    f32, io = "float32", v["io_dtype"]
    sdt, wdt, K = v["conv_state_dtype"], v["weight_dtype"], v["width"]
    H = K - 1                                     # window length
    DIM = (2 * Hk + Hv) * HEAD_DIM
    NVG = NV * G                                  # blocks that read one k-head's q/k windows
    silu, has_bias = v["activation"] == "silu", v["conv_bias"]
    S, L, B = T.dynamic("S"), T.dynamic("L"), p.rows
    sx0, sc0, sc1, sc2, sw0, sw1 = T.dynamic("sx0 sc0 sc1 sc2 sw0 sw1")
    srow, scol = p.srow, p.scol
    prologue, load_state, store_state, zero_rows = p.prologue, p.load_state, p.store_state, p.zero_rows
    gates, normalize_qk_regs, step = p.gates, p.normalize_qk_regs, p.step

    @T.macro
    def conv_channel(X, CS, Wt, Bias, i, slot, c, dst, at):
        # dst[at] <- y[c] rounded to io, in fp32 (conv_decode's order of operations)
        y = T.alloc_var(f32)
        y = T.cast(Bias[c], f32) if has_bias else 0.0
        for j in T.unroll(H):
            y += T.cast(Wt[c, j], f32) * T.cast(CS[slot, c, j], f32)
        y += T.cast(Wt[c, H], f32) * T.cast(X[i, c], f32)
        dst[at] = T.cast(T.cast(_conv.silu_fast(T, y) if silu else y, io), f32)

    @T.macro
    def shift_window(X, CS, i, slot, c):
        for j in T.unroll(H - 1):
            CS[slot, c, j] = CS[slot, c, j + 1]
        CS[slot, c, H - 1] = T.cast(T.cast(X[i, c], f32), sdt)

    @T.prim_func
    def gdn_decode_conv(X: T.StridedTensor((B, DIM), (sx0, 1), io),
                        CS: T.StridedTensor((S, DIM, L), (sc0, sc1, sc2), sdt),
                        Wt: T.StridedTensor((DIM, K), (sw0, sw1), wdt),
                        Bias: T.Tensor((DIM,), wdt),
                        Ga: p.ga_t, Gb: p.gb_t, A_log: p.alog_t, dt_bias: p.dtb_t, Pool: p.pool_t,
                        Slots: T.Tensor((B,), "int32"), Counters: T.Tensor((S, Hk), "int32"),
                        Out: p.out_t, scale: T.float32):
        with T.Kernel(NV, Hv, B, threads=NT) as (bv, h, i):
            ctx = prologue(bv, False)
            tx, lk, row0, st, qv, kv, Sq, Sk, gb = ctx
            yq = T.alloc_shared((2, HEAD_DIM), f32)     # the k-head's q | k after the conv
            yv = T.alloc_shared((BV,), f32)             # the block's v rows after the conv
            last = T.alloc_shared((1,), "int32")
            y3 = T.alloc_local((3,), f32)
            slot = Slots[i]
            hk = h // G
            if slot >= 0:
                load_state(Pool, slot, h, ctx)              # the long pole first
                for it in T.unroll(HEAD_DIM // NT):          # q and k: one channel each per thread
                    c = it * NT + tx
                    conv_channel(X, CS, Wt, Bias, i, slot, hk * HEAD_DIM + c, y3, 0)
                    conv_channel(X, CS, Wt, Bias, i, slot, (Hk + hk) * HEAD_DIM + c, y3, 1)
                    yq[0, c] = y3[0]
                    yq[1, c] = y3[1]
                for it in T.unroll(-(-BV // NT)):            # v: the block's rows, read and shifted
                    r = it * NT + tx                         # by this thread alone
                    if r < BV:
                        conv_channel(X, CS, Wt, Bias, i, slot, (2 * Hk + h) * HEAD_DIM + bv * BV + r, y3, 2)
                        yv[r] = y3[2]
                        shift_window(X, CS, i, slot, (2 * Hk + h) * HEAD_DIM + bv * BV + r)
                T.sync_threads()                             # this block's q/k window reads are done
                if tx == 0:
                    prev = T.atomic_add(Counters[slot, hk], 1, memory_order="acq_rel", return_prev=True)
                    last[0] = T.if_then_else((prev + 1) % NVG == 0, 1, 0)
                for c in T.unroll(NCH):
                    for e in T.unroll(VEC):
                        qv[c * VEC + e] = yq[0, scol(c, lk, e)]
                        kv[c * VEC + e] = yq[1, scol(c, lk, e)]
                normalize_qk_regs(qv, kv, scale)
                gates(Ga, Gb, A_log, dt_bias, i, h, gb)
                step(st, qv, kv, Sq, Sk, lambda r: yv[srow(row0, r) - bv * BV], Out, i, h, row0, lk, tx // 32, gb)
                store_state(Pool, (slot,), h, ctx)
                T.sync_threads()
                if last[0] == 1:                             # every block of the k-head has read
                    for it in T.unroll(HEAD_DIM // NT):
                        shift_window(X, CS, i, slot, hk * HEAD_DIM + it * NT + tx)
                        shift_window(X, CS, i, slot, (Hk + hk) * HEAD_DIM + it * NT + tx)
                    if tx == 0:
                        T.atomic_add(Counters[slot, hk], -NVG)
            else:
                zero_rows(Out, i, 1, h, ctx)

    return gdn_decode_conv


def build(v: dict, target: str):
    """Compile variant ``v`` for ``target`` ("sm_90a" or "sm_100a") through TileLang's cache."""
    return _decode.compile_for(_program, v, target)


# ----------------------------------------------------------------------------------------
# Launcher (layer_ops validated the arguments)
# ----------------------------------------------------------------------------------------

_FAST: dict[tuple, object] = {}
_COUNTERS: dict[tuple, torch.Tensor] = {}


def arrival_counters(conv_state: torch.Tensor, num_k_heads: int) -> torch.Tensor:
    """The int32 [S, Hk] arrival counters of ``conv_state`` (zeroed once, then kept at 0 by the
    kernel itself between launches). One tensor per conv-state buffer (per layer)."""
    key = (conv_state.device, conv_state.data_ptr(), conv_state.shape[0], num_k_heads)
    counters = _COUNTERS.get(key)
    if counters is None:
        counters = _COUNTERS[key] = torch.zeros(conv_state.shape[0], num_k_heads, dtype=torch.int32,
                                                device=conv_state.device)
    return counters


def layer_decode(x, conv_state, weight, bias, pool, slot_ids, *, a, b, A_log, dt_bias, activation, scale,
                 out) -> None:
    """x [B, dim] (unit channel stride), conv_state [S, dim, L >= W-1], weight [dim, W], bias [dim]
    or None, pool [S', Hv, 128, 128], slot_ids [B] int32 (slots of both caches; < 0: padding),
    a, b [B, Hv], A_log, dt_bias [Hv] -> out [B, Hv, 128] (x's dtype); both caches in place."""
    B, hv = x.shape[0], pool.shape[1]
    if B == 0:
        return
    hk = (x.shape[1] // HEAD_DIM - hv) // 2
    key = (x.device, x.dtype, pool.dtype, conv_state.dtype, weight.dtype, a.dtype, A_log.dtype,
           dt_bias.dtype, hv, hk, weight.shape[1], activation, bias is not None, TILES.get(_decode._TORCH_TO_TL.get(pool.dtype)))
    fn = _FAST.get(key)
    if fn is None:
        io = _decode._dtype_name(x.dtype, "mixed_qkv", _decode._IO_DTYPES)
        pdt = _decode._dtype_name(pool.dtype, "pool", _decode._POOL_DTYPES)
        ab, param, gbias = _decode.gate_dtype_names(a, b, A_log, dt_bias)
        v = variant(hv, hk, io, pdt, ab, param, gbias, width=weight.shape[1],
                    conv_state=_decode._dtype_name(conv_state.dtype, "conv_state", _conv.CONV_STATE_DTYPES),
                    weight=_decode._dtype_name(weight.dtype, "conv_weight", _conv.CONV_STATE_DTYPES),
                    activation=activation, conv_bias=bias is not None, tile=TILES.get(pdt))
        fn = _FAST[key] = _decode.launch_function(v, x.device, build)
    _decode.check_pool_alignment(pool)
    fn(x, conv_state, weight, _conv._bias_arg(bias, weight), a, b, A_log, dt_bias, pool, slot_ids,
       arrival_counters(conv_state, hk), out, HEAD_DIM ** -0.5 if scale is None else float(scale))
