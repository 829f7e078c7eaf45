"""Prefill stage 2: the sequential chunk walk, fused and warp-specialised.

Grid: one CTA per (value slice vb, v-head h, work item) with the state slice
S[:, vb*BV:(vb+1)*BV] (K-first, [128, BV], fp32) held in registers for the whole item:
V' and the per-chunk states never reach HBM. BV = 128 / v_split. A work item is a whole
sequence, or with context parallelism a segment of one (see main_func: mode "output" writes
the outputs, mode "maps" the segment's end state and its transition Phi for the scan in
prefill_scan.py; with gate warmup an output item first walks a few earlier chunks for the state
alone, see prefill_warmup.py).

Per chunk (n <= 64 valid rows; tiles are loaded whole: rows >= n are finite and meet only zero
weights: P is lower triangular and dec = 0 there), with U0, Wk, P and the gate factors
exp(gc), dec from stage 1 (prefill_prep.py), Hs = fp16 copy of the state, q, k fp16:
  V'    = U0 - Wk Hs                            (= M (V - diag(exp(gc)) K S))
  O     = scale diag(exp(gc)) Q Hs + P V'       (P = scale Lower(Gamma) o Q K^T)
  S    <- gamma_last S + K^T diag(dec) V'       (dec = gamma_last / gamma, 0 for rows >= n)
the chunked form of reference.recurrent_gdn (the float64 truth the tests compare with). Every
GEMM operand is fp16 with fp32 accumulation; see prefill_prep.py for why not bf16.

Warp specialisation (512 threads, four warpgroups, mbarriers between them):
  WG0+1 "state"  hold S in registers (K rows 0-63 / 64-127); the whole sequential chain, two
                 GEMMs per chunk: Hs <- S, V' = U0 - Wk Hs (value columns split between the
                 two), V' and V'd to smem, S = gamma_last S + K^T V'd. Two warpgroups so that
                 a 128-wide block fits the 128 registers a 512-thread launch allows (one
                 warpgroup spilled; ptxas does not allocate by setmaxnreg).
  WG2 "output"   O = Q Hs (beside the V' GEMM), O += P V', rows < n stored to `out`
  WG3 "producer" one warp issuing the TMA tile loads of the next chunk
Two data stages (q, k, P, U0, Wk, gate factors). Hs and V' are single buffers guarded by "used"
barriers, so the state warpgroups never run a chunk ahead of the output warpgroup.

Initial state (an item that starts a sequence): pool[slot_ids[s], h, vslice, :] (V-first, fp32
or bf16) read in place when slot >= 0 and has_initial_state[s]; otherwise zeros (padding slots,
slot < 0, run from a zero state: their output rows are computed and written, nothing in the pool
is read or written). Final state written back in place for slot >= 0 by the item that ends the
sequence, also for 0-length sequences (= initial state).
"""

import tilelang
import tilelang.language as T

C = 64
DK = 128
DV = 128
THREADS = 512
STATE_THREADS = 256

PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}

V_SPLITS = (1, 2, 4)
# setmaxnreg: the producer warpgroup gives registers back (the others keep the launch allocation,
# 128 at 512 threads; setmaxnreg.inc below the current count is an illegal instruction, and
# ptxas allocates for the launch bound anyway). S takes BV / 2 registers per state thread.
_NREG_PRODUCER = 40


MODES = ("output", "maps")


