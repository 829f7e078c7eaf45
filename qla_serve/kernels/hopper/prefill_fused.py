"""Prefill in one pass for batches that fill the GPU (plain plans): stage 2 (prefill_main_vfirst.py
at v_split 1) with half of stage 1 (prefill_prep.py, form "m") inside it. A prep warpgroup
computes each sequence's even chunks' P, M and gate factors into shared memory while the chain
walks the chunk before; the odd chunks' come from stage 1 (prep_func(odd_chunks=True)) through
HBM, loaded by TMA as prefill_main_vfirst.py loads them. One prep warpgroup alone needs ~4 us
per chunk against the chain's ~2 (benchmarks/prefill.md: the whole of stage 1 inside the kernel
was 8-25% slower than two stages), so it takes every second chunk.

One CTA of 512 threads per (v-head, sequence), v-heads fastest (a qk-head's v-heads share q/k
tiles through L2), one CTA per SM. Per chunk of 64 tokens t0..t0+n-1 of head h, what
prefill_prep.py form "m" computes (see there for the math and the numerics):
  gc      = chunk-local cumsum of g;  f = (exp(gc), dec = exp(gc[63] - gc), 0 for rows >= n)
  P       = scale * Lower(Gamma) o (Q K^T)                       [64, 64] fp16
  A       = (I + StrictLower(diag(beta) K K^T))^-1               (16x16 substitution + GEMMs)
  M[i, j] = A[i, j] exp(gc[i] - gc[j]) beta[j]  (i >= j)           [64, 64] fp16
and then the V-first chain on X = S^T (prefill_main_vfirst.py):
  V'^T = fp16(V^T - (Xh K^T) diag(exp gc)) M^T
  O^T  = scale (Xh Q^T) diag(exp gc) + fp16(V'^T) P^T
  X   <- gamma_last X + fp16(V'^T diag(dec)) K
Same contract and float64 truth as the two-stage prefill (reference.recurrent_gdn; DESIGN.md):
states read from and written to the pool in place (slot < 0: zero state, nothing written),
has_initial_state / all_init, vLLM's prefill checkpoints. fp16 q/k only (what the engine layers
hand over); prefill_api sends bf16 q/k to the two-stage kernels.

Warp roles (setmaxnreg 192 / 192 / 104 / 24 = 65536 registers, FlashInfer's split):
  consumers  threads 0-255, two warpgroups, 64 value rows of X each: the chain.
  prep       threads 256-383: the even chunks' P, inverse and M into ring stage 0 (its phases
             ordered by named barrier 1 over its 128 threads; TileLang's automatic barriers are
             off: they would be whole-CTA __syncthreads, and the roles never meet at one).
  producer   threads 384-511, one warp each: the q/k loads (three stages: the prep warpgroup
             reads chunk c + 2's while the consumers walk chunk c), the storer of the O tiles,
             the gate warp (the even chunks' gate arrays, g and beta loaded a chunk ahead), and
             the loads of v (two stages) and of the odd chunks' M, P and f (ring stage 1).
Ring stage 0 of M / P / f is the prep warpgroup's, stage 1 the TMA's: chunk c uses stage c % 2.
"""

import tilelang
import tilelang.language as T

from .prefill_main import C, DK, DV, checkpoint_chunk
from .prefill_main_vfirst import PASS_CONFIGS, _POOL_VEC

CONSUMERS = 256
PREP0 = CONSUMERS  # the prep warpgroup's first thread
PRODUCER0 = PREP0 + 128
THREADS = PRODUCER0 + 128
_NREG_CONSUMER = 192  # 176 spilled 52 bytes in prefill_main_vfirst's loop; 192 none
_NREG_PREP = 104
_NREG_PRODUCER = 24
_PREP_BARRIER = 1  # named barrier id of the prep warpgroup's phases
_LOG2E = 1.4426950408889634


