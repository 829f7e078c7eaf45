"""Prefill stage 2, V-first (the default at v_split 1 and 2 on sm_90a; validated on the H200): the chunk walk
of prefill_main.py with the state held transposed, X = S^T ([BV, 128], value rows, as the pool
stores it), so that every GEMM on the chain takes its A operand from registers.

Same work items, modes and gate warmup as prefill_main.main_func (see there), but it reads v and
M itself instead of U0 and -Wk (stage 1's form "m", prefill_prep.py: 8 KB of M per chunk and
head instead of 32 KB of U0 and Wk written and read back through HBM). Per chunk, with M, P
and the gate factors exp(gc), dec from stage 1 and Xh = fp16(X) in registers:
  Y^T  = Xh K^T                                    [BV, 64]  wgmma, A = Xh
  O^T  = scale (Xh Q^T) diag(exp gc)               [BV, 64]  same batch, A = Xh
  R^T  = V^T - Y^T diag(exp gc)                    (V = 0 for the transition Phi)
  V'^T = fp16(R^T) M^T                             [BV, 64]  A = fp16(R^T)
  O^T += fp16(V'^T) P^T                                      A = fp16(V'^T)
  X   <- gamma_last X + fp16(V'^T diag(dec)) K     [BV, 128] A = fp16(V'^T diag(dec))
i.e. the transpose of V' = M (V - diag(exp gc) K S) (= prefill_main's U0 - Wk Hs),
O = scale diag(exp gc) Q Hs + P V', S <- gamma_last S + K^T diag(dec) V'; the float64 truth is
reference.recurrent_gdn. Rows >= n of a chunk's v tile (the next sequence's, or zeros past T)
meet only M's zero columns (beta = 0 there).

Warp roles (BV / 64 consumer warpgroups + one producer warpgroup):
  consumers  each owns 64 value rows of X, end to end: it computes V', O and the state update
             for its rows. Nothing passes between consumer warpgroups on the chain (no fp16
             copy of S or V' in shared memory, no named barrier): they share the TMA stages and
             the O tiles.
  producer   one warp issuing the TMA loads of the next chunk (two stages), one "storer"
             warp issuing the TMA store of each whole chunk's O tile (two tiles: the consumers
             write tile j % 2 once chunk j - 2's store has read it; mbarriers o_full / o_free),
             and, for whole-sequence plans at v_split 1 (packed), two "unpack" warps that turn
             stage 1's packed tile (P^T above M, prefill_prep's packed form "m") into the
             zero-filled M and P^T tiles the GEMMs take, in shared memory, once a stage's TMA bytes land
             (mbarrier loaded) and before the consumers may read it (mbarrier ready): stage 1's
             P and M cross HBM as one 8 KB tile per chunk and head. The context-parallel passes
             and V-split plans read P and M apart (prefill_api.packed_tiles).
             A sequence's last, partial chunk is stored by the consumers themselves, row by row
             (TMA clips at T, not at the sequence's end).
Only v_split 1 (two consumer warpgroups, 384 threads) and 2 (one, 256 threads): a wgmma tile
has 64 rows per warpgroup, so BV = 32 (v_split 4) does not map onto it.

Why: v7's profile put ~45% of the state warpgroup's samples around the shared-memory copy of
S and the barrier waits beside it (benchmarks/prefill.md); here there is neither. Measured on
the H200 (benchmarks/prefill.md v9/v10): 3.3 us per chunk at v_split 1 (v7's profile: 5.3), and
faster than v8 on every bench row where it applies. Since v14 it reads v and M (prep form "m"),
since v16 the storer warp takes the O tiles: ~3.6 us per chunk at v_split 1 with one CTA per SM
(v15's ncu: latency-bound, issue slots 27% busy), against ~1.1 us of tensor work
(benchmarks/prefill.md v13o-v16).
"""

from pathlib import Path

import tilelang
import tilelang.language as T

from .prefill_main import C, DK, DV, MODES, _NREG_PRODUCER, checkpoint_chunk, item_walker, qk_tile_loader
from .prefill_main import PASS_CONFIGS as _MAIN_PASS_CONFIGS

# Every shared-memory handoff in this kernel goes through its own mbarriers (TMA stages, the O
# tiles), so TileLang's automatic barrier insertion is off: for the O tiles it added two
# barriers over all consumer threads per chunk, on the chain.
PASS_CONFIGS = {**_MAIN_PASS_CONFIGS, tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}

