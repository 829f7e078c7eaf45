// Stage 1's solve by blocks on mma.sync, with every operand in registers or read by ldmatrix
// (prefill_prep.py, PREP_SOLVE "mma"; T.import_source puts this before the kernel, after
// common.FAST_MATH_SOURCE, whose qla_ex2_ftz it calls).
//
// Computes, for one head of one chunk, what prefill_prep's form "m" writes:
//   W = A diag(beta),  A = (I + L)^-1,  L = StrictLower(diag(beta) K K^T)
//   M[i, c] = W[i, c] exp2(g2[i] - g2[c]) for i >= c, 0 above the diagonal
// (reference.block_substitution_solve, then prefill_prep._gated_m's gating). In 16x16 blocks,
// with Db_i = Dinv_i diag(beta_i) (Dinv_i the inverse of I + L's diagonal block i, from the
// substitution that runs before) and KK_ik the blocks of K K^T below the diagonal:
//   W_jj = Db_j,   W_ij = -Db_i sum_{k=j}^{i-1} KK_ik W_kj   (i > j)
// (block forward substitution: L_ik = diag(beta_i) KK_ik, and Dinv_i diag(beta_i) = Db_i).
// Warp j computes block column j, transposed (Y_ij = W_ij^T), so that each product's fp32
// accumulator is the next product's A operand in registers (the m16n8k16 C fragment of a 16x16
// result packs into its A fragment without moving between lanes):
//   Y_ij = -(sum_k Y_kj KK_ik^T) Db_i^T
// The B operands (KK_ik^T, Db_i^T) are ldmatrix loads of the blocks as stored, row-major. fp16
// operands and fp32 accumulation, as the wgmma solve (prefill_prep._solve) they replace.
//
// Tiles: koff (K K^T with its blocks below the diagonal; the diagonal and above are not read),
// db (Db_i in its diagonal blocks; the rest is not read) and out (M) are [64, 64] fp16 tiles in
// shared memory under TileLang's make_swizzled_layout, the 128-byte swizzle: element (r, c) at
// r * 64 + ((c / 8) ^ (r % 8)) * 8 + c % 8 (checked against the layout in
// tests/kernels/test_prefill_compile.py). g2: [64] fp32, gc log2(e) of the head. Every element of
// out is written (zeros above the diagonal). Called by all 128 threads of the CTA (four warps),
// after a barrier that makes koff, db and g2 visible; a barrier must follow before out is read.