def fused_func(num_v_heads: int, num_k_heads: int, io_dtype: str, pool_dtype: str):
    """Build the one-pass prefill PrimFunc for (Hv, Hk, v/output dtype, pool dtype); fp16 q/k.
    Tokens, sequences, chunks and slots are symbolic: one compile serves every batch."""
    Hv, Hk = num_v_heads, num_k_heads
    group = Hv // Hk
    ntok = T.dynamic("ntok")
    nseq = T.dynamic("nseq")
    nslot = T.dynamic("nslot")
    nhis = T.dynamic("nhis")
    nck = T.dynamic("nck")
    nchunk = T.dynamic("nchunk")
    sq0, sq1 = T.dynamic("sq0"), T.dynamic("sq1")
    sk0, sk1 = T.dynamic("sk0"), T.dynamic("sk1")
    sv0, sv1 = T.dynamic("sv0"), T.dynamic("sv1")
    so0, so1 = T.dynamic("so0"), T.dynamic("so1")
    sp0 = T.dynamic("sp0")
    mm = "float16"
    acc = "float32"
    rows = T.GemmWarpPolicy.FullRow

    @T.macro
    def prep_sync():
        T.sync_threads(_PREP_BARRIER, 128)

    @T.macro
    def load_gates(lane, c, nchunks, bos, eos, h, g, beta, gb):
        """Chunk c's g and beta of tokens 2 lane and 2 lane + 1 into gb (0 past the sequence or
        for c = nchunks): the gate warp loads them a chunk ahead of their use."""
        for j in T.unroll(2):
            t = bos + c * C + 2 * lane + j
            gb[j] = T.if_then_else(c < nchunks and t < eos, g[t, h], 0.0)
            gb[2 + j] = T.if_then_else(c < nchunks and t < eos, beta[t, h], 0.0)

    @T.macro
    def write_gates(lane, n, gb, g2_s, prow_s, mcol_s, b_s, fe_s, scale):
        """An even chunk's gate arrays and f (fe_s: the prep warpgroup publishes it with M and P),
        two tokens per lane: gc by a warp scan of
        the lanes' pair sums (rows >= n have g = 0, so gc[63] = gc[n-1] is the chunk's total),
        then prefill_prep's exponents in base 2 (g2 = gc log2 e, P's row term g2 + log2 scale,
        M's column term g2 - log2 beta: +inf for beta = 0, which zeroes M's column) and the
        consumers' factors exp(gc), dec = exp(gc[63] - gc) (0 for rows >= n)."""
        pair = gb[0] + gb[1]
        incl = T.alloc_var(acc)
        incl = pair
        for m in T.unroll(5):
            up = T.shfl_up(incl, 1 << m)
            if lane >= (1 << m):
                incl = incl + up
        total = T.shfl_sync(incl, 31) * _LOG2E
        for j in T.unroll(2):
            i = 2 * lane + j
            g2 = (incl - pair + T.if_then_else(j == 0, gb[0], pair)) * _LOG2E
            g2_s[i] = g2
            prow_s[i] = g2 + T.log2(scale)
            mcol_s[i] = g2 - T.log2(gb[2 + j])
            b_s[i] = gb[2 + j]
            fe_s[0, i] = T.exp2(g2)
            fe_s[1, i] = T.if_then_else(i < n, T.exp2(total - g2), 0.0)

    @T.macro
    def gated(t_f, row_s, col_s):
        """t_f[i, j] *= exp2(row_s[i] - col_s[j]) on and below the diagonal, 0 above it:
        computed for every element, then masked (a conditional product compiles to a branch per
        element; above the diagonal the factor may be inf: prefill_prep._gated_m)."""
        for i, j in T.Parallel(C, C):
            t_f[i, j] = t_f[i, j] * T.exp2(row_s[i] - col_s[j])
        for i, j in T.Parallel(C, C):
            t_f[i, j] = T.if_then_else(i >= j, t_f[i, j], 0.0)

    @T.macro
    def inverse(pt, kk_f, n_f, t_f, b_s, ld_s, xd_s, dinv_s, loff_s, n_s):
        """A = (I + L)^-1 into t_f from K K^T in kk_f, L = StrictLower(diag(beta) K K^T):
        prefill_prep._solve's Dinv (the four 16x16 diagonal blocks of I + L inverted by forward
        substitution in fp32) and N = Dinv L_off (strictly block-lower, N^4 = 0), then
        A = (I - N + N^2 - N^3) Dinv = (I + N^2) B with B = (I - N) Dinv: N^2 and N Dinv in one
        wgmma batch, so three GEMM round trips instead of four. B goes out through L_off's tile
        and N^2 through N's (both read for the last time by then). The prep barrier wherever a
        tile changes hands."""
        for i, c in T.Parallel(C, C):
            kk_f[i, c] = kk_f[i, c] * b_s[i]
        for i, c in T.Parallel(C, C):
            if i // 16 == c // 16:
                ld_s[i // 16, i % 16, c % 16] = kk_f[i, c]
        for i, c in T.Parallel(C, C):
            kk_f[i, c] = T.if_then_else(i // 16 > c // 16, kk_f[i, c], 0.0)
        T.copy(kk_f, loff_s)
        prep_sync()
        blk = pt // 16
        col = pt % 16
        dcol = T.alloc_local((16,), acc)
        if pt < 64:
            for r in T.unroll(16):
                dcol[r] = T.if_then_else(col == r, 1.0, 0.0)
                for m in T.unroll(r):
                    dcol[r] = dcol[r] - ld_s[blk, r, m] * dcol[m]
            for r in T.unroll(16):
                xd_s[blk * 16 + r, col] = dcol[r]
        prep_sync()
        for i, c in T.Parallel(C, C):
            n_f[i, c] = T.if_then_else(i // 16 == c // 16, xd_s[i, c % 16], 0.0)
        T.copy(n_f, dinv_s)
        T.fence_proxy_async()
        prep_sync()
        T.gemm(dinv_s, loff_s, n_f, clear_accum=True)  # N
        T.copy(n_f, n_s)
        T.fence_proxy_async()
        prep_sync()
        T.wgmma_gemm(n_s, n_s, t_f, clear_accum=True)  # N^2
        T.wgmma_gemm(n_s, dinv_s, kk_f, clear_accum=True)  # N Dinv
        T.wait_wgmma(0)
        for i, c in T.Parallel(C, C):  # B = Dinv - N Dinv, fp32
            kk_f[i, c] = T.if_then_else(i // 16 == c // 16, xd_s[i, c % 16], 0.0) - kk_f[i, c]
        prep_sync()  # every thread's N^2 / N Dinv wgmma has read n_s and dinv_s
        T.copy(kk_f, loff_s)
        T.copy(t_f, n_s)
        T.fence_proxy_async()
        prep_sync()
        T.gemm(n_s, loff_s, t_f, clear_accum=True)  # N^2 B
        for i, c in T.Parallel(C, C):
            t_f[i, c] = t_f[i, c] + kk_f[i, c]

    @T.prim_func
    def gdn_prefill_fused(
        q: T.StridedTensor((ntok, Hk, DK), (sq0, sq1, 1), mm),
        k: T.StridedTensor((ntok, Hk, DK), (sk0, sk1, 1), mm),
        values: T.StridedTensor((ntok, Hv, DV), (sv0, sv1, 1), io_dtype),  # v (loop variables take `v`)
        g: T.Tensor((ntok, Hv), "float32"),
        beta: T.Tensor((ntok, Hv), "float32"),
        pool: T.StridedTensor((nslot, Hv, DV, DK), (sp0, DV * DK, DK, 1), pool_dtype),
        slot_ids: T.Tensor((nseq,), "int32"),
        has_init: T.Tensor((nhis,), "uint8"),
        cu_seqlens: T.Tensor((nseq + 1,), "int32"),
        chunk_offsets: T.Tensor((nseq + 1,), "int32"),
        fbuf: T.Tensor((nchunk, Hv, 2, C), "float32"),  # stage 1's, odd chunks only
        pbuf: T.Tensor((nchunk, Hv, C, C), mm),
        mbuf: T.Tensor((nchunk, Hv, C, C), mm),
        ckpt_chunk: T.Tensor((nck,), "int32"),
        ckpt_slot: T.Tensor((nck,), "int32"),
        out: T.StridedTensor((ntok, Hv, DV), (so0, so1, 1), io_dtype),
        scale: T.float32,
        all_init: T.int32,
        use_ckpt: T.int32,
    ):
        with T.Kernel(Hv, nseq, threads=THREADS) as (h, s):
            T.assume(sp0 % _POOL_VEC[pool_dtype] == 0)
            hk = h // group
            q_s = T.alloc_shared((3, C, DK), mm)
            k_s = T.alloc_shared((3, C, DK), mm)
            v_s = T.alloc_shared((2, C, DV), io_dtype)
            o_s = T.alloc_shared((C, DV), io_dtype)
            p_s = T.alloc_shared((2, C, C), mm)
            m_s = T.alloc_shared((2, C, C), mm)
            f_s = T.alloc_shared((2, 2, C), acc)  # exp(gc), dec
            T.annotate_layout({v_s: tilelang.layout.make_swizzled_layout(v_s),
                               o_s: tilelang.layout.make_swizzled_layout(o_s)})
            # the prep warpgroup's own tiles (and the gate warp's arrays for it)
            g2_s = T.alloc_shared((C,), acc)
            prow_s = T.alloc_shared((C,), acc)
            mcol_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            fe_s = T.alloc_shared((2, C), acc)
            pe_s = T.alloc_shared((C, C), mm)  # the even chunk's P until its ring slot is free
            ld_s = T.alloc_shared((4, 16, 16), acc)
            xd_s = T.alloc_shared((C, 16), acc)
            dinv_s = T.alloc_shared((C, C), mm)
            loff_s = T.alloc_shared((C, C), mm)
            n_s = T.alloc_shared((C, C), mm)
            T.annotate_layout({dinv_s: tilelang.layout.make_swizzled_layout(dinv_s),
                               loff_s: tilelang.layout.make_swizzled_layout(loff_s),
                               pe_s: tilelang.layout.make_swizzled_layout(pe_s)})
            # consumer fragments
            x_f = T.alloc_fragment((DV, DK), acc)  # X = S^T
            xh_f = T.alloc_fragment((DV, DK), mm)
            vp_f = T.alloc_fragment((DV, C), acc)
            rh_f = T.alloc_fragment((DV, C), mm)
            vph_f = T.alloc_fragment((DV, C), mm)
            vpd_f = T.alloc_fragment((DV, C), mm)
            o_f = T.alloc_fragment((DV, C), acc)
            # prep fragments
            kk_f = T.alloc_fragment((C, C), acc)
            t_f = T.alloc_fragment((C, C), acc)
            n_f = T.alloc_fragment((C, C), acc)
            qk_ready = T.alloc_barrier([32, 32, 32])  # q, k of a stage: the q/k warp + TMA bytes
            qk_free = T.alloc_barrier([CONSUMERS + 128] * 3)  # ... read by the consumers and the prep warpgroup
            v_ready = T.alloc_barrier([32, 32])
            v_free = T.alloc_barrier([CONSUMERS, CONSUMERS])
            gate_full = T.alloc_barrier([32])  # the even chunk's gate arrays, by the gate warp
            mp_full = T.alloc_barrier([128, 32])  # M, P, f: stage 0 by the prep warpgroup, stage 1 by TMA
            mp_free = T.alloc_barrier([CONSUMERS, CONSUMERS])
            o_full = T.alloc_barrier([CONSUMERS])
            o_free = T.alloc_barrier([32])

            bos = cu_seqlens[s]
            eos = cu_seqlens[s + 1]
            nchunks = T.ceildiv(eos - bos, C)
            coff = chunk_offsets[s]
            tx = T.get_thread_binding()

            if tx < CONSUMERS:
                T.set_max_nreg(_NREG_CONSUMER, 1)
                slot = slot_ids[s]
                load = T.alloc_var("int32")
                load = 0
                if slot >= 0:
                    if all_init != 0:
                        load = 1
                    elif has_init[s] != 0:
                        load = 1
                if load != 0:
                    for v, d in T.Parallel(DV, DK):
                        x_f[v, d] = T.cast(pool[slot, h, v, d], acc)
                else:
                    T.clear(x_f)
                gl = T.alloc_var(acc)
                ck, ck_slot = checkpoint_chunk(ckpt_chunk, ckpt_slot, use_ckpt, s, 0, 0)
                for c in T.serial(nchunks):
                    sa = c % 3  # q/k stage
                    st = c % 2  # v and M / P / f stage
                    t0 = bos + c * C
                    n = T.min(eos - t0, C)
                    T.barrier_wait(qk_ready[sa], (c // 3) % 2)
                    for v, d in T.Parallel(DV, DK):
                        xh_f[v, d] = T.cast(x_f[v, d], mm)
                    T.wgmma_gemm(xh_f, k_s[sa, :, :], vp_f, transpose_B=True, clear_accum=True, policy=rows)
                    T.wgmma_gemm(xh_f, q_s[sa, :, :], o_f, transpose_B=True, clear_accum=True, policy=rows)
                    T.barrier_wait(v_ready[st], (c // 2) % 2)
                    T.barrier_wait(mp_full[st], (c // 2) % 2)
                    T.wait_wgmma(0)
                    for v, i in T.Parallel(DV, C):
                        rh_f[v, i] = T.cast(T.cast(v_s[st, i, v], acc) - vp_f[v, i] * f_s[st, 0, i], mm)
                    T.wgmma_gemm(rh_f, m_s[st, :, :], vp_f, transpose_B=True, clear_accum=True, policy=rows)
                    T.wait_wgmma(0)
                    for v, i in T.Parallel(DV, C):
                        vpd_f[v, i] = T.cast(vp_f[v, i] * f_s[st, 1, i], mm)
                    gl = f_s[st, 0, C - 1]
                    for v, d in T.Parallel(DV, DK):
                        x_f[v, d] = x_f[v, d] * gl
                    T.wgmma_gemm(vpd_f, k_s[sa, :, :], x_f, policy=rows)
                    for v, i in T.Parallel(DV, C):
                        vph_f[v, i] = T.cast(vp_f[v, i], mm)
                        o_f[v, i] = o_f[v, i] * (f_s[st, 0, i] * scale)
                    T.wgmma_gemm(vph_f, p_s[st, :, :], o_f, transpose_B=True, policy=rows)
                    T.wait_wgmma(0)
                    if c == ck:  # the state after the checkpoint's chunk: into its slot
                        for v, d in T.Parallel(DV, DK):
                            pool[ck_slot, h, v, d] = T.cast(x_f[v, d], pool_dtype)
                    T.barrier_arrive(qk_free[sa])
                    T.barrier_arrive(v_free[st])
                    T.barrier_arrive(mp_free[st])
                    if n == C:  # a whole chunk (all but a sequence's last): to the storer warp
                        T.barrier_wait(o_free[0], (c + 1) % 2)
                        for v, i in T.Parallel(DV, C):
                            o_s[i, v] = T.cast(o_f[v, i], io_dtype)
                        T.fence_proxy_async()
                        T.barrier_arrive(o_full[0])
                    else:  # the sequence's last chunk: TMA would clip at T, not at its end
                        for v, i in T.Parallel(DV, C):
                            if i < n:
                                out[t0 + i, h, v] = T.cast(o_f[v, i], io_dtype)
                if slot >= 0:
                    for v, d in T.Parallel(DV, DK):
                        pool[slot, h, v, d] = T.cast(x_f[v, d], pool_dtype)

            elif tx < PRODUCER0:
                T.set_max_nreg(_NREG_PREP, 0)
                pt = tx - PREP0
                for c in T.serial(nchunks):
                    sa = c % 3
                    T.barrier_wait(qk_ready[sa], (c // 3) % 2)
                    if c % 2 == 1:  # stage 1 computed it
                        T.barrier_arrive(qk_free[sa])
                    else:
                        # Q K^T and K K^T in one batch, then the gate warp's arrays for this chunk
                        T.wgmma_gemm(q_s[sa, :, :], k_s[sa, :, :], t_f, transpose_B=True, clear_accum=True)
                        T.wgmma_gemm(k_s[sa, :, :], k_s[sa, :, :], kk_f, transpose_B=True, clear_accum=True)
                        T.barrier_wait(gate_full[0], (c // 2) % 2)
                        T.wait_wgmma(0)
                        T.barrier_arrive(qk_free[sa])  # q and k read
                        gated(t_f, prow_s, g2_s)  # P = scale * Lower(Gamma) o Q K^T
                        T.copy(t_f, pe_s)
                        inverse(pt, kk_f, n_f, t_f, b_s, ld_s, xd_s, dinv_s, loff_s, n_s)
                        gated(t_f, g2_s, mcol_s)  # M = (Gamma o A) diag(beta)
                        # Ring stage 0 once the consumers are done with chunk c - 2: M from the
                        # registers, P and f from the prep's own tiles.
                        T.barrier_wait(mp_free[0], (c // 2 + 1) % 2)
                        T.copy(t_f, m_s[0, :, :])
                        T.copy(pe_s, p_s[0, :, :])
                        f_s[0, pt // 64, pt % 64] = fe_s[pt // 64, pt % 64]
                        T.fence_proxy_async()  # generic-proxy writes, read by the consumers' wgmma
                        T.barrier_arrive(mp_full[0])

            else:
                T.set_max_nreg(_NREG_PRODUCER, 0)
                if tx < PRODUCER0 + 32:
                    # The q/k warp: three stages, freed by the consumers and the prep warpgroup.
                    for c in T.serial(nchunks):
                        sa = c % 3
                        t0 = bos + c * C
                        T.barrier_wait(qk_free[sa], (c // 3 + 1) % 2)
                        T.tma_copy(q[t0:t0 + C, hk, 0:DK], q_s[sa, :, :], barrier=qk_ready[sa])
                        T.tma_copy(k[t0:t0 + C, hk, 0:DK], k_s[sa, :, :], barrier=qk_ready[sa])
                        T.barrier_arrive(qk_ready[sa])
                elif tx < PRODUCER0 + 64:
                    # The storer warp: each whole output chunk's TMA store, in chunk order.
                    for c in T.serial(nchunks):
                        t0 = bos + c * C
                        if eos - t0 >= C:
                            T.barrier_wait(o_full[0], c % 2)
                            T.tma_copy(o_s, out[t0:t0 + C, h, 0:DV], leader_scope_threads=32)
                            T.tma_store_wait(0)
                            T.sync_warp()
                            T.barrier_arrive(o_free[0])
                elif tx < PRODUCER0 + 96:
                    # The gate warp: each even chunk's gate arrays, once the prep warpgroup has
                    # published the previous even chunk (its last read of them), g and beta
                    # loaded a chunk ahead.
                    lane = tx % 32
                    gb = T.alloc_local((4,), acc)
                    gb_next = T.alloc_local((4,), acc)
                    load_gates(lane, 0, nchunks, bos, eos, h, g, beta, gb_next)
                    for e in T.serial(T.ceildiv(nchunks, 2)):
                        for j in T.unroll(4):
                            gb[j] = gb_next[j]
                        load_gates(lane, 2 * e + 2, nchunks, bos, eos, h, g, beta, gb_next)
                        T.barrier_wait(mp_full[0], (e + 1) % 2)
                        write_gates(lane, T.min(eos - bos - 2 * e * C, C), gb, g2_s, prow_s, mcol_s, b_s, fe_s, scale)
                        T.barrier_arrive(gate_full[0])
                else:
                    # v (two stages) and the odd chunks' M, P and f from stage 1 (ring stage 1).
                    for c in T.serial(nchunks):
                        st = c % 2
                        t0 = bos + c * C
                        T.barrier_wait(v_free[st], (c // 2 + 1) % 2)
                        T.tma_copy(values[t0:t0 + C, h, 0:DV], v_s[st, :, :], barrier=v_ready[st])
                        T.barrier_arrive(v_ready[st])
                        if st == 1:
                            T.barrier_wait(mp_free[1], (c // 2 + 1) % 2)
                            T.tma_copy(pbuf[coff + c, h, 0:C, 0:C], p_s[1, :, :], barrier=mp_full[1])
                            T.tma_copy(mbuf[coff + c, h, 0:C, 0:C], m_s[1, :, :], barrier=mp_full[1])
                            T.tma_copy(fbuf[coff + c, h, 0:2, 0:C], f_s[1, :, :], barrier=mp_full[1])
                            T.barrier_arrive(mp_full[1])

    return gdn_prefill_fused
