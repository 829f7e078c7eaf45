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
waits for the GPU. Grid (num_cut, Hv), 128 threads; thread t handles segments k = 1 + t,
1 + t + 128, ... of cut sequence j and walks back at most ``max_warmup`` chunks:
    warm_start[out_base + k, h] = w (the chunk, within the sequence, the walk starts at),
                                  or -1: the exact path (start from the scanned map)
    need_maps[j, h]             = 1 if any segment of (j, h) takes the exact path, else 0:
                                  the maps pass and the scan skip (j, h) when 0.
gamma_last[c] is read as fbuf[c, h, 0, 63] = exp(gc[63]) (prefill_prep.py); its log is the
chunk's summed g in fp32 (an exp that underflowed gives -inf: decayed, as it should).
"""

import tilelang
import tilelang.language as T

from ..reference import WARMUP_LOG_DECAY

C = 64
THREADS = 128

PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def warmup_func(num_v_heads: int):
    """Build the warmup-finder PrimFunc for Hv heads. cuts[j] = (seq, num_segments, out_base):
    cut sequence j's index, its segment count, and the output-pass item of its segment 0 (its
    segments are items out_base .. out_base + num_segments - 1, in order)."""
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
            tx = T.get_thread_binding()
            exact_s = T.alloc_shared((THREADS,), "int32")
            s = cuts[j, 0]
            nseg = cuts[j, 1]
            base = cuts[j, 2]
            coff = chunk_offsets[s]
            exact = T.alloc_var("int32")
            start = T.alloc_var("int32")
            decay = T.alloc_var("float32")
            exact = 0
            for kk in T.serial(T.ceildiv(nseg - 1, THREADS)):
                k = 1 + kk * THREADS + tx
                if k < nseg:
                    c0 = k * segment_chunks
                    start = -1
                    decay = 0.0
                    for w in T.serial(max_warmup):
                        c = c0 - 1 - w
                        if start < 0 and c >= 0:
                            decay = decay + T.log(fbuf[coff + c, h, 0, C - 1])
                            if decay <= WARMUP_LOG_DECAY:
                                start = c
                    warm_start[base + k, h] = start
                    if start < 0:
                        exact = 1
            exact_s[tx] = exact
            T.sync_threads()
            if tx == 0:
                for i in T.serial(1, THREADS):
                    exact = T.max(exact, exact_s[i])
                need_maps[j, h] = exact

    return gdn_prefill_cp_warmup
