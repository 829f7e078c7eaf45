"""Prefill CP, the scan between the two passes (prefill_api, strategy "cp"): one launch.

The "maps" pass (prefill_main, mode "maps") leaves, for map m = k * num_cut + j (segment k of
cut sequence j, every segment but the sequence's last), V-first like the pool:
  maps[m, h, 0] = X_k:  for k = 0 the true state at the segment's end (X = S^T); for k > 0 the
                        segment's walk from a zero state, B_k^T
  maps[m, h, 1] = Phi_k^T (k > 0): the segment's transition, S_end = Phi_k S_start + B_k.
The scan makes every X_k the true end state, in order of k:
  X_k <- X_{k-1} @ maps[m, h, 1] + maps[m, h, 0]      (= (Phi_k S_{k-1} + B_k)^T)
which is reference.segmented_gdn's scan (the float64 oracle). With gate warmup (use_warmup = 1),
pairs (j, h) with need_maps[j, h] = 0 are skipped: no segment of theirs reads a map.

Grid (128 / ROWS, Hv, num_cut), 128 threads: a block owns ROWS rows of X for one head of one
cut sequence, thread d owns column d of them, keeps the rows of X_{k-1} in shared memory and
reads column d of Phi_k^T from global memory (coalesced across the threads). fp32 FMAs on the
CUDA cores: no tensor-core rounding (TF32 would add ~5e-4 relative error per level).
"""

import tilelang
import tilelang.language as T

DV = 128
DK = 128
ROWS = 8  # rows of X per block: 16 blocks per (head, sequence)

PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def scan_func(num_v_heads: int):
    """Build the scan PrimFunc for Hv heads. cut_levels[j] = number of maps of cut sequence j
    (its segments minus one); num_cut = cut_levels' length (symbolic); need_maps [num_cut, Hv]
    (prefill_warmup.py) is read only when use_warmup != 0."""
    Hv = num_v_heads
    nmap = T.dynamic("nmap")
    ncut = T.dynamic("ncut")
    nneed = T.dynamic("nneed")  # num_cut, or 1 for the unread stand-in

    @T.prim_func
    def gdn_prefill_cp_scan(
        maps: T.Tensor((nmap, Hv, 2, DV, DK), "float32"),
        cut_levels: T.Tensor((ncut,), "int32"),
        need_maps: T.Tensor((nneed, Hv), "int32"),
        use_warmup: T.int32,
    ):
        with T.Kernel(DV // ROWS, Hv, ncut, threads=DK) as (rb, h, j):
            x_s = T.alloc_shared((ROWS, DK), "float32")
            acc = T.alloc_local((ROWS,), "float32")
            d = T.get_thread_binding()
            r0 = rb * ROWS
            levels = T.if_then_else(use_warmup != 0 and need_maps[j, h] == 0, 0, cut_levels[j])
            for r in T.serial(ROWS):
                x_s[r, d] = maps[j, h, 0, r0 + r, d]
            T.sync_threads()
            for lvl in T.serial(1, levels):
                m = lvl * ncut + j
                for r in T.serial(ROWS):
                    acc[r] = maps[m, h, 0, r0 + r, d]
                for e in T.unroll(DK):
                    p = maps[m, h, 1, e, d]
                    for r in T.serial(ROWS):
                        acc[r] += x_s[r, e] * p
                T.sync_threads()  # every thread has read X_{k-1}
                for r in T.serial(ROWS):
                    x_s[r, d] = acc[r]
                    maps[m, h, 0, r0 + r, d] = acc[r]
                T.sync_threads()

    return gdn_prefill_cp_scan
