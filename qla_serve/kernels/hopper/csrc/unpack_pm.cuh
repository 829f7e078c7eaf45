// Stage 2's unpack of stage 1's packed tile (prefill_prep form "m"; prefill_main_vfirst._unpacker):
// pm holds P^T on and above the diagonal and M's strict lower triangle below it, d M's diagonal
// (prefill_prep's mbuf / dbuf). Writes m = M (pm below the diagonal, d on it, 0 above) and, with
// with_p, p = P^T (pm on and above the diagonal, 0 below): the zero-filled tiles the chain's GEMMs
// take. All three are [64, 64] fp16 tiles in shared memory under TileLang's make_swizzled_layout (the
// 128-byte swizzle: element (r, c) at r * 64 + ((c / 8) ^ (r % 8)) * 8 + c % 8, as block_solve.cuh),
// so each 16-byte piece is masked in place, by position, as four 32-bit words: branch-free, 16-byte
// loads and stores. Called by 64 threads (t = 0..63), between the stage's TMA arrival and the
// consumers' barrier; a fence.proxy.async must follow before wgmma reads m and p.
//
// Why this form (sessions 48 and 60, H100): d050e09's unpack by a per-element select compiled to
// ~100 instructions with a branch per element for each piece, on two warps, on the chain's critical
// path (the ring leaves one chunk of slack): stage 2 1.6-2.6x slower. This one is ~30 instructions
// a piece, two pieces' loads in flight, no spills under the producer's 40 registers.
__device__ __forceinline__ void qla_unpack_pm(const void* pm, const void* d, void* m, void* p, int t, int with_p) {
  // Thread t (0..63) takes pieces t, t + 64, ..., t + 448: rows 8 r + dl (r = 0..7), and under the
  // swizzle always the logical columns 8 lc .. 8 lc + 7. So piece r lies above the diagonal for
  // r < lc (M: 0, P^T: all), below it for r > lc (M: all, P^T: 0), and holds it for r == lc, at
  // element dl (M: e < dl and M's diagonal at dl; P^T: e >= dl).
  const unsigned pm_a = (unsigned)__cvta_generic_to_shared(pm);
  const unsigned m_a = (unsigned)__cvta_generic_to_shared(m);
  const unsigned p_a = (unsigned)__cvta_generic_to_shared(p);
  const int dl = t >> 3;
  const int lc = (t & 7) ^ dl;
  unsigned short dv;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(dv) : "r"((unsigned)__cvta_generic_to_shared(d) + (8 * lc + dl) * 2));
  unsigned dkeep[4], ddiag[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    dkeep[w] = ((2 * w < dl) ? 0x0000ffffu : 0u) | ((2 * w + 1 < dl) ? 0xffff0000u : 0u);
    ddiag[w] = (2 * w == dl) ? (unsigned)dv : ((2 * w + 1 == dl) ? ((unsigned)dv << 16) : 0u);
  }
#pragma unroll 1
  for (int r0 = 0; r0 < 8; r0 += 2) {  // two pieces' loads in flight, then their stores
    unsigned x[2][4];
#pragma unroll
    for (int q = 0; q < 2; ++q)
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(x[q][0]), "=r"(x[q][1]), "=r"(x[q][2]), "=r"(x[q][3]) : "r"(pm_a + (unsigned)((r0 + q) * 64 + t) * 16u));
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int r = r0 + q;
      const unsigned off = (unsigned)(r * 64 + t) * 16u;
      unsigned mw[4], pw[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const unsigned keep = r > lc ? 0xffffffffu : (r == lc ? dkeep[w] : 0u);
        mw[w] = (x[q][w] & keep) | (r == lc ? ddiag[w] : 0u);
        pw[w] = x[q][w] & ~keep;
      }
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" :: "r"(m_a + off), "r"(mw[0]), "r"(mw[1]), "r"(mw[2]), "r"(mw[3]) : "memory");
      if (with_p)
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" :: "r"(p_a + off), "r"(pw[0]), "r"(pw[1]), "r"(pw[2]), "r"(pw[3]) : "memory");
    }
  }
}