V_SPLITS = (1, 2)
# Registers per consumer thread after setmaxnreg.inc at v_split 1 (the producer warpgroup gives
# its own back: 2 x 128 x 224 + 128 x 40 <= 65536 at 384 threads). Without it ptxas holds the
# consumers to the launch's 168 and spills ~270 bytes; at v_split 2 (256 threads) the launch
# allocation is already 255.
_NREG_CONSUMER = 224
# Elements per 16 bytes of a pool slot: prefill_api checks that the slot stride is a multiple.
_POOL_VEC = {"float32": 4, "bfloat16": 8}


# Stage 2's unpack of stage 1's packed P^T / M tile (csrc/unpack_pm.cuh, T.import_source).
UNPACK_SOURCE = (Path(__file__).with_name("csrc") / "unpack_pm.cuh").read_text()


def main_func(num_v_heads: int, num_k_heads: int, io_dtype: str, pool_dtype: str, v_split: int,
              mode: str = "output", pdl: bool = False, packed: bool = False):
    """Build the V-first stage-2 PrimFunc: the signature and semantics of
    prefill_main.main_func (work items, modes "output"/"maps", gate warmup, pdl), v_split 1 or 2.
    packed: stage 1 wrote P^T and M packed (prefill_prep's packed form; the argument `pd` is then
    M's diagonal [NC, Hv, 64], else P [NC, Hv, 64, 64] beside M in mbuf), unpacked by two
    producer warps; the context-parallel passes and V-split plans take the tiles apart
    (prefill_api.packed_tiles: the maps pass reads M alone, where the unpack would only add
    latency, and a V-split CTA would unpack the whole tile for half the chain's work)."""
    if v_split not in V_SPLITS:
        raise ValueError(f"v_split must be one of {V_SPLITS} for the V-first kernel, got {v_split}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    maps_mode = mode == "maps"
    if packed and maps_mode:
        raise ValueError("packed: output mode only (the maps pass reads M alone, apart)")
    Hv, Hk = num_v_heads, num_k_heads
    group = Hv // Hk
    BV = DV // v_split
    consumers = 128 * (BV // 64)
    threads = consumers + 128
    n_vblocks = 2 * v_split if maps_mode else v_split
    ntok = T.dynamic("ntok")
    nseq = T.dynamic("nseq")
    nslot = T.dynamic("nslot")
    nhis = T.dynamic("nhis")
    nchunk = T.dynamic("nchunk")
    nitem = T.dynamic("nitem")
    nmap = T.dynamic("nmap")
    nwarm = T.dynamic("nwarm")
    ncut = T.dynamic("ncut")
    sq0, sq1 = T.dynamic("sq0"), T.dynamic("sq1")
    sk0, sk1 = T.dynamic("sk0"), T.dynamic("sk1")
    sv0, sv1 = T.dynamic("sv0"), T.dynamic("sv1")
    so0, so1 = T.dynamic("so0"), T.dynamic("so1")
    sp0 = T.dynamic("sp0")
    mm = "float16"
    acc = "float32"
    load_chunk = _chunk_loader(maps_mode, BV, packed)
    unpack = _unpacker(consumers + 64) if packed else None
    chain_step = _chain_step(maps_mode, BV, packed)
    emit_o, store_o = _output_movers(BV, io_dtype)
    walk_item, pool_load = item_walker(maps_mode, v_split)
    pd_t = _pd_type(packed, nchunk, Hv)

    @T.prim_func
    def gdn_prefill_main_vfirst(
        q: T.StridedTensor((ntok, Hk, DK), (sq0, sq1, 1), mm),
        k: T.StridedTensor((ntok, Hk, DK), (sk0, sk1, 1), mm),
        values: T.StridedTensor((ntok, Hv, DV), (sv0, sv1, 1), io_dtype),  # v (loop variables take `v`)
        fbuf: T.Tensor((nchunk, Hv, 2, C), "float32"),
        pd: pd_t,  # packed: M's diagonal; else P
        mbuf: T.Tensor((nchunk, Hv, C, C), mm),  # packed: P^T on and above the diagonal, M below; else M
        pool: T.StridedTensor((nslot, Hv, DV, DK), (sp0, DV * DK, DK, 1), pool_dtype),
        slot_ids: T.Tensor((nseq,), "int32"),
        has_init: T.Tensor((nhis,), "uint8"),
        cu_seqlens: T.Tensor((nseq + 1,), "int32"),
        chunk_offsets: T.Tensor((nseq + 1,), "int32"),
        items: T.Tensor((nitem, 4), "int32"),
        maps: T.Tensor((nmap, Hv, 2, DV, DK), "float32"),
        warm_start: T.Tensor((nwarm, Hv), "int32"),
        need_maps: T.Tensor((ncut, Hv), "int32"),
        ckpt_chunk: T.Tensor((nseq,), "int32"),
        ckpt_slot: T.Tensor((nseq,), "int32"),
        out: T.StridedTensor((ntok, Hv, DV), (so0, so1, 1), io_dtype),
        scale: T.float32,
        all_init: T.int32,
        use_items: T.int32,
        use_warmup: T.int32,
        use_ckpt: T.int32,
    ):
        with T.Kernel(n_vblocks, Hv, nitem, threads=threads) as (vb, h, it):
            if pdl:  # a programmatic dependent launch (prefill_api.CP_PDL)
                T.pdl_trigger()
                T.pdl_sync()
            # Slot strides in 16-byte vectors (checked on the host, prefill_api, as decode does):
            # the state enters and leaves as whole fragment pairs, 8 bytes per access, not 4.
            T.assume(sp0 % _POOL_VEC[pool_dtype] == 0)
            hk = h // group
            v0 = (vb % v_split) * BV  # value rows (or, for Phi blocks, the rows of Phi^T)
            q_s, k_s, p_s, v_s, m_s, pm_s, d_s, f_s, o_s = _ring_tiles(packed, BV, io_dtype)
            x_f, xh_f, vp_f, rh_f, vph_f, vpd_f, o_f = chain_fragments(BV)
            loaded, ready = _ring_barriers(packed)
            free = T.alloc_barrier([consumers, consumers])  # stage consumed by every consumer
            o_full = T.alloc_barrier([consumers, consumers])  # O tile written by every consumer
            o_free = T.alloc_barrier([32, 32])  # O tile read by its TMA store (the storer warp)

            # The item and where its walk starts: as in prefill_main.
            s = T.alloc_var("int32")
            first = T.alloc_var("int32")
            nck = T.alloc_var("int32")
            midx = T.alloc_var("int32")
            start = T.alloc_var("int32")
            skip = T.alloc_var("int32")
            seq_eos, bos, item_end, eos, coff, warm_chunks, is_phi, init_copy, nchunks = \
                walk_item(s, first, nck, midx, start, skip, it, h, vb, items, cu_seqlens, chunk_offsets,
                          warm_start, need_maps, ncut, use_items, use_warmup)
            tx = T.get_thread_binding()

            if tx < consumers:
                if threads > 256:  # setmaxnreg.inc below the launch allocation is illegal
                    T.set_max_nreg(_NREG_CONSUMER, 1)
                slot = slot_ids[s]
                load = T.alloc_var("int32")
                pool_load(load, slot, s, start, midx, has_init, all_init)
                if is_phi and not init_copy:
                    for v, d in T.Parallel(BV, DK):
                        x_f[v, d] = T.if_then_else(d == v0 + v, 1.0, 0.0)
                elif load != 0:
                    for v, d in T.Parallel(BV, DK):
                        x_f[v, d] = T.cast(pool[slot, h, v0 + v, d], acc)
                else:
                    T.clear(x_f)
                    if not maps_mode:
                        if midx >= 0:
                            if first == 0:  # a cut sequence's first segment: the pool state's copy
                                for v, d in T.Parallel(BV, DK):
                                    x_f[v, d] = maps[midx, h, 1, v0 + v, d]
                            elif start == first:  # exact path: the true state (maps pass + scan)
                                for v, d in T.Parallel(BV, DK):
                                    x_f[v, d] = maps[midx, h, 0, v0 + v, d]
                ck, ck_slot = checkpoint_chunk(ckpt_chunk, ckpt_slot, use_ckpt, s, start, warm_chunks)
                for c in T.serial(nchunks):
                    st = c % 2
                    t0 = bos + c * C
                    n = T.min(eos - t0, C)
                    emit = c >= warm_chunks  # warmup chunks: the state only
                    chain_step(st, (c // 2) % 2, emit, is_phi, scale, x_f, xh_f, vp_f, rh_f, vph_f, vpd_f, o_f, q_s,
                               k_s, v_s, m_s, p_s, f_s, loaded, ready)
                    if not maps_mode:
                        if c == ck:  # the state after the checkpoint's chunk: into its slot
                            for v, d in T.Parallel(BV, DK):
                                pool[ck_slot, h, v0 + v, d] = T.cast(x_f[v, d], pool_dtype)
                    T.barrier_arrive(free[st])
                    if not maps_mode:
                        if emit:
                            emit_o(c - warm_chunks, n, t0, h, v0, o_f, o_s, out, o_full, o_free)
                if maps_mode:
                    if nchunks > 0 or init_copy:
                        for v, d in T.Parallel(BV, DK):
                            maps[midx, h, vb // v_split, v0 + v, d] = x_f[v, d]
                elif slot >= 0 and item_end >= seq_eos:  # the sequence's last segment
                    for v, d in T.Parallel(BV, DK):
                        pool[slot, h, v0 + v, d] = T.cast(x_f[v, d], pool_dtype)

            else:
                T.set_max_nreg(_NREG_PRODUCER, 0)
                if not maps_mode:
                    if tx >= consumers + 32 and tx < consumers + 64:
                        # The storer warp: each whole output chunk's TMA store, in chunk order.
                        for c in T.serial(nchunks):
                            t0 = bos + c * C
                            if c >= warm_chunks and eos - t0 >= C:
                                store_o(c - warm_chunks, t0, h, v0, o_s, out, o_full, o_free)
                if tx < consumers + 32:
                    for c in T.serial(nchunks):
                        load_chunk(c, bos + c * C, coff + c, hk, h, v0, q, k, values, pd, fbuf, mbuf,
                                   q_s, k_s, p_s, f_s, v_s, m_s, pm_s, d_s, loaded, free)
                if packed:
                    if tx >= consumers + 64:
                        for c in T.serial(nchunks):
                            unpack(c, pm_s, d_s, m_s, p_s, loaded, ready)

    return gdn_prefill_main_vfirst, threads


def chain_fragments(BV: int):
    """The chain's register tiles (_chain_step's x_f .. o_f) for BV value rows: X = S^T [BV, 128]
    fp32 and its fp16 copy Xh; (K S)^T, then V'^T [BV, 64] fp32; R^T = (V - diag(exp gc) K S)^T,
    V'^T and (V' diag(dec))^T in fp16; O^T fp32."""
    x_f = T.alloc_fragment((BV, DK), "float32")
    xh_f = T.alloc_fragment((BV, DK), "float16")
    vp_f = T.alloc_fragment((BV, C), "float32")
    rh_f = T.alloc_fragment((BV, C), "float16")
    vph_f = T.alloc_fragment((BV, C), "float16")
    vpd_f = T.alloc_fragment((BV, C), "float16")
    o_f = T.alloc_fragment((BV, C), "float32")
    return x_f, xh_f, vp_f, rh_f, vph_f, vpd_f, o_f


def _chain_step(maps_mode: bool, BV: int, packed: bool, order=None):
    """The consumers' work on one chunk in ring stage st (phase: its mbarrier parity): wait for
    the stage, then V', O and the state update (module docstring), shared by main_func,
    persistent_func and prefill_fused. emit (a PrimExpr, or True): the chunk's O is computed
    (False for warmup chunks); is_phi (maps mode): the block walks the transition Phi (V = 0).
    order: None, or a pair of macros (wait, notify) around each of the three wgmma issues
    (prefill_fused's ping-pong: the two consumer warpgroups take turns to issue)."""
    mm, acc = "float16", "float32"
    rows = T.GemmWarpPolicy.FullRow  # value rows split across the consumer warpgroups
    order_wait, order_notify = order or (None, None)

    @T.macro
    def chain_step(st, phase, emit, is_phi, scale, x_f, xh_f, vp_f, rh_f, vph_f, vpd_f, o_f, q_s, k_s, v_s,
                   m_s, p_s, f_s, loaded, ready):
        if packed:
            T.barrier_wait(loaded[st], phase)  # the stage's TMA tiles
        T.barrier_wait(ready[st], phase)  # packed: M and P^T unpacked from them (_unpacker)
        for v, d in T.Parallel(BV, DK):
            xh_f[v, d] = T.cast(x_f[v, d], mm)
        # (K S)^T = Xh K^T and O^T = Xh Q^T; R^T = V^T - (K S)^T diag(exp gc) (V = 0
        # for the transition Phi); V'^T = R^T M^T.
        if order is not None:
            order_wait()
        T.wgmma_gemm(xh_f, k_s[st, :, :], vp_f, transpose_B=True, clear_accum=True, policy=rows)
        if not maps_mode:
            if emit:
                T.wgmma_gemm(xh_f, q_s[st, :, :], o_f, transpose_B=True, clear_accum=True,
                             policy=rows)
        if order is not None:
            order_notify()
        T.wait_wgmma(0)
        if maps_mode:
            for v, i in T.Parallel(BV, C):
                rh_f[v, i] = T.cast(T.if_then_else(is_phi, 0.0, T.cast(v_s[st, i, v], acc))
                                    - vp_f[v, i] * f_s[st, 0, i], mm)
        else:
            for v, i in T.Parallel(BV, C):
                rh_f[v, i] = T.cast(T.cast(v_s[st, i, v], acc) - vp_f[v, i] * f_s[st, 0, i], mm)
        if order is not None:
            order_wait()
        T.wgmma_gemm(rh_f, m_s[st, :, :], vp_f, transpose_B=True, clear_accum=True, policy=rows)
        if order is not None:
            order_notify()
        T.wait_wgmma(0)
        # X <- gamma_last X + (V' diag(dec))^T K ; O^T = scale O^T diag(exp gc) + V'^T P^T
        for v, i in T.Parallel(BV, C):
            vpd_f[v, i] = T.cast(vp_f[v, i] * f_s[st, 1, i], mm)
        gl = T.alloc_var(acc)
        gl = f_s[st, 0, C - 1]
        for v, d in T.Parallel(BV, DK):
            x_f[v, d] = x_f[v, d] * gl
        if order is not None:
            order_wait()
        T.wgmma_gemm(vpd_f, k_s[st, :, :], x_f, policy=rows)
        if not maps_mode:
            if emit:
                for v, i in T.Parallel(BV, C):
                    vph_f[v, i] = T.cast(vp_f[v, i], mm)
                    o_f[v, i] = o_f[v, i] * (f_s[st, 0, i] * scale)
                # packed: p_s holds P^T (_unpacker), else P
                T.wgmma_gemm(vph_f, p_s[st, :, :], o_f, transpose_B=not packed, policy=rows)
        if order is not None:
            order_notify()
        T.wait_wgmma(0)

    return chain_step


@T.macro
def state_in(x_f, pool, slot, s, h, v0, has_init, all_init):
    """A whole sequence's initial X = S^T (value rows v0 .. v0 + BV of head h) into the fp32
    fragment x_f [BV, 128]: from pool slot `slot` where it is live (slot >= 0) and the sequence
    has one (all_init, or has_init[s]), else zero. The persistent grid's and prefill_fused's."""
    load = T.alloc_var("int32")
    load = 0
    if slot >= 0:
        if all_init != 0:
            load = 1
        elif has_init[s] != 0:
            load = 1
    if load != 0:
        for v, d in T.Parallel(x_f.shape[0], DK):
            x_f[v, d] = T.cast(pool[slot, h, v0 + v, d], "float32")
    else:
        T.clear(x_f)


def _output_movers(BV: int, io_dtype: str):
    """The O of one chunk on its way out, shared by main_func and persistent_func: emit_o (the
    consumers) and store_o (the storer warp). A whole chunk (the j-th written) goes transposed
    into the swizzled tile j % 2 and its TMA store is issued by the storer warp; the consumers
    wait only for the store of chunk j - 2 to have read the tile (v15 stored it from the
    consumers, between two barriers over all of them: 11% of the pass's stall samples). A
    sequence's last, partial chunk is written by the consumers row by row: TMA would clip at T,
    not at the sequence's end."""

    @T.macro
    def emit_o(j, n, t0, h, v0, o_f, o_s, out, o_full, o_free):
        if n == C:
            T.barrier_wait(o_free[j % 2], (j // 2 + 1) % 2)
            for v, i in T.Parallel(BV, C):
                o_s[j % 2, i, v] = T.cast(o_f[v, i], io_dtype)
            T.fence_proxy_async()  # generic-proxy writes, read by the TMA unit
            T.barrier_arrive(o_full[j % 2])
        else:
            for v, i in T.Parallel(BV, C):
                if i < n:
                    out[t0 + i, h, v0 + v] = T.cast(o_f[v, i], io_dtype)

    @T.macro
    def store_o(j, t0, h, v0, o_s, out, o_full, o_free):
        T.barrier_wait(o_full[j % 2], (j // 2) % 2)
        T.tma_copy(o_s[j % 2, :, :], out[t0:t0 + C, h, v0:v0 + BV], leader_scope_threads=32)
        T.tma_store_wait(0)
        T.sync_warp()  # the issuing lane has seen the tile read
        T.barrier_arrive(o_free[j % 2])

    return emit_o, store_o

def _chunk_loader(maps_mode: bool, BV: int, packed: bool):
    """The producer's TMA loads of one chunk into stage c % 2 (q only for outputs), after every
    consumer released that stage: q, k, the gate factors, v, and packed stage 1's packed P^T / M
    tile and M's diagonal (pd), else P (pd; outputs only) and M. v rows past T arrive as zeros
    (TMA bounds). Unpacked, `loaded` is the stage's `ready` (_ring_barriers)."""
    load_qk_tiles = qk_tile_loader(maps_mode, with_p=not packed)

    @T.macro
    def load_chunk(c, t0, cidx, hk, h, v0, q, k, values, pd, fbuf, mbuf, q_s, k_s, p_s, f_s, v_s, m_s, pm_s, d_s,
                   loaded, free):
        st = c % 2
        T.barrier_wait(free[st], (c // 2 + 1) % 2)
        load_qk_tiles(st, t0, cidx, hk, h, q, k, pd, fbuf, q_s, k_s, p_s, f_s, loaded)
        T.tma_copy(values[t0:t0 + C, h, v0:v0 + BV], v_s[st, :, :], barrier=loaded[st])
        if packed:
            T.tma_copy(mbuf[cidx, h, 0:C, 0:C], pm_s[st, :, :], barrier=loaded[st])
            T.tma_copy(pd[cidx, h, 0:C], d_s[st, :], barrier=loaded[st])
        else:
            T.tma_copy(mbuf[cidx, h, 0:C, 0:C], m_s[st, :, :], barrier=loaded[st])
        T.barrier_arrive(loaded[st])

    return load_chunk


def _pd_type(packed: bool, nchunk, Hv: int):
    """Stage 2's `pd` argument: M's diagonal [NC, Hv, 64] packed, else P [NC, Hv, 64, 64]."""
    return T.Tensor((nchunk, Hv, C), "float16") if packed else T.Tensor((nchunk, Hv, C, C), "float16")


def _ring_tiles(packed: bool, BV: int, io_dtype: str):
    """The two-stage ring's shared tiles: q, k, P (P^T when packed), v, M, and when packed stage
    1's tile as loaded and M's diagonal (else None), the gate factors, and O on its way out."""
    mm = "float16"
    q_s = T.alloc_shared((2, C, DK), mm)
    k_s = T.alloc_shared((2, C, DK), mm)
    p_s = T.alloc_shared((2, C, C), mm)
    v_s = T.alloc_shared((2, C, BV), io_dtype)
    m_s = T.alloc_shared((2, C, C), mm)
    pm_s = T.alloc_shared((2, C, C), mm) if packed else None  # stage 1's packed tile, as loaded
    d_s = T.alloc_shared((2, C), mm) if packed else None  # M's diagonal
    f_s = T.alloc_shared((2, 2, C), "float32")  # exp(gc), dec
    o_s = T.alloc_shared((2, C, BV), io_dtype)  # O of whole chunks on their way out (TMA)
    # Swizzled: each thread reads V^T (R's first term) down a column of the tile, 4 rows
    # 256 bytes apart per warp load: the same banks, 4-way conflicts, when row-major.
    layouts = {v_s: tilelang.layout.make_swizzled_layout(v_s), o_s: tilelang.layout.make_swizzled_layout(o_s)}
    if packed:  # the unpack moves 16-byte pieces by position: the three tiles share one swizzle
        layouts.update({t: tilelang.layout.make_swizzled_layout(t) for t in (pm_s, m_s, p_s)})
    T.annotate_layout(layouts)
    if packed:
        T.import_source(UNPACK_SOURCE)
    return q_s, k_s, p_s, v_s, m_s, pm_s, d_s, f_s, o_s


def _ring_barriers(packed: bool):
    """(loaded, ready) per ring stage: packed, the TMA tiles (the producer warp + their bytes) and
    then M and P^T unpacked (the two unpack warps); else one barrier, stage filled, for both."""
    if packed:
        return T.alloc_barrier([32, 32]), T.alloc_barrier([64, 64])
    ready = T.alloc_barrier([32, 32])
    return ready, ready


def _unpacker(first_thread: int):
    """Two producer warps' work on each chunk of stage c % 2, between its TMA loads and the
    consumers: stage 1's packed tile (P^T on and above the diagonal, M's strict lower triangle
    below; M's diagonal apart) into the zero-filled M and P^T tiles the chain's GEMMs take,
    by UNPACK_SOURCE's qla_unpack_pm: branch-free, 16-byte pieces, position by position (the
    three tiles share the 128-byte swizzle). Output mode only, so always with P^T."""

    @T.macro
    def unpack(c, pm_s, d_s, m_s, p_s, loaded, ready):
        st = c % 2
        t = T.get_thread_binding() - first_thread
        T.barrier_wait(loaded[st], (c // 2) % 2)
        T.call_extern("handle", "qla_unpack_pm", T.address_of(pm_s[st, 0, 0]), T.address_of(d_s[st, 0]),
                      T.address_of(m_s[st, 0, 0]), T.address_of(p_s[st, 0, 0]), t, 1)
        T.fence_proxy_async()  # generic-proxy writes, read by wgmma
        T.barrier_arrive(ready[st])

    return unpack


def persistent_func(num_v_heads: int, num_k_heads: int, io_dtype: str, pool_dtype: str, v_split: int,
                    packed: bool = False):
    """The V-first stage 2 for plain and V-split plans (whole sequences, output mode) on a
    persistent grid: CTA b walks work units b, b + G, b + 2 G, ... (G CTAs, the length of
    ``ctas``; unit u = (item u // (Hv v_split), head, value block), items in the host's order,
    longest first), so that the producer loads the next unit's first chunk while the consumers
    finish the current one, and a unit's state load and store overlap its neighbours' work
    instead of each CTA paying them alone. Ring stages and O tiles continue across units
    (running chunk counts); each unit's operations are main_func's, so the results are
    bit-identical to a CTA per unit. Measured on the H200: 1.4-3% faster on batches of 8-chunk
    sequences, level or slower on longer ones (benchmarks/prefill.md), so prefill_api takes it
    only for short sequences dealt evenly enough (persistent_applies). packed: as main_func's."""
    if v_split not in V_SPLITS:
        raise ValueError(f"v_split must be one of {V_SPLITS} for the V-first kernel, got {v_split}")
    Hv, Hk = num_v_heads, num_k_heads
    group = Hv // Hk
    BV = DV // v_split
    consumers = 128 * (BV // 64)
    threads = consumers + 128
    ntok = T.dynamic("ntok")
    nseq = T.dynamic("nseq")
    nslot = T.dynamic("nslot")
    nhis = T.dynamic("nhis")
    nchunk = T.dynamic("nchunk")
    nitem = T.dynamic("nitem")
    ncta = T.dynamic("ncta")
    sq0, sq1 = T.dynamic("sq0"), T.dynamic("sq1")
    sk0, sk1 = T.dynamic("sk0"), T.dynamic("sk1")
    sv0, sv1 = T.dynamic("sv0"), T.dynamic("sv1")
    so0, so1 = T.dynamic("so0"), T.dynamic("so1")
    sp0 = T.dynamic("sp0")
    mm = "float16"
    load_chunk = _chunk_loader(False, BV, packed)
    unpack = _unpacker(consumers + 64) if packed else None
    chain_step = _chain_step(False, BV, packed)
    emit_o, store_o = _output_movers(BV, io_dtype)
    nunits = nitem * Hv * v_split
    pd_t = _pd_type(packed, nchunk, Hv)

    @T.prim_func
    def gdn_prefill_main_persistent(
        q: T.StridedTensor((ntok, Hk, DK), (sq0, sq1, 1), mm),
        k: T.StridedTensor((ntok, Hk, DK), (sk0, sk1, 1), mm),
        values: T.StridedTensor((ntok, Hv, DV), (sv0, sv1, 1), io_dtype),
        fbuf: T.Tensor((nchunk, Hv, 2, C), "float32"),
        pd: pd_t,  # packed: M's diagonal; else P (as main_func's)
        mbuf: T.Tensor((nchunk, Hv, C, C), mm),  # packed: P^T on and above the diagonal, M below; else M
        pool: T.StridedTensor((nslot, Hv, DV, DK), (sp0, DV * DK, DK, 1), pool_dtype),
        slot_ids: T.Tensor((nseq,), "int32"),
        has_init: T.Tensor((nhis,), "uint8"),
        cu_seqlens: T.Tensor((nseq + 1,), "int32"),
        chunk_offsets: T.Tensor((nseq + 1,), "int32"),
        items: T.Tensor((nitem,), "int32"),  # sequences, longest first
        ctas: T.Tensor((ncta,), "int32"),  # unread: its length is the grid
        ckpt_chunk: T.Tensor((nseq,), "int32"),
        ckpt_slot: T.Tensor((nseq,), "int32"),
        out: T.StridedTensor((ntok, Hv, DV), (so0, so1, 1), io_dtype),
        scale: T.float32,
        all_init: T.int32,
        use_ckpt: T.int32,
    ):
        with T.Kernel(ncta, threads=threads) as bx:
            T.assume(sp0 % _POOL_VEC[pool_dtype] == 0)
            q_s, k_s, p_s, v_s, m_s, pm_s, d_s, f_s, o_s = _ring_tiles(packed, BV, io_dtype)
            x_f, xh_f, vp_f, rh_f, vph_f, vpd_f, o_f = chain_fragments(BV)
            loaded, ready = _ring_barriers(packed)
            free = T.alloc_barrier([consumers, consumers])
            o_full = T.alloc_barrier([consumers, consumers])
            o_free = T.alloc_barrier([32, 32])
            tx = T.get_thread_binding()
            nmine = T.ceildiv(nunits - bx, ncta)  # this CTA's units
            gdone = T.alloc_var("int32")  # chunks this role walked in earlier units (ring phase)
            jdone = T.alloc_var("int32")  # whole O chunks stored in earlier units (O tile phase)
            gdone = 0
            jdone = 0

            if tx < consumers:
                if threads > 256:
                    T.set_max_nreg(_NREG_CONSUMER, 1)
                for w in T.serial(nmine):
                    u = bx + w * ncta
                    vb = u % v_split
                    h = (u // v_split) % Hv
                    s = items[u // (v_split * Hv)]
                    v0 = vb * BV
                    bos = cu_seqlens[s]
                    eos = cu_seqlens[s + 1]
                    nchunks = T.ceildiv(eos - bos, C)
                    slot = slot_ids[s]
                    state_in(x_f, pool, slot, s, h, v0, has_init, all_init)
                    ck, ck_slot = checkpoint_chunk(ckpt_chunk, ckpt_slot, use_ckpt, s, 0, 0)
                    for c in T.serial(nchunks):
                        g = gdone + c
                        st = g % 2
                        t0 = bos + c * C
                        n = T.min(eos - t0, C)
                        chain_step(st, (g // 2) % 2, True, False, scale, x_f, xh_f, vp_f, rh_f, vph_f, vpd_f, o_f,
                                   q_s, k_s, v_s, m_s, p_s, f_s, loaded, ready)
                        if c == ck:
                            for v, d in T.Parallel(BV, DK):
                                pool[ck_slot, h, v0 + v, d] = T.cast(x_f[v, d], pool_dtype)
                        T.barrier_arrive(free[st])
                        emit_o(jdone + c, n, t0, h, v0, o_f, o_s, out, o_full, o_free)  # (whole chunks: j)
                    if slot >= 0:
                        for v, d in T.Parallel(BV, DK):
                            pool[slot, h, v0 + v, d] = T.cast(x_f[v, d], pool_dtype)
                    gdone = gdone + nchunks
                    jdone = jdone + (eos - bos) // C

            else:
                T.set_max_nreg(_NREG_PRODUCER, 0)
                for w in T.serial(nmine):
                    u = bx + w * ncta
                    vb = u % v_split
                    h = (u // v_split) % Hv
                    s = items[u // (v_split * Hv)]
                    v0 = vb * BV
                    bos = cu_seqlens[s]
                    eos = cu_seqlens[s + 1]
                    nchunks = T.ceildiv(eos - bos, C)
                    if tx >= consumers + 32 and tx < consumers + 64:
                        for c in T.serial(nchunks):
                            t0 = bos + c * C
                            if eos - t0 >= C:
                                store_o(jdone + c, t0, h, v0, o_s, out, o_full, o_free)
                    if tx < consumers + 32:
                        for c in T.serial(nchunks):
                            load_chunk(gdone + c, bos + c * C, chunk_offsets[s] + c, h // group, h, v0, q, k, values,
                                       pd, fbuf, mbuf, q_s, k_s, p_s, f_s, v_s, m_s, pm_s, d_s, loaded, free)
                    if packed:
                        if tx >= consumers + 64:
                            for c in T.serial(nchunks):
                                unpack(gdone + c, pm_s, d_s, m_s, p_s, loaded, ready)
                    gdone = gdone + nchunks
                    jdone = jdone + (eos - bos) // C

    return gdn_prefill_main_persistent, threads
