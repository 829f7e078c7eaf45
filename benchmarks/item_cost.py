"""What a stage-2 work item costs besides its chunks: stage 2's GPU time on batches of equal
sequences, same token count (32768 tokens; 2/8 heads unless --heads), forced plain (v_split 1) and vsplit
(v_split 2), against the chunks per sequence. With one CTA per SM, a launch of W = items / SMs
waves of n-chunk items takes about W (a + b n): a is a work item's fixed cost (state in and out,
the first tiles' latency, the last O store), b a chunk's.

    python benchmarks/item_cost.py [--heads 2/8] [--json F]     # on the H200

Then the state's share: the 512- and 2048-token launches again with the pool neither read nor
written (slot ids -1), and written only (has_initial_state False).
"""

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch

    from qla_serve import ops
    from qla_serve.bench import prefill as B

    p = argparse.ArgumentParser()
    p.add_argument("--heads", default="2/8")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    hk, hv = (int(x) for x in args.heads.split("/"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for L in (128, 256, 512, 1024, 2048, 4096):
        lens = [L] * (32768 // L)
        data = B._inputs(lens, hk, hv)
        for vs in (1, 2):
            fn, *_ = B._qla_fn(lens, hk, hv, data, vs, stages="main")
            us = B._kernel_timeline(fn, reps=10, graph_calls=5)[0]["us"]
            items = len(lens) * hv * vs
            waves = items / sms
            rows.append({"seq_len": L, "chunks": L // 64, "v_split": vs, "items": items, "waves": waves,
                         "main_us": us, "us_per_wave": us / math.ceil(waves)})
            print(json.dumps(rows[-1]), flush=True)
    # The state's share of the fixed cost: the same launches with the pool neither read nor
    # written (slot ids -1), and written only (has_initial_state False).
    mod = ops.kernel_module(ops._arch_of(0))
    for L in (512, 2048):
        lens = [L] * (32768 // L)
        data = B._inputs(lens, hk, hv)
        q, k, v, g, beta, _ = data
        for vs in (1, 2):
            _, out, pool, plan = B._qla_fn(lens, hk, hv, data, vs, stages="main")
            n = len(lens)
            for state, slots, init in (
                    ("read+write", torch.arange(n, dtype=torch.int32, device="cuda"), None),
                    ("write only", torch.arange(n, dtype=torch.int32, device="cuda"),
                     torch.zeros(n, dtype=torch.bool, device="cuda")),
                    ("none", torch.full((n,), -1, dtype=torch.int32, device="cuda"), None)):
                def fn(slots=slots, init=init, plan=plan, pool=pool, out=out):
                    mod.prefill(q, k, v, g, beta, pool, slots, plan, has_initial_state=init, scale=128**-0.5,
                                out=out, _stages="main")
                us = B._kernel_timeline(fn, reps=10, graph_calls=5)[0]["us"]
                rows.append({"seq_len": L, "chunks": L // 64, "v_split": vs, "state": state, "main_us": us})
                print(json.dumps(rows[-1]), flush=True)
    rows_fit = [r for r in rows if "state" not in r]
    for vs in (1, 2):  # least squares of us_per_wave = a + b n over the rows of this split
        pts = [(r["chunks"], r["us_per_wave"]) for r in rows_fit if r["v_split"] == vs]
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        print(f"v_split {vs}: per wave {my - b * mx:.1f} us + {b:.2f} us per chunk")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