def main_func(num_v_heads: int, num_k_heads: int, io_dtype: str, pool_dtype: str, v_split: int,
              mode: str = "output", pdl: bool = False):
    """Build the stage-2 PrimFunc. Symbolic: tokens, sequences, work items, pool slots and every
    stride of q/k/out/pool, so one compile serves any batch and any engine pool layout.
    q and k are fp16 (stage 1's converted copies when io is bf16, else the inputs).

    Work items (grid z): with use_items = 0, item i is sequence i, whole. With use_items = 1,
    items[i] = (seq, first_chunk, num_chunks, map): a segment of a sequence (context parallelism,
    see prefill_api). mode "output" writes every output row of the item; an item with
    first_chunk > 0 starts from maps[map, h, 0] (the true state at its first chunk, from the
    "maps" pass and the scan), the first segment of a cut sequence (first_chunk = 0, map >= 0)
    from maps[map, h, 1] (the maps pass's copy of the pool state), and the last segment of a
    sequence writes the pool slot. So in an output pass only an uncut sequence's item reads its
    pool slot: no item reads a slot that another item of the same launch writes.
    mode "maps" writes no output: grid x is 2 * v_split, blocks vb < v_split walk the state from
    the item's initial state (the pool's for first_chunk = 0, else zero) and store it to
    maps[map, h, 0]; blocks vb >= v_split walk the transition Phi (the same chain from S = I with
    U0 = 0, i.e. S -> Phi S + B split into its linear part) and store Phi^T to maps[map, h, 1].
    A first segment needs no Phi: its blocks vb >= v_split store the initial state there
    instead (the pool's, or zero). All stored V-first like the pool:
    maps[m, h, 0, v, d] = S[d, v], maps[m, h, 1, e, d] = Phi[d, e].

    Gate warmup (use_warmup = 1, after prefill_warmup.py): an output item with first_chunk > 0
    and w = warm_start[item, h] >= 0 walks from chunk w (0 < w < first_chunk) from a zero state
    instead and writes outputs from first_chunk on; w = -1 is the exact path above. The
    maps pass skips the walks of (sequence, head) pairs with need_maps[map % num_cut, h] = 0 (no
    segment of theirs takes the exact path; the initial-state copy is still made). With
    use_warmup = 0 neither table is read.

    pdl: the kernel first lets the next launch of the stream start (it waits for this grid) and
    waits for the grid before it (its writes visible), before it touches memory: prefill_api.CP_PDL
    (the maps pass)."""
    if v_split not in V_SPLITS:
        raise ValueError(f"v_split must be one of {V_SPLITS}, got {v_split}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    maps_mode = mode == "maps"
    Hv, Hk = num_v_heads, num_k_heads
    group = Hv // Hk
    BV = DV // v_split
    n_vblocks = 2 * v_split if maps_mode else v_split
    consumers = STATE_THREADS if maps_mode else STATE_THREADS + 128
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
    so0, so1 = T.dynamic("so0"), T.dynamic("so1")
    sp0 = T.dynamic("sp0")
    mm = "float16"
    acc = "float32"
    load_chunk = chunk_loader(maps_mode, BV)
    walk_item, pool_load = item_walker(maps_mode, v_split)

    @T.prim_func
    def gdn_prefill_main(
        q: T.StridedTensor((ntok, Hk, DK), (sq0, sq1, 1), mm),
        k: T.StridedTensor((ntok, Hk, DK), (sk0, sk1, 1), mm),
        fbuf: T.Tensor((nchunk, Hv, 2, C), "float32"),
        pbuf: T.Tensor((nchunk, Hv, C, C), mm),
        ubuf: T.Tensor((nchunk, Hv, C, DV), mm),
        wbuf: T.Tensor((nchunk, Hv, C, DK), mm),
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
        with T.Kernel(n_vblocks, Hv, nitem, threads=THREADS) as (vb, h, it):
            if pdl:  # a programmatic dependent launch (prefill_api.CP_PDL)
                T.pdl_trigger()
                T.pdl_sync()
            hk = h // group
            v0 = (vb % v_split) * BV  # value columns (or, for Phi blocks, the columns of Phi)
            # Two data stages, filled by the producer's TMA loads.
            q_s = T.alloc_shared((2, C, DK), mm)
            k_s = T.alloc_shared((2, C, DK), mm)
            p_s = T.alloc_shared((2, C, C), mm)
            u0_s = T.alloc_shared((2, C, BV), mm)
            wk_s = T.alloc_shared((2, C, DK), mm)  # -Wk
            f_s = T.alloc_shared((2, 2, C), acc)  # exp(gc), dec
            # The state warpgroups' products, read by the output warpgroup (and themselves).
            hs_s = T.alloc_shared((DK, BV), mm)
            vp_s = T.alloc_shared((C, BV), mm)
            vpd_s = T.alloc_shared((C, BV), mm)
            h_f = T.alloc_fragment((DK, BV), acc)
            u_f = T.alloc_fragment((C, BV), acc)
            o_f = T.alloc_fragment((C, BV), acc)

            ready = T.alloc_barrier([32, 32])  # stage filled: the producer warp + TMA bytes
            free = T.alloc_barrier([consumers, consumers])  # stage consumed by every consumer
            hs_ready = T.alloc_barrier(STATE_THREADS)  # the state warpgroups wrote Hs
            hs_used = T.alloc_barrier(128)  # the output warpgroup finished reading Hs
            vp_ready = T.alloc_barrier(STATE_THREADS)  # the state warpgroups wrote V'
            vp_used = T.alloc_barrier(128)  # the output warpgroup finished reading V'

            s = T.alloc_var("int32")
            first = T.alloc_var("int32")
            nck = T.alloc_var("int32")
            midx = T.alloc_var("int32")
            start = T.alloc_var("int32")  # the chunk the walk starts at (< first: gate warmup)
            skip = T.alloc_var("int32")  # 1: this block has nothing to do (maps pass, warmup)
            seq_eos, bos, item_end, eos, coff, warm_chunks, is_phi, init_copy, nchunks = \
                walk_item(s, first, nck, midx, start, skip, it, h, vb, items, cu_seqlens, chunk_offsets,
                          warm_start, need_maps, ncut, use_items, use_warmup)
            tx = T.get_thread_binding()

            if tx < STATE_THREADS:
                slot = slot_ids[s]
                load = T.alloc_var("int32")
                pool_load(load, slot, s, start, midx, has_init, all_init)
                if is_phi and not init_copy:
                    for d, j in T.Parallel(DK, BV):
                        h_f[d, j] = T.if_then_else(d == v0 + j, 1.0, 0.0)
                elif load != 0:
                    for d, j in T.Parallel(DK, BV):
                        h_f[d, j] = T.cast(pool[slot, h, v0 + j, d], acc)
                else:
                    T.clear(h_f)
                    if not maps_mode:
                        if midx >= 0:
                            if first == 0:  # a cut sequence's first segment: the pool state's copy
                                for d, j in T.Parallel(DK, BV):
                                    h_f[d, j] = maps[midx, h, 1, v0 + j, d]
                            elif start == first:  # exact path: the true state (maps pass + scan)
                                for d, j in T.Parallel(DK, BV):
                                    h_f[d, j] = maps[midx, h, 0, v0 + j, d]
                            # else a gate warmup (start < first): from zero
                gl = T.alloc_var(acc)
                ck, ck_slot = checkpoint_chunk(ckpt_chunk, ckpt_slot, use_ckpt, s, start, warm_chunks)
                for c in T.serial(nchunks):
                    st = c % 2
                    T.barrier_wait(ready[st], (c // 2) % 2)
                    if not maps_mode:
                        T.barrier_wait(hs_used, (c + 1) % 2)
                    for d, j in T.Parallel(DK, BV):
                        hs_s[d, j] = T.cast(h_f[d, j], mm)
                    T.fence_proxy_async()
                    if not maps_mode:
                        T.barrier_arrive(hs_ready)
                    # V' = U0 - Wk Hs (U0 = 0 for the transition Phi)
                    if is_phi:
                        T.clear(u_f)
                    else:
                        for i, j in T.Parallel(C, BV):
                            u_f[i, j] = T.cast(u0_s[st, i, j], acc)
                    T.gemm(wk_s[st, :, :], hs_s, u_f, policy=T.GemmWarpPolicy.FullCol)
                    if not maps_mode:
                        T.barrier_wait(vp_used, (c + 1) % 2)
                        for i, j in T.Parallel(C, BV):
                            vp_s[i, j] = T.cast(u_f[i, j], mm)
                    for i, j in T.Parallel(C, BV):
                        vpd_s[i, j] = T.cast(u_f[i, j] * f_s[st, 1, i], mm)
                    T.fence_proxy_async()
                    if not maps_mode:
                        T.barrier_arrive(vp_ready)
                    # S <- gamma_last S + K^T V'd
                    gl = f_s[st, 0, C - 1]
                    for d, j in T.Parallel(DK, BV):
                        h_f[d, j] = h_f[d, j] * gl
                    T.gemm(k_s[st, :, :], vpd_s, h_f, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
                    if not maps_mode:
                        if c == ck:  # the state after the checkpoint's chunk: into its slot
                            for d, j in T.Parallel(DK, BV):
                                pool[ck_slot, h, v0 + j, d] = T.cast(h_f[d, j], pool_dtype)
                    T.barrier_arrive(free[st])
                if maps_mode:
                    if nchunks > 0 or init_copy:
                        for d, j in T.Parallel(DK, BV):
                            maps[midx, h, vb // v_split, v0 + j, d] = h_f[d, j]
                elif slot >= 0 and item_end >= seq_eos:  # the sequence's last segment
                    for d, j in T.Parallel(DK, BV):
                        pool[slot, h, v0 + j, d] = T.cast(h_f[d, j], pool_dtype)

            elif tx < STATE_THREADS + 128:  # the output warpgroup (idle in mode "maps")
                if not maps_mode:
                    for c in T.serial(nchunks):
                        st = c % 2
                        t0 = bos + c * C
                        n = T.min(eos - t0, C)
                        emit = c >= warm_chunks  # warmup chunks: the barriers only
                        T.barrier_wait(ready[st], (c // 2) % 2)
                        T.barrier_wait(hs_ready, c % 2)
                        if emit:
                            T.gemm(q_s[st, :, :], hs_s, o_f, clear_accum=True)
                        T.barrier_arrive(hs_used)
                        if emit:
                            for i, j in T.Parallel(C, BV):
                                o_f[i, j] = o_f[i, j] * (f_s[st, 0, i] * scale)
                        T.barrier_wait(vp_ready, c % 2)
                        if emit:
                            T.gemm(p_s[st, :, :], vp_s, o_f)
                        T.barrier_arrive(vp_used)
                        T.barrier_arrive(free[st])
                        if emit:
                            for i, j in T.Parallel(C, BV):
                                if i < n:
                                    out[t0 + i, h, v0 + j] = T.cast(o_f[i, j], io_dtype)

            else:
                T.set_max_nreg(_NREG_PRODUCER, 0)
                if tx < STATE_THREADS + 128 + 32:
                    for c in T.serial(nchunks):
                        load_chunk(c, bos + c * C, coff + c, hk, h, v0, q, k, pbuf, fbuf, ubuf, wbuf,
                                   q_s, k_s, p_s, f_s, u0_s, wk_s, ready, free)

    return gdn_prefill_main, THREADS


def item_walker(maps_mode: bool, v_split: int):
    """Two macros both stage-2 kernels (main_func here and prefill_main_vfirst's) open each
    block with: walk_item, which work item the block walks and over which chunks, and
    pool_load, whether its initial state comes from the pool."""

    @T.macro
    def walk_item(s: T.Ref, first: T.Ref, nck: T.Ref, midx: T.Ref, start: T.Ref, skip: T.Ref, bz, h, bx, items,
                  cu_seqlens, chunk_offsets, warm_start, need_maps, ncut, use_items, use_warmup):
        """Work item bz (a whole sequence, or a segment of one) for value block bx of head h:
        sets the caller's variables s (its sequence), first, nck (its first chunk and chunk
        count), midx (its map row, -1 for none), start (the chunk the walk starts at, < first
        for a gate warmup) and skip, and returns (the sequence's end token, the walk's first
        token, the item's end (may pass the sequence's), its last output token + 1, the walk's
        first chunk index, warmup chunks, is_phi, init_copy, chunks walked). bx and bz are the
        grid indices' names in the program text: a macro argument renames the variable, and
        the text keys TileLang's kernel cache."""
        if use_items != 0:
            s = items[bz, 0]
            first = items[bz, 1]
            nck = items[bz, 2]
            midx = items[bz, 3]
        else:
            s = bz
            first = 0
            nck = T.ceildiv(cu_seqlens[bz + 1] - cu_seqlens[bz], C)
            midx = -1
        start = first
        skip = 0
        if use_warmup != 0 and midx >= 0:  # (prefill_warmup.py decided, per head)
            if maps_mode:
                skip = T.if_then_else(need_maps[midx % ncut, h] == 0, 1, 0)
            elif first > 0:
                if warm_start[bz, h] >= 0:
                    start = warm_start[bz, h]
        seq_bos = cu_seqlens[s]
        seq_eos = cu_seqlens[s + 1]
        bos = seq_bos + start * C  # the walk's first token
        item_end = seq_bos + (first + nck) * C  # may pass seq_eos
        eos = T.min(item_end, seq_eos)
        coff = chunk_offsets[s] + start
        warm_chunks = first - start  # walked for the state only, no output rows
        is_phi = bx >= v_split  # maps mode only
        # A first segment needs no Phi (it starts from the true state): its Phi blocks copy
        # that state to maps[map, h, 1] for the output pass instead (no walk).
        init_copy = is_phi and first == 0
        nchunks = T.if_then_else(init_copy or skip != 0, 0, warm_chunks + nck)
        return seq_eos, bos, item_end, eos, coff, warm_chunks, is_phi, init_copy, nchunks

    @T.macro
    def pool_load(load: T.Ref, slot, s: T.Ref, start: T.Ref, midx: T.Ref, has_init, all_init):
        """load = 1 when the walk starts from the state in pool slot ``slot``, else 0. The output
        pass reads the pool only for uncut sequences (map < 0)."""
        load = 0
        if start == 0 and slot >= 0 and (maps_mode or midx < 0):
            if all_init != 0:
                load = 1
            elif has_init[s] != 0:
                load = 1

    return walk_item, pool_load


@T.macro
def checkpoint_chunk(ckpt_chunk, ckpt_slot, use_ckpt, s, start, warm_chunks):
    """A prefill checkpoint (vLLM's align-mode prefix caching) in both stage-2 kernels: the state
    after ckpt_chunk[s] chunks of sequence s goes to pool slot ckpt_slot[s] (< 0: none), stored
    by the item whose own (not warmup) chunks hold that boundary. Returns (the item's walk chunk
    after which it stores, -1 for none; the slot)."""
    ck = T.alloc_var("int32")
    ck_slot = T.alloc_var("int32")
    ck = -1
    ck_slot = -1
    if use_ckpt != 0:
        ck_slot = ckpt_slot[s]
        if ck_slot >= 0:
            ck = ckpt_chunk[s] - 1 - start   # the walk's chunk that ends there
            if ck < warm_chunks:
                ck = -1
    return ck, ck_slot


def qk_tile_loader(maps_mode: bool, with_p: bool = True):
    """The TMA loads both stage-2 kernels make of one chunk into stage st: q and P (outputs
    only; P only with_p: the V-first kernel's P^T comes packed with M), k and the gate factors.
    Each kernel's loader adds the tiles its chain reads."""

    @T.macro
    def load_qk_tiles(st, t0, cidx, hk, h, q, k, pbuf, fbuf, q_s, k_s, p_s, f_s, ready):
        if not maps_mode:
            T.tma_copy(q[t0:t0 + C, hk, 0:DK], q_s[st, :, :], barrier=ready[st])
            if with_p:
                T.tma_copy(pbuf[cidx, h, 0:C, 0:C], p_s[st, :, :], barrier=ready[st])
        T.tma_copy(k[t0:t0 + C, hk, 0:DK], k_s[st, :, :], barrier=ready[st])
        T.tma_copy(fbuf[cidx, h, 0:2, 0:C], f_s[st, :, :], barrier=ready[st])

    return load_qk_tiles


def chunk_loader(maps_mode: bool, BV: int):
    """The producer's TMA loads of one chunk into stage c % 2 (q and P only for outputs), after
    every consumer released that stage (prefill_main_vfirst has its own: it loads v and M)."""
    load_qk_tiles = qk_tile_loader(maps_mode)

    @T.macro
    def load_chunk(c, t0, cidx, hk, h, v0, q, k, pbuf, fbuf, ubuf, wbuf, q_s, k_s, p_s, f_s, u0_s, wk_s,
                   ready, free):
        st = c % 2
        T.barrier_wait(free[st], (c // 2 + 1) % 2)
        load_qk_tiles(st, t0, cidx, hk, h, q, k, pbuf, fbuf, q_s, k_s, p_s, f_s, ready)
        T.tma_copy(ubuf[cidx, h, 0:C, v0:v0 + BV], u0_s[st, :, :], barrier=ready[st])
        T.tma_copy(wbuf[cidx, h, 0:C, 0:DK], wk_s[st, :, :], barrier=ready[st])
        T.barrier_arrive(ready[st])

    return load_chunk
