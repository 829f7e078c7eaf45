"""Prefill stage 2: the sequential chunk walk, fused.

Grid: one CTA per (sequence s, v-head h, value slice vb) with the state slice
S[:, vb*BV:(vb+1)*BV] (K-first, [128, BV], fp32) held in registers for the whole sequence:
W, U, V' and the per-chunk states never reach HBM. BV = 128 / v_split; the consumer is 256
threads for BV = 128 (two warpgroups, 64 state registers each), 128 otherwise. The chunk loop is
a T.Pipelined loop (2 stages): TileLang splits the CTA into a TMA producer (q, k, v tiles and
stage 1's gc, M, P tiles, one mbarrier pair per buffer) and the consumer warpgroup(s).

Per chunk (n <= 64 valid rows; tiles are loaded whole: rows >= n are the next sequence's or
zero-filled past T, and only meet zero weights: M is lower triangular, dec = 0 there, W is
masked), with gc, M, P from stage 1 (prefill_prep.py) and Ms = fp16 copy of the state:
  U     = K Ms                          [64, BV]
  W     = V - diag(exp(gc)) U           -> fp16 smem (rows >= n zeroed)
  V'    = M W                           (M = (Gamma o A) diag(beta))
  O     = scale diag(exp(gc)) Q Ms + P V'   (P = scale Lower(Gamma) o Q K^T)
  S    <- gamma_last S + K^T diag(gamma_last / gamma) V'     (dec = 0 for rows >= n)
All GEMM operands are fp16 with fp32 accumulation (q/k are converted in shared memory when io is
bf16); see prefill_prep.py for why fp16 and not bf16. Shared memory at BV = 128 is 225 KB (of
227 KB): W and V' share a buffer.

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

PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def main_func(num_v_heads: int, num_k_heads: int, io_dtype: str, pool_dtype: str, v_split: int):
    """Build the stage-2 PrimFunc. Symbolic: tokens, sequences, pool slots and every stride
    of q/k/v/out/pool, so one compile serves any batch and any engine pool layout."""
    Hv, Hk = num_v_heads, num_k_heads
    group = Hv // Hk
    BV = DV // v_split
    threads = 256 if BV == 128 else 128
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
    col = T.GemmWarpPolicy.FullCol
    row = T.GemmWarpPolicy.FullRow

    @T.prim_func
    def gdn_prefill_main(
        q: T.StridedTensor((ntok, Hk, DK), (sq0, sq1, 1), io_dtype),
        k: T.StridedTensor((ntok, Hk, DK), (sk0, sk1, 1), io_dtype),
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
        with T.Kernel(v_split, Hv, nseq, threads=threads) as (vb, h, s):
            hk = h // group
            v0 = vb * BV
            convert = io_dtype != mm
            qr_s = T.alloc_shared((C, DK), io_dtype)
            kr_s = T.alloc_shared((C, DK), io_dtype)
            vr_s = T.alloc_shared((C, BV), io_dtype)
            q_s = T.alloc_shared((C, DK), mm) if convert else qr_s
            k_s = T.alloc_shared((C, DK), mm) if convert else kr_s
            hs_s = T.alloc_shared((DK, BV), mm)
            w_s = T.alloc_shared((C, BV), mm)
            vp_s = w_s  # V' overwrites W once M W is done: saves 16 KB (BV=128 is at the 227 KB limit)
            vpd_s = T.alloc_shared((C, BV), mm)
            m_s = T.alloc_shared((C, C), mm)
            p_s = T.alloc_shared((C, C), mm)
            gc_s = T.alloc_shared((C,), acc)
            gam_s = T.alloc_shared((C,), acc)
            dec_s = T.alloc_shared((C,), acc)
            h_f = T.alloc_fragment((DK, BV), acc)
            u_f = T.alloc_fragment((C, BV), acc)
            o_f = T.alloc_fragment((C, BV), acc)

            bos = cu_seqlens[s]
            eos = cu_seqlens[s + 1]
            coff = chunk_offsets[s]
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
            nchunks = T.ceildiv(eos - bos, C)
            for c in T.Pipelined(nchunks, num_stages=2):
                t0 = bos + c * C
                n = T.min(eos - t0, C)
                # Bulk tile loads, unmasked: rows >= n (next sequence, or zero-filled past T) are
                # finite and only ever meet zero weights below (M columns, dec, the causal mask),
                # except W, which is masked explicitly.
                cidx = coff + c
                T.copy(q[t0:t0 + C, hk, 0:DK], qr_s)
                T.copy(k[t0:t0 + C, hk, 0:DK], kr_s)
                T.copy(v[t0:t0 + C, h, v0:v0 + BV], vr_s)
                T.copy(gbuf[cidx, h, 0:C], gc_s)
                T.copy(mbuf[cidx, h, 0:C, 0:C], m_s)
                T.copy(pbuf[cidx, h, 0:C, 0:C], p_s)
                if convert:
                    for i, d in T.Parallel(C, DK):
                        q_s[i, d] = T.cast(qr_s[i, d], mm)
                        k_s[i, d] = T.cast(kr_s[i, d], mm)
                for d, j in T.Parallel(DK, BV):
                    hs_s[d, j] = T.cast(h_f[d, j], mm)
                for i in T.Parallel(C):
                    gam_s[i] = T.exp(gc_s[i]) * scale
                    dec_s[i] = T.if_then_else(i < n, T.exp(gc_s[C - 1] - gc_s[i]), 0.0)

                # U = K S ; W = V - gamma U
                T.gemm(k_s, hs_s, u_f, clear_accum=True, policy=col)
                for i, j in T.Parallel(C, BV):
                    w_s[i, j] = T.cast(
                        T.if_then_else(i < n, T.cast(vr_s[i, j], acc) - T.exp(gc_s[i]) * u_f[i, j], 0.0), mm
                    )
                # V' = M W
                T.gemm(m_s, w_s, u_f, clear_accum=True, policy=col)
                for i, j in T.Parallel(C, BV):
                    vp_s[i, j] = T.cast(u_f[i, j], mm)
                    vpd_s[i, j] = T.cast(u_f[i, j] * dec_s[i], mm)

                # O = scale diag(gamma) Q S + P V'   (P = scale Lower(Gamma) o Q K^T, from stage 1)
                T.gemm(q_s, hs_s, o_f, clear_accum=True, policy=col)
                for i, j in T.Parallel(C, BV):
                    o_f[i, j] = o_f[i, j] * gam_s[i]
                T.gemm(p_s, vp_s, o_f, policy=col)
                for i, j in T.Parallel(C, BV):
                    if i < n:
                        out[t0 + i, h, v0 + j] = T.cast(o_f[i, j], io_dtype)

                # S <- gamma_last S + K^T diag(gamma_last / gamma) V'
                gl = T.exp(gc_s[C - 1])
                for d, j in T.Parallel(DK, BV):
                    h_f[d, j] = h_f[d, j] * gl
                T.gemm(k_s, vpd_s, h_f, transpose_A=True, policy=row)

            if slot >= 0:
                for d, j in T.Parallel(DK, BV):
                    pool[slot, h, v0 + j, d] = T.cast(h_f[d, j], pool_dtype)

    return gdn_prefill_main, threads
