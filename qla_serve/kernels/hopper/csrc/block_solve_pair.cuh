// Stage 1's solve for two heads at once (prefill_prep.py's pair_solve; T.import_source puts this
// after csrc/block_solve.cuh, whose qla_solve_column it calls).

// Two heads of one chunk at once (prefill_prep's heads_per_cta >= 2): warps 0-1 solve head A,
// warps 2-3 head B, each warp two block columns (the even split of the work: column 0, the
// longest chain, with column 3, the shortest; columns 1 and 2 together), so that the two heads'
// chains run side by side instead of one after the other with most warps idle. Per head the
// operations are qla_block_solve_m's (the same M, bit for bit). Called by all 128 threads, with
// the same barriers around it as qla_block_solve_m.
__device__ __forceinline__ void qla_block_solve_m_pair(const void* koff, const void* db_a, const float* g2_a,
                                                       void* out_a, const void* db_b, const float* g2_b,
                                                       void* out_b) {
  const unsigned koff_s = (unsigned)__cvta_generic_to_shared(koff);
  const int warp = (threadIdx.x >> 5) & 3;
  const bool head_b = warp >= 2;
  const unsigned db = (unsigned)__cvta_generic_to_shared(head_b ? db_b : db_a);
  const unsigned out = (unsigned)__cvta_generic_to_shared(head_b ? out_b : out_a);
  const float* g2 = head_b ? g2_b : g2_a;
  const int lane = threadIdx.x & 31;
  if ((warp & 1) == 0) {
    qla_solve_column<0>(koff_s, db, g2, out, lane);
    qla_solve_column<3>(koff_s, db, g2, out, lane);
  } else {
    qla_solve_column<1>(koff_s, db, g2, out, lane);
    qla_solve_column<2>(koff_s, db, g2, out, lane);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
