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

Grid (128 / rows, Hv, num_cut), 256 threads: a block owns `rows` rows of X for one head of one
cut sequence and keeps them in shared memory. Every level needs all of Phi_k^T (64 KB): warp 0
brings it into a ring of NSTAGES shared-memory buffers by one TMA load per level, NSTAGES levels
ahead, so the chain waits on the copy only when the L2 cannot keep up. Thread (half, d) sums
column d over half of the inner dimension e (half 0: e < 64, half 1: e >= 64); half 1 hands its
partial sums to half 0 through shared memory, which adds B_k, stores X_k and keeps it for the
next level. X's rows are read four at a time (one 16-byte broadcast load). fp32 FMAs on the CUDA
cores: no tensor-core rounding (TF32 would add ~5e-4 relative error per level).
History (benchmarks/prefill.md v18): v9's scan, a thread per column reading X by 4-byte loads
and Phi_k^T at the level it used it, took 29.7 us for 14 steps at 2/8 1x32768; with Phi_k^T
loaded into registers one level ahead, 21.4 us.
"""

import tilelang
import tilelang.language as T

DV = 128
DK = 128
ROWS = 4  # rows of X per block: 32 blocks per (head, sequence)
THREADS = 256
HALF = DK // 2
NSTAGES = 3  # Phi_k^T buffers: 192 KB of shared memory, one block per SM

# The two barriers per level below order every shared-memory handoff (X, the partial sums, the
# ring's reuse); TileLang's automatic insertion would add a third, after the TMA issue.
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
                tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


def scan_func(num_v_heads: int, rows: int = ROWS):
    """Build the scan PrimFunc for Hv heads (`rows` rows of X per block, a divisor of 128).
    cut_levels[j] = number of maps of cut sequence j (its segments minus one); num_cut =
    cut_levels' length (symbolic); need_maps [num_cut, Hv] (prefill_warmup.py) is read only
    when use_warmup != 0."""
    if DV % rows:
        raise ValueError(f"rows: expected a divisor of {DV}, got {rows}")
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
        with T.Kernel(DV // rows, Hv, ncut, threads=THREADS) as (rb, h, j):
            phi_s = T.alloc_shared((NSTAGES, DK, DV), "float32")  # Phi_k^T[e, d], a ring
            x_s = T.alloc_shared((rows, DK), "float32")  # X_{k-1}'s rows r0 .. r0 + rows - 1
            part_s = T.alloc_shared((rows, DV), "float32")  # half 1's partial sums
            ready = T.alloc_barrier([32] * NSTAGES)  # warp 0's arrival + the TMA bytes
            b = T.alloc_local((rows,), "float32")  # B_k^T[r0 + r, d] (half 0)
            b_next = T.alloc_local((rows,), "float32")
            acc = T.alloc_local((rows,), "float32")
            xv = T.alloc_local((rows, 4), "float32")
            t = T.get_thread_binding()
            d = t % DV
            half = t // DV
            e0 = half * HALF
            r0 = rb * rows
            levels = T.if_then_else(use_warmup != 0 and need_maps[j, h] == 0, 0, cut_levels[j])
            if t < 32:  # levels 1 .. NSTAGES into the ring
                for st in T.serial(NSTAGES):
                    if 1 + st < levels:
                        T.tma_copy(maps[(1 + st) * ncut + j, h, 1, 0:DK, 0:DV], phi_s[st, :, :],
                                   barrier=ready[st])
                        T.barrier_arrive(ready[st])
            if half == 0:
                for r in T.serial(rows):
                    x_s[r, d] = maps[j, h, 0, r0 + r, d]
                if levels > 1:
                    for r in T.unroll(rows):
                        b[r] = maps[ncut + j, h, 0, r0 + r, d]
            T.sync_threads()
            for lvl in T.serial(1, levels):
                st = (lvl - 1) % NSTAGES
                m = lvl * ncut + j
                if half == 0 and lvl + 1 < levels:  # the next level's B: in flight during this one
                    for r in T.unroll(rows):
                        b_next[r] = maps[m + ncut, h, 0, r0 + r, d]
                T.barrier_wait(ready[st], ((lvl - 1) // NSTAGES) % 2)
                for r in T.unroll(rows):
                    acc[r] = 0.0
                for i4 in T.unroll(HALF // 4):
                    for r in T.unroll(rows):
                        for v in T.vectorized(4):
                            xv[r, v] = x_s[r, e0 + i4 * 4 + v]
                    for v in T.unroll(4):
                        for r in T.unroll(rows):
                            acc[r] += xv[r, v] * phi_s[st, e0 + i4 * 4 + v, d]
                if half == 1:
                    for r in T.unroll(rows):
                        part_s[r, d] = acc[r]
                T.sync_threads()  # every thread has read X_{k-1} and ring buffer st
                if t < 32 and lvl + NSTAGES < levels:
                    T.tma_copy(maps[m + NSTAGES * ncut, h, 1, 0:DK, 0:DV], phi_s[st, :, :], barrier=ready[st])
                    T.barrier_arrive(ready[st])
                if half == 0:
                    for r in T.unroll(rows):
                        acc[r] = acc[r] + part_s[r, d] + b[r]
                        x_s[r, d] = acc[r]
                        maps[m, h, 0, r0 + r, d] = acc[r]
                T.sync_threads()
                for r in T.unroll(rows):
                    b[r] = b_next[r]

    return gdn_prefill_cp_scan