__device__ __forceinline__ unsigned qla_sw128(int row, int chunk) {
  // byte offset of 16-byte chunk `chunk` of row `row` in a swizzled [64, 64] fp16 tile
  return (unsigned)(row * 128 + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void qla_ldsm_x4(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// B fragments of X^T for the 16x16 block of a swizzled tile at block (bi, bk), X row-major:
// r[0], r[1] for output columns 0-7 (X's rows 0-7), r[2], r[3] for 8-15.
__device__ __forceinline__ void qla_load_bt(unsigned tile, int bi, int bk, int lane, unsigned (&r)[4]) {
  const int m = lane >> 3;
  qla_ldsm_x4(tile + qla_sw128(16 * bi + 8 * (m >> 1) + (lane & 7), 2 * bk + (m & 1)), r);
}

__device__ __forceinline__ void qla_mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned qla_pack_half2(float lo, float hi) {
  unsigned r;  // cvt's first source goes to the upper half
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// The A fragment (fp16) of a 16x16 accumulator held as two m16n8 C fragments, times `sign`.
__device__ __forceinline__ void qla_acc_to_a(const float (&c)[2][4], float sign, unsigned (&a)[4]) {
  a[0] = qla_pack_half2(sign * c[0][0], sign * c[0][1]);
  a[1] = qla_pack_half2(sign * c[0][2], sign * c[0][3]);
  a[2] = qla_pack_half2(sign * c[1][0], sign * c[1][1]);
  a[3] = qla_pack_half2(sign * c[1][2], sign * c[1][3]);
}

// Block (bi, J) of M from Y_{bi J} (accumulators c): gated, masked on the diagonal block, to out
// by one stmatrix (transposed: Y's columns are M's rows).
template <int J>
__device__ __forceinline__ void qla_store_m_block(unsigned out, const float* g2, int bi, const float (&c)[2][4],
                                                  int lane) {
  const int grp = lane >> 2, tig = lane & 3;
  unsigned v[4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {  // Y rows grp (hr 0) and grp + 8 (hr 1): M's columns
      const int col = 16 * J + grp + 8 * hr;
      float e[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {  // Y columns: M's rows
        const int row = 16 * bi + 8 * nt + 2 * tig + q;
        const float x = c[nt][2 * hr + q] * qla_ex2_ftz(g2[row] - g2[col]);
        e[q] = row >= col ? x : 0.0f;  // above the diagonal the factor may be inf
      }
      v[2 * nt + hr] = qla_pack_half2(e[0], e[1]);
    }
  }
  // matrix m = 2 nt + hr holds Y rows 8 hr.., columns 8 nt..; stored transposed, its memory row a
  // is M's row 16 bi + 8 nt + a, columns 16 J + 8 hr .. + 7.
  const int m = lane >> 3;
  const unsigned addr = out + qla_sw128(16 * bi + 8 * (m >> 1) + (lane & 7), 2 * J + (m & 1));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]));
}

template <int J>
__device__ __forceinline__ void qla_solve_column(unsigned koff, unsigned db, const float* g2, unsigned out,
                                                 int lane) {
  // Every B operand of the column first (they depend on nothing computed here).
  unsigned bdb[4][4], bkk[4][4][4];
#pragma unroll
  for (int i = J; i < 4; ++i) {
    qla_load_bt(db, i, i, lane, bdb[i]);
#pragma unroll
    for (int k = J; k < i; ++k) qla_load_bt(koff, i, k, lane, bkk[i][k]);
  }
  // Y_JJ = I Db_J^T: the identity's A fragment (rows grp, grp + 8; columns 2 tig, 2 tig + 1, + 8).
  const int grp = lane >> 2, tig = lane & 3;
  const unsigned eye = qla_pack_half2(grp == 2 * tig ? 1.0f : 0.0f, grp == 2 * tig + 1 ? 1.0f : 0.0f);
  const unsigned ident[4] = {eye, 0u, 0u, eye};
  float y[4][2][4];
  unsigned ya[4][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) y[J][nt][e] = 0.0f;
    qla_mma16816(y[J][nt], ident, bdb[J][2 * nt], bdb[J][2 * nt + 1]);
  }
  qla_acc_to_a(y[J], 1.0f, ya[J]);
  qla_store_m_block<J>(out, g2, J, y[J], lane);  // each block leaves as soon as it is known
#pragma unroll
  for (int i = J + 1; i < 4; ++i) {
    float z[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) z[nt][e] = 0.0f;
#pragma unroll
      for (int k = J; k < i; ++k) qla_mma16816(z[nt], ya[k], bkk[i][k][2 * nt], bkk[i][k][2 * nt + 1]);
    }
    unsigned za[4];
    qla_acc_to_a(z, -1.0f, za);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) y[i][nt][e] = 0.0f;
      qla_mma16816(y[i][nt], za, bdb[i][2 * nt], bdb[i][2 * nt + 1]);
    }
    if (i < 3) qla_acc_to_a(y[i], 1.0f, ya[i]);
    qla_store_m_block<J>(out, g2, i, y[i], lane);
  }
  // Blocks above the diagonal in this column: zeros, one 16-byte chunk per lane and block.
#pragma unroll
  for (int i = 0; i < J; ++i) {
    const unsigned addr = out + qla_sw128(16 * i + (lane & 15), 2 * J + (lane >> 4));
    asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" :: "r"(addr), "r"(0u));
  }
}

__device__ __forceinline__ void qla_block_solve_m(const void* koff, const void* db, const float* g2, void* out) {
  const unsigned koff_a = (unsigned)__cvta_generic_to_shared(koff);
  const unsigned db_a = (unsigned)__cvta_generic_to_shared(db);
  const unsigned out_a = (unsigned)__cvta_generic_to_shared(out);
  const int lane = threadIdx.x & 31;
  switch ((threadIdx.x >> 5) & 3) {
    case 0: qla_solve_column<0>(koff_a, db_a, g2, out_a, lane); break;
    case 1: qla_solve_column<1>(koff_a, db_a, g2, out_a, lane); break;
    case 2: qla_solve_column<2>(koff_a, db_a, g2, out_a, lane); break;
    default: qla_solve_column<3>(koff_a, db_a, g2, out_a, lane); break;
  }
  // out is read next by a TMA store (the async proxy). (The stores above carry no "memory"
  // clobber, so that the gate loads between them are not repeated: nothing here reads out.)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
