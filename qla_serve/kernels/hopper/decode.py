"""TileLang GDN decode and speculative-verify kernels (SM90a; the same code compiles for SM100a):
their variants, compilation and launch. The programs, with the kernels' layout and math:
decode_program.py.

The tile (rows per block, warps, lanes per row, q/k staging, occupancy and cache hints) is part
of the variant; decode_tiles.py holds its grammar (``parse_tile``), the per-pool-dtype choices
measured on the H200 by rows = sequences x v-heads (``DECODE_TILES``, ``AFTER_CONV_TILES``,
``VERIFY_TILES``; benchmarks/decode.md) and the pick per call (``decode_tile``).

Shapes are those of the kernel-module contract (qla_serve/kernels/__init__.py):
batch ``B``, tokens ``T``, sequences ``N``, slots ``S``, intermediate slots ``S'`` and the
draft depth ``D`` are dynamic (one compile serves every batch); head counts and dtypes are
static and name a *variant*. Alignment assumptions (checked on the host by
:func:`_check_alignment` and :func:`check_intermediate_alignment`): pool / intermediate slot
strides and q/k token and head strides are multiples of the 16-byte vector (4 fp32 / 8 bf16
state values, ``VEC`` io elements), and their data pointers are 16-byte aligned -- true for
every engine pool and for q/k views of a fused projection.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations,
# which refer to closure variables (head counts, dtypes).
import functools
import os
from typing import Any

import torch

from .common import (_IO_DTYPES, _TORCH_TO_TL, HEAD_DIM, _check_heads, _dtype_name, check_pool_alignment,
                     compile_for, gate_dtype_names, launch_function)
from .decode_program import _ACC_DTYPES, _POOL_DTYPES, commit_program, program
from .decode_tiles import (AFTER_CONV_MAX_ROWS, AFTER_CONV_TILES, CARD_DECODE_TILES, CARDS, DECODE_TILES,  # noqa: F401
                           STATE_IO_SOURCE, card_of,
                           VERIFY_TILES,  # noqa: F401 (re-exported)
                           decode_tile, decode_tiles, default_tile, parse_tile)

_TORCH_INT = {torch.int32: "int32", torch.int64: "int64"}


# ----------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------

def _variant(op: str, hv: int, hk: int, io: str, pool: str, gating: str, ab: str | None,
             param: str | None, l2norm: bool, tile: str | None = None, bias: str | None = None,
             after_conv: bool = False) -> dict:
    """A JSON-serialisable variant description; ``name`` identifies it uniquely.

    ``param`` is A_log's dtype and ``bias`` dt_bias's (default: A_log's; SGLang keeps A_log in
    fp32 beside a bf16 dt_bias). ``tile`` (see :func:`parse_tile`) defaults to the choice for
    the op and pool dtype (:func:`default_tile`). ``after_conv`` (decode, verify, verify_slots):
    the layers' form, launched as the programmatic dependent of its conv launch (conv_decode
    before :func:`decode`, conv_verify before :func:`verify`, conv_spec before
    :func:`verify_slots`).
    """
    tile = tile or default_tile(pool, op, hv, after_conv)
    parse_tile(tile)
    bias = bias or param
    gate = "gb" if gating == "gb" else f"ab-{ab}-{param}" + (f"-{bias}" if bias != param else "")
    if after_conv and op not in ("decode", "verify", "verify_slots"):
        raise ValueError(f"after_conv: only decode, verify and verify_slots have that form, got op {op!r}")
    name = f"gdn_{op}_hv{hv}_hk{hk}_{io}_pool-{pool}_{gate}_l2{int(l2norm)}_{tile}" + ("_pdl" if after_conv else "")
    v = {"name": name, "op": op, "num_v_heads": hv, "num_k_heads": hk, "io_dtype": io,
         "pool_dtype": pool, "gating": gating, "ab_dtype": ab, "param_dtype": param,
         "bias_dtype": bias, "l2norm": bool(l2norm), "tile": tile}
    if after_conv:
        v["after_conv"] = True
    return v


def kernel_variants(num_v_heads: int, num_k_heads: int) -> list[dict]:
    """Every decode/verify variant a deployment with these TP-local heads can hit.

    Matrix: op {decode, verify} x io dtype {bf16, fp16} x pool {fp32, bf16} x gating
    {g/beta fp32, raw a/b in the io dtype with A_log/dt_bias fp32, a/b and A_log/dt_bias in
    the io dtype, a/b and dt_bias in the io dtype with A_log fp32 (SGLang's and vLLM's layers)}
    x l2norm {off, on} = 64 variants, each in every tile decode_tile can pick for its op on any
    card (two; three for fp32 and four for bf16 decode: 112 more); after_conv decode variants (the layers' decode step), verify_slots
    variants, plain and after_conv (the vLLM layer's spec step), and after_conv verify variants
    (the SGLang layer's verify step), each io x pool x the three raw-gate forms, l2norm on, in
    the tiles their calls reach (after_conv: up to AFTER_CONV_MAX_ROWS rows; 18 after_conv
    decode, 24 + 12 verify_slots, 12 verify); plus 4 commit variants (pool dtype x num_accepted
    int32/int64): 246.
    Other gate dtype combinations and tile overrides (TILE_OVERRIDE) compile on first use
    (JIT, same cache).
    """
    _check_heads(num_v_heads, num_k_heads)
    out = []
    for op in ("decode", "verify"):
        for io in _IO_DTYPES:
            for pool in _POOL_DTYPES:
                for gating, ab, param, bias in (("gb", None, None, None), ("ab", io, "float32", None),
                                                ("ab", io, io, None), ("ab", io, "float32", io)):
                    for l2 in (False, True):
                        for tile in decode_tiles(pool, op=op):
                            out.append(_variant(op, num_v_heads, num_k_heads, io, pool, gating, ab,
                                                param, l2, tile, bias=bias))
    for io in _IO_DTYPES:  # the engine layers' decode and spec steps: raw gates, in-kernel l2norm
        for pool in _POOL_DTYPES:
            for param, bias in (("float32", None), (io, None), ("float32", io)):
                for tile in decode_tiles(pool, after_conv=True):
                    out.append(_variant("decode", num_v_heads, num_k_heads, io, pool, "ab", io, param, True,
                                        tile, bias=bias, after_conv=True))
                for after in (False, True):
                    for tile in decode_tiles(pool, after_conv=after, op="verify_slots"):
                        out.append(_variant("verify_slots", num_v_heads, num_k_heads, io, pool, "ab", io,
                                            param, True, tile, bias=bias, after_conv=after))
                for tile in decode_tiles(pool, after_conv=True, op="verify"):   # SGLang's verify step
                    out.append(_variant("verify", num_v_heads, num_k_heads, io, pool, "ab", io, param, True,
                                        tile, bias=bias, after_conv=True))
    for pool in _POOL_DTYPES:
        for acc in _ACC_DTYPES:
            out.append(_commit_variant(num_v_heads, pool, acc))
    return out


def _commit_variant(hv: int, pool: str, acc: str) -> dict:
    """Variant of the commit kernel (copy of the accepted intermediate state into the slot)."""
    return {"name": f"gdn_commit_hv{hv}_pool-{pool}_acc-{acc}", "op": "commit",
            "num_v_heads": hv, "pool_dtype": pool, "acc_dtype": acc}


# ----------------------------------------------------------------------------------------
# Compilation and in-process cache
# ----------------------------------------------------------------------------------------

def build(variant: dict, target: str):
    """Compile ``variant`` for ``target`` (:func:`compile_for`). The pipelined tiles' threads
    each read back only the ring slice their own cp.async wrote, after their own wait: the block
    barriers TileLang would insert around the ring are not needed (q/k staging syncs its warp)."""
    if variant.get("op") == "commit":
        return compile_for(commit_program, variant, target)
    pipelined = bool(parse_tile(variant["tile"]).pipe_stages)
    return compile_for(program, variant, target, {"tl.disable_thread_storage_sync": True} if pipelined else None)


# (op, device index, q dtype, pool dtype, gate dtypes, l2norm, Hv, Hk, tile) -> launch function.
# Keyed on torch objects so that a hit costs one tuple hash (the host budget is a few µs).
_FAST: dict[tuple, Any] = {}

# Tile override for benchmarks/tuning: the environment variable QLA_DECODE_TILE (read once at
# import) or assigning TILE_OVERRIDE, e.g. "bv32s-mb8" (see parse_tile).
TILE_OVERRIDE: str | None = os.environ.get("QLA_DECODE_TILE") or None


def _launcher(op, q, pool, g, a, A_log, dt_bias, b, beta, l2, tile, after_conv=False):
    """Slow path of the lookup: validate dtypes, name the variant, compile or load it (TileLang
    disk cache, explicit target of the device), and return the raw tvm-ffi function."""
    io = _dtype_name(q.dtype, "q", _IO_DTYPES)
    pdt = _dtype_name(pool.dtype, "pool", _POOL_DTYPES)
    if g is not None:
        if g.dtype != torch.float32 or beta.dtype != torch.float32:
            raise TypeError(f"g/beta: expected float32, got {g.dtype}/{beta.dtype}")
        gating, ab, param, bias = "gb", None, None, None
    else:
        gating = "ab"
        ab, param, bias = gate_dtype_names(a, b, A_log, dt_bias)
    variant = _variant(op, pool.shape[1], q.shape[1], io, pdt, gating, ab, param, l2, tile, bias=bias,
                       after_conv=after_conv)
    return launch_function(variant, q.device, build)


def check_intermediate_alignment(inter) -> None:
    """verify writes and commit_verified reads the intermediate states [S', D, Hv, 128, 128] in
    16-byte vectors, as the pool's: slot and draft-token strides (0, 1) of whole vectors and a
    16-byte aligned base. Host metadata only."""
    vec = 16 // inter.element_size()
    if inter.stride(0) % vec or inter.stride(1) % vec or inter.data_ptr() % 16:
        raise ValueError(f"intermediate: strides (0, 1) must be multiples of {vec} elements, data "
                         f"16-byte aligned, got strides {tuple(inter.stride()[:2])}")


def _check_alignment(vec: int, pool, q, k, inter=None) -> None:
    """Vector-access preconditions (see module docstring); host metadata only."""
    check_pool_alignment(pool)
    for name, x in (("q", q), ("k", k)):
        if x.stride(0) % vec or x.stride(1) % vec or x.data_ptr() % (2 * vec):
            raise ValueError(f"{name}: the decode kernels need token/head strides that are multiples "
                             f"of {vec} elements and a {2 * vec}-byte aligned data pointer (16-byte "
                             f"vector access)")
    if inter is not None:
        check_intermediate_alignment(inter)


@functools.lru_cache(maxsize=None)
def _card(device) -> str:
    """decode_tiles.card_of the device's CUDA name (once per device; "" off CUDA, where the
    argument checks raise before any launch)."""
    return card_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else ""


def _lookup(op, q, pool, g, beta, a, b, A_log, dt_bias, l2, sequences, after_conv=False):
    pdt = pool.dtype
    tile = TILE_OVERRIDE
    if tile is None:
        tile = decode_tile(_TORCH_TO_TL.get(pdt), sequences * pool.shape[1], after_conv, op, _card(pool.device))
    fused = g is None
    key = (op, q.device, q.dtype, pdt, fused, a.dtype if fused else None,
           A_log.dtype if fused else None, dt_bias.dtype if fused else None, bool(l2), pool.shape[1],
           q.shape[1], tile, after_conv)
    fn = _FAST.get(key)
    if fn is None:
        fn = _launcher(op, q, pool, g, a, A_log, dt_bias, b, beta, l2, tile, after_conv)
        _FAST[key] = fn
    return fn


def decode(q, k, v, pool, slot_ids, *, g, beta, a, b, A_log, dt_bias, use_qk_l2norm, scale, out,
           after_conv=False):
    """One token per sequence, state updated in place in ``pool[slot_ids[i]]``.

    q, k [B, Hk, 128], v [B, Hv, 128] (bf16/fp16, last dim contiguous); g, beta [B, Hv] fp32
    or a, b [B, Hv] with A_log, dt_bias [Hv]; pool [S, Hv, 128, 128] fp32/bf16;
    slot_ids [B] int32 (< 0: zero output row, slot untouched); out [B, Hv, 128] (q's dtype).
    No host sync, no allocation: CUDA-graph capturable.
    after_conv: this launch directly follows, on the same stream, the conv_decode launch that
    wrote q/k/v (the GDN layer's decode): it runs as that grid's programmatic dependent, its
    blocks loading their slot ids and states while the conv runs (conv_decode lets them start)
    and reading q/k/v, a and b once the conv grid has finished. The slot ids, the pool and the
    gates must not be written by that conv launch, nor by anything still running before it.
    """
    if q.shape[0] == 0:
        return
    fn = _lookup("decode", q, pool, g, beta, a, b, A_log, dt_bias, use_qk_l2norm, q.shape[0], bool(after_conv))
    _check_alignment(4 if pool.dtype == torch.float32 else 8, pool, q, k)
    if g is None:
        fn(q, k, v, a, b, A_log, dt_bias, pool, slot_ids, out, HEAD_DIM ** -0.5 if scale is None else float(scale))
    else:   # the g/beta variant takes g/beta again in place of A_log/dt_bias (unused)
        fn(q, k, v, g, beta, g, beta, pool, slot_ids, out, HEAD_DIM ** -0.5 if scale is None else float(scale))


def verify(q, k, v, pool, slot_ids, cu_seqlens, intermediate, intermediate_ids, *, g, beta, a, b,
           A_log, dt_bias, use_qk_l2norm, scale, out, after_conv=False):
    """Speculative verify: per sequence i, tokens cu_seqlens[i]:cu_seqlens[i+1] from the state in
    ``pool[slot_ids[i]]`` (only read); the state after token j goes to
    ``intermediate[intermediate_ids[i], j]`` ([S', D, Hv, 128, 128], pool dtype).

    q, k [T, Hk, 128], v [T, Hv, 128]; g, beta [T, Hv] fp32 or a, b [T, Hv] + A_log, dt_bias
    [Hv]; slot_ids, intermediate_ids [N] int32, cu_seqlens [N+1] int32; out [T, Hv, 128].
    A sequence with slot or intermediate id < 0 is padding: zero output, nothing written.
    Sequence lengths must not exceed D (ops' contract); longer ones get outputs for every
    token but intermediate states for the first D only (never a write out of bounds).
    after_conv: this launch directly follows, on the same stream, the conv_verify launch that
    wrote q/k/v (the SGLang layer's verify step), as :func:`decode`'s after_conv: its blocks load
    their ids and states while the conv runs. The ids, cu_seqlens, the pool and the gates must
    not be written by that conv launch, nor by anything still running before it.
    """
    if slot_ids.shape[0] == 0:
        return
    if intermediate.dtype != pool.dtype:
        raise TypeError(f"intermediate: expected the pool dtype {pool.dtype}, got {intermediate.dtype}")
    fn = _lookup("verify", q, pool, g, beta, a, b, A_log, dt_bias, use_qk_l2norm, slot_ids.shape[0],
                 bool(after_conv))
    _check_alignment(4 if pool.dtype == torch.float32 else 8, pool, q, k, intermediate)
    s = HEAD_DIM ** -0.5 if scale is None else float(scale)
    if g is None:
        fn(q, k, v, a, b, A_log, dt_bias, pool, slot_ids, cu_seqlens, intermediate, intermediate_ids, out, s)
    else:
        fn(q, k, v, g, beta, g, beta, pool, slot_ids, cu_seqlens, intermediate, intermediate_ids, out, s)


def verify_slots(q, k, v, pool, spec_slot_ids, num_accepted, cu_seqlens, *, a, b, A_log, dt_bias,
                 use_qk_l2norm, scale, out, after_conv=False):
    """Speculative verify straight into per-token pool slots (vLLM's layout): sequence i starts
    from ``pool[spec_slot_ids[i, num_accepted[i] - 1]]`` and the state after its token j goes to
    ``pool[spec_slot_ids[i, j]]``; no intermediate buffer, no commit.

    q, k [T, Hk, 128], v [T, Hv, 128]; a, b [T, Hv] + A_log, dt_bias [Hv]; spec_slot_ids
    [N, D] int32 (unit column stride; < 0: not written; a row whose first id or source id is
    < 0 is padding: zero outputs); num_accepted [N] int32; cu_seqlens [N+1] int32 (lengths
    <= D); out [T, Hv, 128], rows past cu_seqlens[N] untouched.
    after_conv: this launch directly follows, on the same stream, the conv_spec launch that wrote
    q/k/v (the vLLM layer's spec step), as :func:`decode`'s after_conv: its blocks load their ids
    and source states while the conv runs. The ids, num_accepted, cu_seqlens, the pool and the
    gates must not be written by that conv launch, nor by anything still running before it.
    """
    if spec_slot_ids.shape[0] == 0:
        return
    fn = _lookup("verify_slots", q, pool, None, None, a, b, A_log, dt_bias, use_qk_l2norm,
                 spec_slot_ids.shape[0], bool(after_conv))
    _check_alignment(4 if pool.dtype == torch.float32 else 8, pool, q, k)
    fn(q, k, v, a, b, A_log, dt_bias, pool, spec_slot_ids, num_accepted, cu_seqlens, out,
       HEAD_DIM ** -0.5 if scale is None else float(scale))


def commit_verified(pool, slot_ids, intermediate, intermediate_ids, num_accepted):
    """In-place commit of the accepted speculative step: ``pool[slot_ids[i]] =
    intermediate[intermediate_ids[i], num_accepted[i] - 1]`` for every sequence with
    slot_ids[i] >= 0, intermediate_ids[i] >= 0 and num_accepted[i] > 0; other slots untouched.

    pool [S, Hv, 128, 128], intermediate [S', D, Hv, 128, 128] (pool dtype), slot_ids /
    intermediate_ids [N] int32, num_accepted [N] int32 or int64. No host sync, no allocation.
    """
    if slot_ids.shape[0] == 0:
        return
    key = ("commit", pool.device, pool.dtype, num_accepted.dtype, pool.shape[1])
    fn = _FAST.get(key)
    if fn is None:
        if intermediate.dtype != pool.dtype:
            raise TypeError(f"intermediate: expected the pool dtype {pool.dtype}, got {intermediate.dtype}")
        pdt = _dtype_name(pool.dtype, "pool", _POOL_DTYPES)
        acc = _TORCH_INT.get(num_accepted.dtype)
        if acc is None:
            raise TypeError(f"num_accepted: expected int32 or int64, got {num_accepted.dtype}")
        fn = _FAST[key] = launch_function(_commit_variant(pool.shape[1], pdt, acc), pool.device, build,
                                          "commit_verified")
    if intermediate.dtype != pool.dtype:
        raise TypeError(f"intermediate: expected the pool dtype {pool.dtype}, got {intermediate.dtype}")
    check_pool_alignment(pool)
    check_intermediate_alignment(intermediate)
    fn(pool, slot_ids, intermediate, intermediate_ids, num_accepted)
