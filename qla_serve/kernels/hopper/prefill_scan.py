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

A block owns `rows` rows of X for one (sequence, head) pair and keeps them in shared memory.
rows is chosen on the device, per launch, from the number P of pairs with work (those with at
least two maps that the warmup finder did not exempt, which the host cannot know): 2 rows if
64 P blocks fit on the GPU's SMs at once, else 4 if 32 P do, else 8. With few pairs the
chain is spread over more SMs; with many, each block does more of the (then throughput-bound)
work. A persistent grid of one block per SM (sm_count): every block counts the pairs with
work, then takes work items bid, bid + sm_count, ... (item i: row block i % (128 / rows) of the
(i // (128 / rows))-th such pair), keeping one running level count for the ring's barrier
phases. (8e88ca6 launched 64 blocks per pair, most returning at once but each holding an SM
with its 192 KB of shared memory while it counted: 2-6 us at few levels.)

Every level needs all of Phi_k^T (64 KB): warp 0 brings it into a ring of NSTAGES shared-memory
buffers by one TMA load per level, NSTAGES levels ahead. Thread (half, d) sums column d over
half of the inner dimension e (half 0: e < 64, half 1: e >= 64); half 1 hands its partial sums to
half 0 through shared memory, which adds B_k, stores X_k and keeps it for the next level. X's
rows are read four at a time (one 16-byte broadcast load). fp32 FMAs on the CUDA cores: no
tensor-core rounding (TF32 would add ~5e-4 relative error per level).
History (benchmarks/prefill.md v18): v9's scan (a block per 8 rows, a thread per column reading
X by 4-byte loads and Phi_k^T at the level it used it) took 29.7 us for 14 steps at 2/8
1x32768 (two of the eight heads on the exact path); at 4 rows with Phi_k^T in registers one
level ahead 21.4 us, with the TMA ring 17.7 us (benchmarks/cp_kernels.py: 14.7 us at 2 rows,
26.3 at 8; but at 8 rows 26.6 us when all eight heads take the exact path, where 4 rows need
two waves: 34.7).
"""

import tilelang
import tilelang.language as T

DV = 128
DK = 128
ROW_CHOICES = (2, 4, 8)  # rows of X per work item: 64, 32 or 16 items per pair
THREADS = 256
WARPS = THREADS // 32
HALF = DK // 2
NSTAGES = 3  # Phi_k^T buffers: 192 KB of shared memory, one block per SM

# The barriers below order every shared-memory handoff (X, the partial sums, the ring's reuse,
# the pair search); TileLang's automatic insertion would add one after each TMA issue.
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
                tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


def scan_func(num_v_heads: int, rows: int = 0, pdl: bool = False):
    """Build the scan PrimFunc for Hv heads. cut_levels[j] = number of maps of cut sequence j
    (its segments minus one); num_cut = cut_levels' length (symbolic); need_maps [num_cut, Hv]
    (prefill_warmup.py) is read only when use_warmup != 0; sm_count: the GPU's SMs. rows = 0
    picks the rows per block on the device (above); 2, 4 or 8 forces them (benchmarks). pdl: a
    programmatic dependent launch (prefill_main.main_func's pdl; prefill_api.CP_PDL)."""
    if rows not in (0,) + ROW_CHOICES:
        raise ValueError(f"rows: expected 0 (chosen per launch) or one of {ROW_CHOICES}, got {rows}")
    Hv = num_v_heads
    nmap = T.dynamic("nmap")
    ncut = T.dynamic("ncut")
    nneed = T.dynamic("nneed")  # num_cut, or 1 for the unread stand-in

    @T.macro
    def has_work(p, cut_levels, need_maps, use_warmup):
        """Pair p = j * Hv + h needs the scan: >= 2 maps, and not exempted by the finder."""
        return p < ncut * Hv and cut_levels[p // Hv] > 1 and (use_warmup == 0 or need_maps[p // Hv, p % Hv] != 0)

    @T.macro
    def scan_pair(R, rb, j, h, maps, cut_levels, phi_s, x_s, part_s, ready, b, b_next, acc, xv, t, used):
        """Rows rb R .. rb R + R - 1 of pair (j, h) through every level. `used`: the ring levels
        this block consumed before (level u of the block's run is in buffer u % NSTAGES, and
        waits for that buffer's fill u // NSTAGES)."""
        d = t % DV
        half = t // DV
        e0 = half * HALF
        r0 = rb * R
        levels = cut_levels[j]
        if t < 32:  # levels 1 .. NSTAGES into the ring
            for st in T.serial(NSTAGES):
                if 1 + st < levels:
                    u0 = (used + st) % NSTAGES
                    T.tma_copy(maps[(1 + st) * ncut + j, h, 1, 0:DK, 0:DV], phi_s[u0, :, :], barrier=ready[u0])
                    T.barrier_arrive(ready[u0])
        if half == 0:
            for r in T.unroll(R):
                x_s[r, d] = maps[j, h, 0, r0 + r, d]
                b[r] = maps[ncut + j, h, 0, r0 + r, d]
        T.sync_threads()
        for lvl in T.serial(1, levels):
            u = used + lvl - 1
            st = u % NSTAGES
            m = lvl * ncut + j
            if half == 0 and lvl + 1 < levels:  # the next level's B: in flight during this one
                for r in T.unroll(R):
                    b_next[r] = maps[m + ncut, h, 0, r0 + r, d]
            T.barrier_wait(ready[st], (u // NSTAGES) % 2)
            for r in T.unroll(R):
                acc[r] = 0.0
            for i4 in T.unroll(HALF // 4):
                for r in T.unroll(R):
                    for v in T.vectorized(4):
                        xv[r, v] = x_s[r, e0 + i4 * 4 + v]
                for v in T.unroll(4):
                    for r in T.unroll(R):
                        acc[r] += xv[r, v] * phi_s[st, e0 + i4 * 4 + v, d]
            if half == 1:
                for r in T.unroll(R):
                    part_s[r, d] = acc[r]
            T.sync_threads()  # every thread has read X_{k-1} and ring buffer st
            if t < 32 and lvl + NSTAGES < levels:
                T.tma_copy(maps[m + NSTAGES * ncut, h, 1, 0:DK, 0:DV], phi_s[st, :, :], barrier=ready[st])
                T.barrier_arrive(ready[st])
            if half == 0:
                for r in T.unroll(R):
                    acc[r] = acc[r] + part_s[r, d] + b[r]
                    x_s[r, d] = acc[r]
                    maps[m, h, 0, r0 + r, d] = acc[r]
            T.sync_threads()
            for r in T.unroll(R):
                b[r] = b_next[r]

    @T.prim_func
    def gdn_prefill_cp_scan(
        maps: T.Tensor((nmap, Hv, 2, DV, DK), "float32"),
        cut_levels: T.Tensor((ncut,), "int32"),
        need_maps: T.Tensor((nneed, Hv), "int32"),
        use_warmup: T.int32,
        sm_count: T.int32,
    ):
        with T.Kernel(sm_count, threads=THREADS) as bid:
            if pdl:  # a programmatic dependent launch (prefill_api.CP_PDL)
                T.pdl_trigger()
                T.pdl_sync()
            phi_s = T.alloc_shared((NSTAGES, DK, DV), "float32")  # Phi_k^T[e, d], a ring
            x_s = T.alloc_shared((8, DK), "float32")  # X_{k-1}'s rows of this block
            part_s = T.alloc_shared((8, DV), "float32")  # half 1's partial sums
            warp_s = T.alloc_shared((WARPS,), "int32")
            pair_s = T.alloc_shared((1,), "int32")
            ready = T.alloc_barrier([32] * NSTAGES)  # warp 0's arrival + the TMA bytes
            b = T.alloc_local((8,), "float32")  # B_k^T[r0 + r, d] (half 0)
            b_next = T.alloc_local((8,), "float32")
            acc = T.alloc_local((8,), "float32")
            xv = T.alloc_local((8, 4), "float32")
            t = T.get_thread_binding()
            lane = t % 32
            warp = t // 32
            tiles = T.ceildiv(ncut * Hv, THREADS)
            nwork = T.alloc_var("int32")
            nwork = 0
            for tile in T.serial(tiles):
                nwork = nwork + T.syncthreads_count(has_work(tile * THREADS + t, cut_levels, need_maps, use_warmup))
            R = T.alloc_var("int32")
            if rows:
                R = rows
            else:
                R = T.if_then_else(nwork * (DV // 2) <= sm_count, 2, T.if_then_else(nwork * (DV // 4) <= sm_count, 4, 8))
            used = T.alloc_var("int32")  # ring levels this block has consumed
            used = 0
            before = T.alloc_var("int32")
            mine = T.alloc_var("int32")
            for k in T.serial(T.ceildiv(nwork * (DV // R) - bid, sm_count)):
                item = bid + k * sm_count
                rank = item // (DV // R)
                rb = item % (DV // R)
                # Which pair has this rank among those with work: a block-wide prefix count.
                before = 0
                for tile in T.serial(tiles):
                    p = tile * THREADS + t
                    work = has_work(p, cut_levels, need_maps, use_warmup)
                    votes = T.Cast("uint32", T.ballot_sync(work, 0xFFFFFFFF))
                    if lane == 0:
                        warp_s[warp] = T.popcount(votes)
                    T.sync_threads()
                    mine = before + T.popcount(votes & ((T.Cast("uint32", 1) << lane) - 1))
                    for w in T.serial(WARPS):
                        if w < warp:
                            mine = mine + warp_s[w]
                        before = before + warp_s[w]
                    if work and mine == rank:
                        pair_s[0] = p
                    T.sync_threads()  # warp_s is rewritten by the next tile
                j = pair_s[0] // Hv
                h = pair_s[0] % Hv
                if R == 2:
                    scan_pair(2, rb, j, h, maps, cut_levels, phi_s, x_s, part_s, ready, b, b_next, acc, xv, t, used)
                elif R == 4:
                    scan_pair(4, rb, j, h, maps, cut_levels, phi_s, x_s, part_s, ready, b, b_next, acc, xv, t, used)
                else:
                    scan_pair(8, rb, j, h, maps, cut_levels, phi_s, x_s, part_s, ready, b, b_next, acc, xv, t, used)
                used = used + cut_levels[j] - 1

    return gdn_prefill_cp_scan
