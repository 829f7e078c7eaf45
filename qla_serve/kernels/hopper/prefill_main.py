"""Prefill stage 2: the sequential chunk walk, fused and warp-specialised.

Grid: one CTA per (value slice vb, v-head h, sequence s) with the state slice
S[:, vb*BV:(vb+1)*BV] (K-first, [128, BV], fp32) held in registers for the whole sequence:
U0, Wk, V' and the per-chunk states never reach HBM. BV = 128 / v_split, v_split 2 or 4 (a
128-wide block does not fit the double-buffered shared memory below).

Per chunk (n <= 64 valid rows; tiles are loaded whole: rows >= n are the next sequence's or
zero-filled past T, finite, and meet only zero weights: M, P and Wk are lower triangular and
dec = 0 there), with gc, M, P from stage 1 (prefill_prep.py), Hs = fp16 copy of the state, and q,
k already fp16 (stage 1 converts bf16 q/k once per qk-head):
  U0    = M V                                   [64, BV]   (state-free)
  Wk    = M diag(exp(gc)) K                     [64, 128]  (state-free)
  V'    = U0 - Wk Hs                            = M (V - diag(exp(gc)) K S)
  O     = scale diag(exp(gc)) Q Hs + P V'       (P = scale Lower(Gamma) o Q K^T)
  S    <- gamma_last S + K^T diag(gamma_last / gamma) V'   (dec = 0 for rows >= n)
with M = (Gamma o A) diag(beta): the chunked form of reference.recurrent_gdn (the float64 truth
the tests compare with). Every GEMM operand is fp16 with fp32 accumulation; see
prefill_prep.py for why not bf16.

Warp specialisation (512 threads, four warpgroups, mbarriers between them):
  WG0 "state"    holds S in registers; the whole sequential chain is here, two GEMMs per chunk:
                 Hs <- S, V' = U0 - Wk Hs, V' and V'd to smem, S = gamma_last S + K^T V'd
  WG1 "chunk"    the state-free products of the next chunk: Wk and U0 (double-buffered)
  WG2 "output"   O = Q Hs, O += P V', rows < n stored to `out`
  WG3 "producer" one warp issuing the TMA tile loads of the next chunks
Two data stages (q, k, v, gc, M, P). Hs and V' are single buffers guarded by "used"
barriers, so the state warpgroup never runs a chunk ahead of the output warpgroup.

Initial state: pool[slot_ids[s], h, vslice, :] (V-first, fp32 or bf16) read in place when
slot >= 0 and has_initial_state[s]; otherwise zeros (padding slots, slot < 0, run from a zero
state: their output rows are computed and written, nothing in the pool is read or written).
Final state written back in place for slot >= 0, also for 0-length sequences (= initial state).
"""

import tilelang
import tilelang.language as T

C = 64
DK = 128
DV = 128
THREADS = 512

PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}

V_SPLITS = (2, 4)
# setmaxnreg budgets (state, chunk, output, producer): each sums to <= 512 (64K registers / 128
# threads per warpgroup). The chunk warpgroup holds the [64, 128] fp32 Wk accumulator.
_NREG = (168, 168, 128, 40)
# U0 buffers: two at BV = 32; one at BV = 64, where a second would pass the 227 KB of smem.
_U0_STAGES = {32: 2, 64: 1}


