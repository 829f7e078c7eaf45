"""Prefill in one launch (v36, experimental: prefill_api.FUSED, off by default): stage 1's form
"m" (prefill_prep.py) and the V-first chain (prefill_main_vfirst.py) in one CTA per (head,
sequence), so that M, P and the gate factors of a chunk go from one warpgroup to the next
through shared memory instead of through HBM, and the solve of chunk c + 1 runs beside the
chain of chunk c (FlashInfer 0.7.2's fused SM90 kernel's structure; docs/flashinfer_sm90_prefill.md
section 5, "vfirst + prep WG").

Math: for each chunk of n <= 64 tokens t0 .. t0 + n - 1 of head h, what prefill_prep's form "m"
writes (gc the chunk-local cumsum of g, A = (I + StrictLower(diag(beta) K K^T))^-1):
  M[i, j] = A[i, j] beta[j] exp(gc[i] - gc[j])  (i >= j),   P = scale Lower(Gamma) o (Q K^T),
  f = (exp(gc), dec = exp(gc[63] - gc) for rows < n, else 0)
and then prefill_main_vfirst's chain on X = S^T (its docstring):
  V' = M (V - diag(exp gc) K S),  O = scale diag(exp gc) Q S + P V',  S <- gamma_last S + K^T diag(dec) V'
The float64 truth is reference.recurrent_gdn (the same contract as gdn_prefill, DESIGN.md).

Warp roles (512 threads, one CTA per SM):
  consumers  threads 0-255: prefill_main_vfirst's chain step (_chain_step), unchanged, on
             ring stage c % 2; each warpgroup owns 64 value rows of X.
  producer   threads 256-383: warp 8 issues the TMA loads of q, k and v of each chunk into the
             two-stage ring once the stage is free (mbarriers loaded / free); warp 9 is the O
             storer of prefill_main_vfirst (_output_movers); warps 10-11 idle.
  solve      threads 384-511: per chunk, once the stage is free and its q / k have landed: the
             gate scan (warp 12: g's cumsum by warp shuffles; warp 13: beta), Q K^T and K K^T on
             wgmma, P gated and masked into the ring's P tile, K K^T's diagonal blocks' forward
             substitution (prefill_prep.diag_blocks) and the block solve on mma.sync
             (csrc/block_solve.cuh) straight into the ring's M tile, then mbarrier `prepped`.
             It releases q / k (mbarrier free counts 256 consumer + 128 solve threads) as soon as
             K K^T is done, and may run one chunk ahead of the chain.
Only fp16 q / k (what the layer hands over: gdn_prefill_inputs(..., qk_dtype=torch.float16)),
whole sequences, output mode, no gate warmup: prefill_api.fused_applies decides per plan.

Registers (setmaxnreg): 2 x 128 x 192 (consumers) + 128 x 104 (solve) + 128 x 24 (producer) =
65536. Shared memory ~182 KB: q, k, v rings 96 KB, M and P rings 32 KB, O tiles 32 KB, the
solve's scratch ~21 KB.

Measured (H100, session 69; benchmarks/prefill.md "v36"): correct against float64, level with
the two stages at 16/64 4x8192 and 3-7% faster on ragged and short-chain rows. The solve
warpgroup sets the pace (ncu: the chain waits on `prepped` ~30% of its time, ~3.4 us per chunk
against FlashInfer's 2.9), so its latency per chunk is what to cut next; v36b loads the gates a
chunk ahead (a third of that warpgroup's time was their HBM latency), not yet measured.
"""

import tilelang
import tilelang.language as T

from . import prefill_main_vfirst
from .prefill_main import C, DK, DV, checkpoint_chunk
from .prefill_main_vfirst import _POOL_VEC, _chain_step, _output_movers, chain_fragments, state_in
from .prefill_prep import _LOG2E, ACC, MM_DTYPE, SOLVE_SOURCE, diag_blocks, kk_blocks, staging_tile

# The chain's: fast math, and TileLang's automatic barriers off (every handoff has its mbarrier,
# and the solve warpgroup's own steps its named barrier).
PASS_CONFIGS = prefill_main_vfirst.PASS_CONFIGS

CONSUMERS = 256
SOLVE_FIRST = 384  # the solve warpgroup's first thread
THREADS = 512
_NREG_CONSUMER = 192
_NREG_SOLVE = 104
_NREG_PRODUCER = 24
_SOLVE_BAR = 1  # the solve warpgroup's named barrier (128 threads; 0 is __syncthreads)
_ORDER_BAR = 2  # ping-pong: consumer warpgroup w waits on barrier 2 + w (256 threads)


