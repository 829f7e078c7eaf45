"""What one 64-token chunk costs in each prefill stage, and in FlashInfer's fused kernel: the
figures that decide whether stage 1 can run inside stage 2 as a producer warpgroup (issue 28;
FlashInfer 0.7.2's SM90 prefill does that, benchmarks/prefill.md).

    python benchmarks/chunk_cost.py [--heads 2/8] [--json F]     # on the H200

1. Stage 1 (prep, one v-head per CTA) on batches of one-chunk sequences with c CTAs per SM for
   c = 1 .. 5 (132 c chunk-heads at most): with one CTA per SM its time is one CTA's latency
   for a chunk-head (plus the launch); at five, the throughput the two-stage prefill gets.
   A fused kernel's producer warpgroup has to produce a chunk within the time stage 2 spends
   on one.
2. Stage 2 (main, v_split 1) and FlashInfer's chunk_gated_delta_rule on sequences of L tokens,
   as many as give one CTA per SM or fewer (sequences x v-heads <= SMs; FlashInfer's fused
   route, no context parallelism there): the slope over L is the cost of one chunk on the
   chain, and FlashInfer's is what its fused kernel spends per chunk, producer work included.

q/k in fp16 (what the engine layers hand over), bf16 v, fp32 states, the bench's gates.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _slope(pts):
    """Least-squares (intercept, slope) of y over x."""
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return my - b * mx, b


def main() -> None:
    import torch

    from qla_serve.bench import prefill as B
    from qla_serve.kernels.hopper import prefill_api

    p = argparse.ArgumentParser()
    p.add_argument("--heads", default="2/8")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    hk, hv = (int(x) for x in args.heads.split("/"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []

    def data16(lens):
        q, k, v, g, beta, h0 = B._inputs(lens, hk, hv)
        return q.half(), k.half(), v, g, beta, h0

    prep_heads = prefill_api.PREP_HEADS
    prefill_api.PREP_HEADS = 1  # one v-head per CTA: a CTA is one chunk-head
    try:
        for per_sm in (1, 2, 3, 4, 5):
            nseq = per_sm * sms // hv
            lens = [64] * nseq
            fn, *_ = B._qla_fn(lens, hk, hv, data16(lens), 1, stages="prep")
            us = B._kernel_timeline(fn, reps=10, graph_calls=5)[0]["us"]
            ctas = nseq * hv
            rows.append({"stage": "prep", "ctas": ctas, "ctas_per_sm": ctas / sms, "us": us,
                         "us_per_sm_chunk_head": us * sms / ctas})
            print(json.dumps(rows[-1]), flush=True)
    finally:  # stage 2's rows below take the rule's (or QLA_SERVE_PREP_HEADS's) choice again
        prefill_api.PREP_HEADS = prep_heads

    nseq = sms // hv
    lengths = [int(x) for x in args.lengths.split(",")]
    impls = ["main"] + ([] if args.no_flashinfer else ["flashinfer"])
    for impl in impls:
        pts = []
        for L in lengths:
            lens = [L] * nseq
            data = data16(lens)
            if impl == "main":
                fn, *_ = B._qla_fn(lens, hk, hv, data, 1, stages="main")
                us = B._kernel_timeline(fn, reps=10, graph_calls=5)[0]["us"]
            else:
                q, k, v, g, beta, h0 = data
                fn, _ = B._flashinfer_fn(lens, (q.bfloat16(), k.bfloat16(), v, g, beta, h0))
                us = B._gpu_time_ms(fn, reps=10, graph_calls=5)[0] * 1e3
            pts.append((L // 64, us))
            rows.append({"stage": impl, "seqs": nseq, "ctas": nseq * hv, "chunks": L // 64, "us": us})
            print(json.dumps(rows[-1]), flush=True)
        a, b = _slope(pts)
        rows.append({"stage": impl, "fit": "us = a + b chunks", "a": a, "b_us_per_chunk": b})
        print(f"{impl}: {a:.1f} us + {b:.3f} us per chunk (one CTA per SM or fewer)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
