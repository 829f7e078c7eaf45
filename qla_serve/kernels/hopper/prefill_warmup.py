"""Prefill CP, gate warmup: where each segment's state walk starts, per head, found on the device.

Context parallelism (prefill_api, strategy "cp", plan.cp "auto") cuts a sequence into segments
of L chunks that run in parallel; segment k > 0 needs the true state at its first chunk c0 = k L.
For a head whose gates decay, history older than a summed log decay of WARMUP_LOG_DECAY (-10)
is scaled by at most e^-10 ~ 4.5e-5 (each chunk's transition is a decay times a contraction), so
the segment may instead walk from a zero state at the latest chunk w < c0 with
    sum_{w <= c < c0} log gamma_last[c] <= -10        (gamma_last[c] = the chunk's total decay)
and write outputs from c0 on: the gate warmup of reference.warmup_gdn / warmup_start_chunks (the
float64 oracle). Heads that would need more than ``max_warmup`` chunks (g = 0 heads: never)
take the exact path instead: maps pass, scan, start from the map. max_warmup < L
(prefill_api.max_warmup_chunks), so a warmup never reaches the sequence's chunk 0 and never
reads the pool (whose slot the sequence's last segment writes in the same launch).

This kernel decides that per (segment, head) from stage 1's gate factors, so the host never
waits for the GPU. Grid (num_cut, Hv), 512 threads (16 warps); warp w handles segments
k = 1 + w, 17 + w, ... of cut sequence j (16 warps: a 1 x 32768 sequence at L = 32 has 15
segments to place, one round; v18-v19's 4 warps took four, 3.9 -> 2.6 us on the H200,
benchmarks/prefill.md v20). Lane i of a warp reads the log decay of chunk c0 - 1 - (32 b + i)
in window b = 0, 1, ... (one load per lane: the 32 loads of a window are in flight together), a
warp prefix sum (shuffles) plus the earlier windows' total gives the summed decay back to that
chunk, and the first lane at or below WARMUP_LOG_DECAY (ballot) is the start:
    warm_start[out_base + k, h] = w (the chunk, within the sequence, the walk starts at),
                                  or -1: the exact path (start from the scanned map)
    need_maps[j, h]             = 1 if any segment of (j, h) takes the exact path, else 0:
                                  the maps pass and the scan skip (j, h) when 0.
gamma_last[c] is read as fbuf[c, h, 0, 63] = exp(gc[63]) (prefill_prep.py); its log is the
chunk's summed g in fp32 (an exp that underflowed gives -inf: decayed, as it should). The fp32
sums are associated differently from a left-to-right walk: a start may move by one chunk where
the float64 sum lies within rounding of the threshold (tests/kernels/test_prefill_gpu.py
allows exactly that).
(v9's finder walked back one dependent load at a time, a thread per segment: 10.5 us at 2/8
1x32768, the longest warmup 16 chunks; benchmarks/prefill.md v18.)
"""

import tilelang
import tilelang.language as T

from ..reference import WARMUP_LOG_DECAY

C = 64
THREADS = 512
WARPS = THREADS // 32
FULL_MASK = 0xFFFFFFFF

PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def warmup_func(num_v_heads: int, pdl: bool = False):
    """Build the warmup-finder PrimFunc for Hv heads. cuts[j] = (seq, num_segments, out_base):
    cut sequence j's index, its segment count, and the output-pass item of its segment 0 (its
    segments are items out_base .. out_base + num_segments - 1, in order). pdl: a
    programmatic dependent launch (prefill_main.main_func's pdl; prefill_api.CP_PDL)."""
    Hv = num_v_heads
    nchunk = T.dynamic("nchunk")
    nseq = T.dynamic("nseq")
    nitem = T.dynamic("nitem")
    ncut = T.dynamic("ncut")

    @T.prim_func
    def gdn_prefill_cp_warmup(
        fbuf: T.Tensor((nchunk, Hv, 2, C), "float32"),
        chunk_offsets: T.Tensor((nseq + 1,), "int32"),
        cuts: T.Tensor((ncut, 3), "int32"),
        warm_start: T.Tensor((nitem, Hv), "int32"),
        need_maps: T.Tensor((ncut, Hv), "int32"),
        segment_chunks: T.int32,
        max_warmup: T.int32,
    ):
        with T.Kernel(ncut, Hv, threads=THREADS) as (j, h):
            if pdl:  # a programmatic dependent launch (prefill_api.CP_PDL)
                T.pdl_trigger()
                T.pdl_sync()
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            exact_s = T.alloc_shared((WARPS,), "int32")
            s = cuts[j, 0]
            nseg = cuts[j, 1]
            base = cuts[j, 2]
            coff = chunk_offsets[s]
            exact = T.alloc_var("int32")
            start = T.alloc_var("int32")
            carry = T.alloc_var("float32")  # the summed log decay of the windows before this one
            x = T.alloc_var("float32")
            hits = T.alloc_var("uint32")
            exact = 0
            for kk in T.serial(T.ceildiv(nseg - 1, WARPS)):
                k = 1 + kk * WARPS + warp  # warp-uniform
                if k < nseg:
                    c0 = k * segment_chunks
                    start = -1
                    carry = 0.0
                    for b in T.serial(T.ceildiv(max_warmup, 32)):
                        if start < 0:  # warp-uniform: every lane saw the same ballot
                            w = b * 32 + lane
                            c = c0 - 1 - w
                            x = T.if_then_else(w < max_warmup and c >= 0,
                                               T.log(fbuf[coff + T.max(c, 0), h, 0, C - 1]), 0.0)
                            for o in T.unroll(5):  # inclusive prefix sum over the lanes
                                y = T.shfl_up(x, 1 << o)
                                if lane >= (1 << o):
                                    x = x + y
                            hits = T.Cast("uint32", T.ballot_sync(
                                w < max_warmup and c >= 0 and carry + x <= WARMUP_LOG_DECAY, FULL_MASK))
                            if hits != 0:
                                start = c0 - 1 - (b * 32 + T.__ffs(T.Cast("int32", hits)) - 1)
                            carry = carry + T.shfl_sync(x, 31)
                    if lane == 0:
                        warm_start[base + k, h] = start
                    if start < 0:
                        exact = 1
            if lane == 0:
                exact_s[warp] = exact
            T.sync_threads()
            if tx == 0:
                for i in T.serial(1, WARPS):
                    exact = T.max(exact, exact_s[i])
                need_maps[j, h] = exact

    return gdn_prefill_cp_warmup
