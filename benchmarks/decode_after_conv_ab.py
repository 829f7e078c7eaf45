"""The layer's decode step with and without the programmatic dependent launch of gdn_decode after
conv_decode (forced either way through gdn_layer.DECODE_AFTER_CONV_MAX_ROWS), side by side in one process: GPU us per layer call,
CUDA-graph replay of `qla-serve bench layer`'s decode rows (same cases, slot sets and helper).
Two rounds, the forms interleaved, so that drift shows.

    python benchmarks/decode_after_conv_ab.py --heads 2/8,16/32 --rows d1,d32,d256 --states fp32,bf16
"""

import argparse

import torch

from qla_serve.backends import gdn_layer
from qla_serve.bench import decode as bdec
from qla_serve.bench import layer as L

STATE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def graph_us(case, nsets, reps):
    steps = [L.qla_step(case, i) for i in range(nsets)]
    fns = [L.qla_call(case, st) for st in steps]
    fns[0]()
    torch.cuda.synchronize()
    return L._graph_us(fns, reps)["gpu_us"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="2/8,16/32")
    ap.add_argument("--rows", default="d1,d32,d256")
    ap.add_argument("--states", default="fp32,bf16")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    for hk, hv in L.parse_heads(args.heads):
        for text in args.rows.split(","):
            row = L.parse_row(text)
            for st in args.states.split(","):
                nsets = L.slot_sets_for(row, hv, STATE[st], bdec.L2_FLUSH_BYTES)
                case = L.LayerCase(hk, hv, row, STATE[st], "cuda", nsets=nsets)
                times = {True: [], False: []}
                default = gdn_layer.DECODE_AFTER_CONV_MAX_ROWS
                for _ in range(2):
                    for form in (False, True):
                        gdn_layer.DECODE_AFTER_CONV_MAX_ROWS = 1 << 30 if form else 0
                        times[form].append(graph_us(case, nsets, args.reps))
                gdn_layer.DECODE_AFTER_CONV_MAX_ROWS = default
                print(f"{hk}/{hv} {text:>5} {st}: plain {times[False][0]:.2f}/{times[False][1]:.2f}  "
                      f"after_conv {times[True][0]:.2f}/{times[True][1]:.2f}", flush=True)


if __name__ == "__main__":
    main()