@T.macro
def _order_wait():
    """Ping-pong: wait for this consumer warpgroup's turn to issue its wgmma."""
    T.sync_threads(_ORDER_BAR + T.get_thread_binding() // 128, 256)


@T.macro
def _order_notify():
    """Ping-pong: the other consumer warpgroup's turn."""
    T.named_barrier_arrive(_ORDER_BAR + 1 - T.get_thread_binding() // 128, 256)


def fused_func(num_v_heads: int, num_k_heads: int, io_dtype: str, pool_dtype: str, pingpong: bool = False):
    """Build the fused prefill PrimFunc for (Hv, Hk, v dtype, pool dtype): grid (Hv, N), one CTA
    per head and sequence (heads fastest: a qk-head's v-heads read the same q / k through L2).
    Arguments as prefill_main_vfirst.main_func's where they share a name; q, k fp16 [T, Hk, 128],
    g, beta fp32 [T, Hv] contiguous (gdn_prefill's contract), the checkpoint pair as there.
    pingpong: the two consumer warpgroups take turns to issue each of the chain's three wgmma
    groups (named barriers 2 and 3, as FlashInfer's state warpgroups do), so that one's
    elementwise work overlaps the other's tensor-core work instead of both waiting together."""
    Hv, Hk = num_v_heads, num_k_heads
    group = Hv // Hk
    BV = DV
    ntok = T.dynamic("ntok")
    nseq = T.dynamic("nseq")
    nslot = T.dynamic("nslot")
    nhis = T.dynamic("nhis")
    sq0, sq1 = T.dynamic("sq0"), T.dynamic("sq1")
    sk0, sk1 = T.dynamic("sk0"), T.dynamic("sk1")
    sv0, sv1 = T.dynamic("sv0"), T.dynamic("sv1")
    so0, so1 = T.dynamic("so0"), T.dynamic("so1")
    sp0 = T.dynamic("sp0")
    mm = MM_DTYPE
    chain_step = _chain_step(False, BV, False, (_order_wait, _order_notify) if pingpong else None)
    emit_o, store_o = _output_movers(BV, io_dtype)
    solve_diag = diag_blocks(SOLVE_FIRST)

    @T.prim_func
    def gdn_prefill_fused(
        q: T.StridedTensor((ntok, Hk, DK), (sq0, sq1, 1), mm),
        k: T.StridedTensor((ntok, Hk, DK), (sk0, sk1, 1), mm),
        values: T.StridedTensor((ntok, Hv, DV), (sv0, sv1, 1), io_dtype),
        g: T.Tensor((ntok, Hv), "float32"),
        beta: T.Tensor((ntok, Hv), "float32"),
        pool: T.StridedTensor((nslot, Hv, DV, DK), (sp0, DV * DK, DK, 1), pool_dtype),
        slot_ids: T.Tensor((nseq,), "int32"),
        has_init: T.Tensor((nhis,), "uint8"),
        cu_seqlens: T.Tensor((nseq + 1,), "int32"),
        ckpt_chunk: T.Tensor((nseq,), "int32"),
        ckpt_slot: T.Tensor((nseq,), "int32"),
        out: T.StridedTensor((ntok, Hv, DV), (so0, so1, 1), io_dtype),
        scale: T.float32,
        all_init: T.int32,
        use_ckpt: T.int32,
    ):
        with T.Kernel(Hv, nseq, threads=THREADS) as (h, s):
            T.assume(sp0 % _POOL_VEC[pool_dtype] == 0)
            hk = h // group
            q_s, k_s, v_s, m_s, p_s, f_s, o_s = _ring_tiles(io_dtype)
            x_f, xh_f, vp_f, rh_f, vph_f, vpd_f, o_f = chain_fragments(BV)
            loaded = T.alloc_barrier([32, 32])  # the stage's q, k, v landed (TMA bytes + warp 8)
            free = T.alloc_barrier([CONSUMERS + 128, CONSUMERS + 128])  # read by the chain and the solve
            prepped = T.alloc_barrier([128, 128])  # the stage's M, P and gate factors written
            o_full = T.alloc_barrier([CONSUMERS, CONSUMERS])
            o_free = T.alloc_barrier([32, 32])
            bos = cu_seqlens[s]
            eos = cu_seqlens[s + 1]
            nchunks = T.ceildiv(eos - bos, C)
            tx = T.get_thread_binding()

            if tx < CONSUMERS:
                T.set_max_nreg(_NREG_CONSUMER, 1)
                slot = slot_ids[s]
                state_in(x_f, pool, slot, s, h, 0, has_init, all_init)
                ck, ck_slot = checkpoint_chunk(ckpt_chunk, ckpt_slot, use_ckpt, s, 0, 0)
                if pingpong:
                    if tx >= 128:  # warpgroup 0 issues first
                        T.named_barrier_arrive(_ORDER_BAR, 256)
                for c in T.serial(nchunks):
                    st = c % 2
                    t0 = bos + c * C
                    T.barrier_wait(loaded[st], (c // 2) % 2)  # the TMA tiles (the solve's barrier implies it)
                    chain_step(st, (c // 2) % 2, True, False, scale, x_f, xh_f, vp_f, rh_f, vph_f, vpd_f, o_f,
                               q_s, k_s, v_s, m_s, p_s, f_s, loaded, prepped)
                    if c == ck:
                        for v, d in T.Parallel(BV, DK):
                            pool[ck_slot, h, v, d] = T.cast(x_f[v, d], pool_dtype)
                    T.barrier_arrive(free[st])
                    emit_o(c, T.min(eos - t0, C), t0, h, 0, o_f, o_s, out, o_full, o_free)
                if pingpong:
                    if tx < 128:  # warpgroup 1's last notify
                        T.sync_threads(_ORDER_BAR, 256)
                if slot >= 0:
                    for v, d in T.Parallel(BV, DK):
                        pool[slot, h, v, d] = T.cast(x_f[v, d], pool_dtype)
            elif tx < SOLVE_FIRST:
                T.set_max_nreg(_NREG_PRODUCER, 0)
                if tx < CONSUMERS + 32:
                    for c in T.serial(nchunks):
                        st = c % 2
                        t0 = bos + c * C
                        T.barrier_wait(free[st], (c // 2 + 1) % 2)
                        T.tma_copy(q[t0:t0 + C, hk, 0:DK], q_s[st, :, :], barrier=loaded[st])
                        T.tma_copy(k[t0:t0 + C, hk, 0:DK], k_s[st, :, :], barrier=loaded[st])
                        T.tma_copy(values[t0:t0 + C, h, 0:DV], v_s[st, :, :], barrier=loaded[st])
                        T.barrier_arrive(loaded[st])
                elif tx < CONSUMERS + 64:
                    for c in T.serial(nchunks):
                        t0 = bos + c * C
                        if eos - t0 >= C:
                            store_o(c, t0, h, 0, o_s, out, o_full, o_free)
            else:
                T.set_max_nreg(_NREG_SOLVE, 0)
                _solve_warpgroup(g, beta, h, bos, eos, nchunks, scale, q_s, k_s, m_s, p_s, f_s, loaded, free, prepped,
                                 solve_diag)

    return gdn_prefill_fused


def _ring_tiles(io_dtype: str):
    """The two-stage ring (q, k, v from the producer; M, P and the gate factors from the solve
    warpgroup) and the O tiles. M and P are under the 128-byte swizzle that the block solve's
    stores and the chain's wgmma operands both take (csrc/block_solve.cuh); v and O as in
    prefill_main_vfirst._ring_tiles."""
    q_s = T.alloc_shared((2, C, DK), MM_DTYPE)
    k_s = T.alloc_shared((2, C, DK), MM_DTYPE)
    v_s = T.alloc_shared((2, C, DV), io_dtype)
    m_s = T.alloc_shared((2, C, C), MM_DTYPE)
    p_s = T.alloc_shared((2, C, C), MM_DTYPE)
    f_s = T.alloc_shared((2, 2, C), ACC)  # exp(gc), dec
    o_s = T.alloc_shared((2, C, DV), io_dtype)
    T.annotate_layout({t: tilelang.layout.make_swizzled_layout(t) for t in (v_s, o_s, m_s, p_s)})
    T.import_source(SOLVE_SOURCE)
    return q_s, k_s, v_s, m_s, p_s, f_s, o_s


@T.macro
def _gate_loads(dst, g, beta, h, t0, eos, ptx, i0):
    """Tokens t0 + i0 and t0 + i0 + 1 of head h into dst: g on warp 12 (ptx < 32), beta on warp
    13; 0 at or past eos (a chunk's rows >= n)."""
    if ptx < 32:
        dst[0] = T.if_then_else(t0 + i0 < eos, g[t0 + i0, h], 0.0)
        dst[1] = T.if_then_else(t0 + i0 + 1 < eos, g[t0 + i0 + 1, h], 0.0)
    elif ptx < 64:
        dst[0] = T.if_then_else(t0 + i0 < eos, beta[t0 + i0, h], 0.0)
        dst[1] = T.if_then_else(t0 + i0 + 1 < eos, beta[t0 + i0 + 1, h], 0.0)


@T.macro
def _solve_warpgroup(g, beta, h, bos, eos, nchunks, scale, q_s, k_s, m_s, p_s, f_s, loaded, free, prepped, solve_diag):
    """Threads 384-511: each chunk's gate factors, P and M into ring stage c % 2 (module docstring)."""
    ptx = T.get_thread_binding() - SOLVE_FIRST
    lane = ptx % 32
    g2_s = T.alloc_shared((1, C), ACC)  # gc log2(e)
    prow_s = T.alloc_shared((1, C), ACC)  # gc log2(e) + log2(scale): P's row exponent
    b_s = T.alloc_shared((1, C), ACC)
    kd_s = T.alloc_shared((4, 16, 16), ACC)
    koff_s = staging_tile()
    db_s = staging_tile()
    p_f = T.alloc_fragment((C, C), ACC)
    kk_f = T.alloc_fragment((C, C), ACC)
    run = T.alloc_var(ACC)
    pair = T.alloc_local((2,), ACC)  # warp 12: g of tokens 2 lane, 2 lane + 1; warp 13: beta
    ahead = T.alloc_local((2,), ACC)  # the same for the next chunk, loaded one chunk ahead
    i0 = 2 * lane
    _gate_loads(ahead, g, beta, h, bos, eos, ptx, i0)
    for c in T.serial(nchunks):
        st = c % 2
        t0 = bos + c * C
        n = T.min(eos - t0, C)
        if ptx < 64:
            pair[0] = ahead[0]
            pair[1] = ahead[1]
        T.sync_threads(_SOLVE_BAR, 128)  # the previous chunk's solve has read the scratch tiles
        T.barrier_wait(free[st], (c // 2 + 1) % 2)  # the chain is done with the stage's last M, P, f
        if ptx < 32:
            # g's chunk-local cumsum (rows >= n repeat gc[n - 1]): an inclusive scan of the
            # pair sums over the warp.
            run = pair[0] + pair[1]
            for d in T.unroll(5):
                up = T.shfl_up(run, 1 << d)
                if lane >= (1 << d):
                    run = run + up
            total = T.shfl_sync(run, 31) * _LOG2E
            hi2 = run * _LOG2E
            lo2 = (run - pair[1]) * _LOG2E
            g2_s[0, i0] = lo2
            g2_s[0, i0 + 1] = hi2
            prow_s[0, i0] = lo2 + T.log2(scale)
            prow_s[0, i0 + 1] = hi2 + T.log2(scale)
            f_s[st, 0, i0] = T.exp2(lo2)
            f_s[st, 0, i0 + 1] = T.exp2(hi2)
            f_s[st, 1, i0] = T.if_then_else(i0 < n, T.exp2(total - lo2), 0.0)
            f_s[st, 1, i0 + 1] = T.if_then_else(i0 + 1 < n, T.exp2(total - hi2), 0.0)
        elif ptx < 64:
            b_s[0, i0] = pair[0]
            b_s[0, i0 + 1] = pair[1]
        # The next chunk's gates: their HBM latency passes behind this chunk's products and
        # solve (loaded at the top of each chunk, it was a third of this warpgroup's time, ncu).
        if c + 1 < nchunks:
            _gate_loads(ahead, g, beta, h, t0 + C, eos, ptx, i0)
        T.sync_threads(_SOLVE_BAR, 128)  # g2, prow, beta visible
        T.barrier_wait(loaded[st], (c // 2) % 2)
        T.gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(C, C):
            p_f[i, j] = p_f[i, j] * T.exp2(prow_s[0, i] - g2_s[0, j])
        for i, j in T.Parallel(C, C):
            p_f[i, j] = T.if_then_else(i >= j, p_f[i, j], 0.0)
        T.copy(p_f, p_s[st, :, :])
        kk_blocks(k_s[st, :, :], kk_f, kd_s, koff_s)
        T.barrier_arrive(free[st])  # q and k read (wgmma waited)
        T.sync_threads(_SOLVE_BAR, 128)  # kd_s, koff_s visible
        solve_diag(0, kd_s, b_s, db_s, False)
        T.sync_threads(_SOLVE_BAR, 128)  # db_s visible
        T.call_extern("handle", "qla_block_solve_m", T.address_of(koff_s[0, 0]), T.address_of(db_s[0, 0]),
                      T.address_of(g2_s[0, 0]), T.address_of(m_s[st, 0, 0]))
        T.fence_proxy_async()  # P (and M, fenced in the solve) are read by the chain's wgmma
        T.barrier_arrive(prepped[st])