def main_func(num_v_heads: int, num_k_heads: int, io_dtype: str, pool_dtype: str, v_split: int):
    """Build the stage-2 PrimFunc. Symbolic: tokens, sequences, pool slots and every stride
    of q/k/v/out/pool, so one compile serves any batch and any engine pool layout.
    q and k are fp16 (stage 1's converted copies when io is bf16, else the inputs)."""
    if v_split not in V_SPLITS:
        raise ValueError(f"v_split must be one of {V_SPLITS} for the warp-specialised main kernel, got {v_split}")
    Hv, Hk = num_v_heads, num_k_heads
    group = Hv // Hk
    BV = DV // v_split
    NU = _U0_STAGES[BV]
    nreg_state, nreg_chunk, nreg_out, nreg_prod = _NREG
    ntok = T.dynamic("ntok")
    nseq = T.dynamic("nseq")
    nslot = T.dynamic("nslot")
    nhis = T.dynamic("nhis")
    nchunk = T.dynamic("nchunk")
    sq0, sq1 = T.dynamic("sq0"), T.dynamic("sq1")
    sk0, sk1 = T.dynamic("sk0"), T.dynamic("sk1")
    sv0, sv1 = T.dynamic("sv0"), T.dynamic("sv1")
    so0, so1 = T.dynamic("so0"), T.dynamic("so1")
    sp0 = T.dynamic("sp0")
    mm = "float16"
    acc = "float32"

    @T.prim_func
    def gdn_prefill_main(
        q: T.StridedTensor((ntok, Hk, DK), (sq0, sq1, 1), mm),
        k: T.StridedTensor((ntok, Hk, DK), (sk0, sk1, 1), mm),
        v: T.StridedTensor((ntok, Hv, DV), (sv0, sv1, 1), io_dtype),
        gbuf: T.Tensor((nchunk, Hv, C), "float32"),
        mbuf: T.Tensor((nchunk, Hv, C, C), mm),
        pbuf: T.Tensor((nchunk, Hv, C, C), mm),
        pool: T.StridedTensor((nslot, Hv, DV, DK), (sp0, DV * DK, DK, 1), pool_dtype),
        slot_ids: T.Tensor((nseq,), "int32"),
        has_init: T.Tensor((nhis,), "uint8"),
        cu_seqlens: T.Tensor((nseq + 1,), "int32"),
        chunk_offsets: T.Tensor((nseq + 1,), "int32"),
        out: T.StridedTensor((ntok, Hv, DV), (so0, so1, 1), io_dtype),
        scale: T.float32,
        all_init: T.int32,
    ):
        with T.Kernel(v_split, Hv, nseq, threads=THREADS) as (vb, h, s):
            hk = h // group
            v0 = vb * BV
            # Two data stages, filled by the producer's TMA loads.
            q_s = T.alloc_shared((2, C, DK), mm)
            k_s = T.alloc_shared((2, C, DK), mm)
            v_s = T.alloc_shared((2, C, BV), io_dtype)
            m_s = T.alloc_shared((2, C, C), mm)
            p_s = T.alloc_shared((2, C, C), mm)
            gc_s = T.alloc_shared((2, C), acc)
            # The chunk warpgroup's products, handed to the state warpgroup.
            wk_s = T.alloc_shared((2, C, DK), mm)  # -Wk
            u0_s = T.alloc_shared((NU, C, BV), acc)
            mg_s = T.alloc_shared((C, C), mm)  # M diag(exp(gc)), chunk warpgroup scratch
            vh_s = T.alloc_shared((C, BV), mm)  # V as fp16, chunk warpgroup scratch
            # The state warpgroup's products, read by the output warpgroup (and itself).
            hs_s = T.alloc_shared((DK, BV), mm)
            vp_s = T.alloc_shared((C, BV), mm)
            vpd_s = T.alloc_shared((C, BV), mm)
            h_f = T.alloc_fragment((DK, BV), acc)
            u_f = T.alloc_fragment((C, BV), acc)
            wk_f = T.alloc_fragment((C, DK), acc)
            u0_f = T.alloc_fragment((C, BV), acc)
            o_f = T.alloc_fragment((C, BV), acc)

            ready = T.alloc_barrier([32, 32])  # stage filled: the producer warp + TMA bytes
            free = T.alloc_barrier([384, 384])  # stage consumed by all three consumer warpgroups
            wk_ready = T.alloc_barrier([128, 128])  # WG1 wrote Wk (and U0) of the stage's chunk
            wk_free = T.alloc_barrier([128, 128])  # WG0 consumed that Wk
            u0_free = T.alloc_barrier([128] * NU)  # WG0 loaded that U0
            hs_ready = T.alloc_barrier(128)  # WG0 wrote Hs
            hs_used = T.alloc_barrier(128)  # WG2 finished reading Hs
            vp_ready = T.alloc_barrier(128)  # WG0 wrote V'
            vp_used = T.alloc_barrier(128)  # WG2 finished reading V'

            bos = cu_seqlens[s]
            eos = cu_seqlens[s + 1]
            coff = chunk_offsets[s]
            nchunks = T.ceildiv(eos - bos, C)
            tx = T.get_thread_binding()

            if tx < 128:
                T.set_max_nreg(nreg_state, 1)
                slot = slot_ids[s]
                load = T.alloc_var("int32")
                load = 0
                if slot >= 0:
                    if all_init != 0:
                        load = 1
                    elif has_init[s] != 0:
                        load = 1
                if load != 0:
                    for d, j in T.Parallel(DK, BV):
                        h_f[d, j] = T.cast(pool[slot, h, v0 + j, d], acc)
                else:
                    T.clear(h_f)
                gl = T.alloc_var(acc)
                for c in T.serial(nchunks):
                    st = c % 2
                    us = c % NU
                    n = T.min(eos - bos - c * C, C)
                    T.barrier_wait(ready[st], (c // 2) % 2)
                    T.barrier_wait(wk_ready[st], (c // 2) % 2)
                    T.barrier_wait(hs_used, (c + 1) % 2)
                    for d, j in T.Parallel(DK, BV):
                        hs_s[d, j] = T.cast(h_f[d, j], mm)
                    T.fence_proxy_async()
                    T.barrier_arrive(hs_ready)
                    # V' = U0 - Wk Hs
                    T.copy(u0_s[us, :, :], u_f)
                    T.barrier_arrive(u0_free[us])
                    T.gemm(wk_s[st, :, :], hs_s, u_f)
                    T.barrier_arrive(wk_free[st])
                    T.barrier_wait(vp_used, (c + 1) % 2)
                    gl = T.exp(gc_s[st, C - 1])
                    for i, j in T.Parallel(C, BV):
                        vp_s[i, j] = T.cast(u_f[i, j], mm)
                        vpd_s[i, j] = T.cast(
                            T.if_then_else(i < n, u_f[i, j] * T.exp(gc_s[st, C - 1] - gc_s[st, i]), 0.0), mm
                        )
                    T.fence_proxy_async()
                    T.barrier_arrive(vp_ready)
                    # S <- gamma_last S + K^T V'd
                    for d, j in T.Parallel(DK, BV):
                        h_f[d, j] = h_f[d, j] * gl
                    T.gemm(k_s[st, :, :], vpd_s, h_f, transpose_A=True)
                    T.barrier_arrive(free[st])
                if slot >= 0:
                    for d, j in T.Parallel(DK, BV):
                        pool[slot, h, v0 + j, d] = T.cast(h_f[d, j], pool_dtype)

            elif tx < 256:
                T.set_max_nreg(nreg_chunk, 1)
                for c in T.serial(nchunks):
                    st = c % 2
                    us = c % NU
                    T.barrier_wait(ready[st], (c // 2) % 2)
                    # Wk = M diag(exp(gc)) K, stored negated so WG0 accumulates V' onto U0.
                    for i, j in T.Parallel(C, C):
                        mg_s[i, j] = T.cast(T.cast(m_s[st, i, j], acc) * T.exp(gc_s[st, j]), mm)
                    T.fence_proxy_async()
                    T.gemm(mg_s, k_s[st, :, :], wk_f, clear_accum=True)
                    for i, j in T.Parallel(C, BV):
                        vh_s[i, j] = T.cast(v_s[st, i, j], mm)
                    T.fence_proxy_async()
                    T.gemm(m_s[st, :, :], vh_s, u0_f, clear_accum=True)
                    T.barrier_wait(wk_free[st], (c // 2 + 1) % 2)
                    for i, d in T.Parallel(C, DK):
                        wk_s[st, i, d] = T.cast(-wk_f[i, d], mm)
                    T.barrier_wait(u0_free[us], (c // NU + 1) % 2)
                    T.copy(u0_f, u0_s[us, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(wk_ready[st])
                    T.barrier_arrive(free[st])

            elif tx < 384:
                T.set_max_nreg(nreg_out, 1)
                for c in T.serial(nchunks):
                    st = c % 2
                    t0 = bos + c * C
                    n = T.min(eos - t0, C)
                    T.barrier_wait(ready[st], (c // 2) % 2)
                    T.barrier_wait(hs_ready, c % 2)
                    T.gemm(q_s[st, :, :], hs_s, o_f, clear_accum=True)
                    T.barrier_arrive(hs_used)
                    for i, j in T.Parallel(C, BV):
                        o_f[i, j] = o_f[i, j] * (T.exp(gc_s[st, i]) * scale)
                    T.barrier_wait(vp_ready, c % 2)
                    T.gemm(p_s[st, :, :], vp_s, o_f)
                    T.barrier_arrive(vp_used)
                    T.barrier_arrive(free[st])
                    for i, j in T.Parallel(C, BV):
                        if i < n:
                            out[t0 + i, h, v0 + j] = T.cast(o_f[i, j], io_dtype)

            else:
                T.set_max_nreg(nreg_prod, 0)
                if tx < 384 + 32:
                    for c in T.serial(nchunks):
                        st = c % 2
                        t0 = bos + c * C
                        cidx = coff + c
                        T.barrier_wait(free[st], (c // 2 + 1) % 2)
                        T.tma_copy(q[t0:t0 + C, hk, 0:DK], q_s[st, :, :], barrier=ready[st])
                        T.tma_copy(k[t0:t0 + C, hk, 0:DK], k_s[st, :, :], barrier=ready[st])
                        T.tma_copy(v[t0:t0 + C, h, v0:v0 + BV], v_s[st, :, :], barrier=ready[st])
                        T.tma_copy(gbuf[cidx, h, 0:C], gc_s[st, :], barrier=ready[st])
                        T.tma_copy(mbuf[cidx, h, 0:C, 0:C], m_s[st, :, :], barrier=ready[st])
                        T.tma_copy(pbuf[cidx, h, 0:C, 0:C], p_s[st, :, :], barrier=ready[st])
                        T.barrier_arrive(ready[st])

    return gdn_prefill_main, THREADS
