"""One of qla_serve's module switches, each of its values side by side in one process: GPU us
per GDN layer call as `qla-serve bench layer` times it (the same cases, slot sets and timing:
a CUDA-graph replay per decode row, bench prefill's graph of several calls per prefill row).
Two rounds, the values interleaved, so that drift shows.

    # the prefill's launch chain as programmatic dependent launches, off / on
    python benchmarks/layer_ab.py --switch prefill_api.CP_PDL=False,True \
        --heads 2/8,16/64 --rows 1x32768,16x512,4x8192 --states fp32
    # the decode as the conv's programmatic dependent, never / always
    python benchmarks/layer_ab.py --switch gdn_layer.DECODE_AFTER_CONV_MAX_ROWS=0,1073741824 \
        --heads 2/8,16/32 --rows d1,d32,d256 --states fp32,bf16
    # the conv prefill's walk length: the rule against fixed walks (non-powers of two included)
    python benchmarks/layer_ab.py --switch conv.WALK_STEPS=None,5,6,7 \
        --heads 2/8,4/16 --rows 1x8192,16x512 --states fp32
    # the decode's default tiles against one forced tile (TILE_OVERRIDE: every decode and verify)
    python benchmarks/layer_ab.py --switch "decode.TILE_OVERRIDE=None,'bv32'" \
        --heads 16/32 --rows d64,d256 --states fp32

A switch is MODULE.NAME with MODULE one of SWITCH_MODULES; its values Python literals. Every
value's launches are resolved apart (the plans' kernel caches key on the switches they read).
"""

import argparse
import ast
import importlib
from unittest import mock

import torch

from qla_serve.bench import decode as bdec
from qla_serve.bench import layer as L
from qla_serve.bench import prefill as bpre

STATE = {"fp32": torch.float32, "bf16": torch.bfloat16}
SWITCH_MODULES = {
    "prefill_api": "qla_serve.kernels.hopper.prefill_api",
    "conv": "qla_serve.kernels.hopper.conv",
    "gdn_layer": "qla_serve.backends.gdn_layer",
    "decode": "qla_serve.kernels.hopper.decode",
}


def parse_switch(text: str):
    """'MODULE.NAME=V1,V2' -> (module, name, [values])."""
    target, _, values = text.partition("=")
    mod, _, name = target.partition(".")
    if mod not in SWITCH_MODULES or not name or not values:
        raise argparse.ArgumentTypeError(f"--switch: expected MODULE.NAME=V1,V2 with MODULE one of "
                                         f"{sorted(SWITCH_MODULES)}, got {text!r}")
    module = importlib.import_module(SWITCH_MODULES[mod])
    if not hasattr(module, name):
        raise argparse.ArgumentTypeError(f"--switch: {SWITCH_MODULES[mod]} has no {name}")
    return module, name, [ast.literal_eval(v) for v in values.split(",")]


def layer_us(case, nsets, reps, graph_calls):
    """GPU us per layer call, timed as bench layer's time_impl times the qla column."""
    fns = [L.qla_call(case, L.qla_step(case, i)) for i in range(nsets)]
    fns[0]()
    torch.cuda.synchronize()
    if case.row.decode_only:
        return L._graph_us(fns, reps)["gpu_us"]
    ms, _, _ = bpre._gpu_time_ms(fns[0], reps, graph_calls)
    return ms * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", type=parse_switch, required=True)
    ap.add_argument("--heads", default="2/8")
    ap.add_argument("--rows", default="1x32768")
    ap.add_argument("--states", default="fp32")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--graph-calls", type=int, default=5)
    args = ap.parse_args()
    module, name, values = args.switch
    for hk, hv in L.parse_heads(args.heads):
        for text in args.rows.split(","):
            row = L.parse_row(text)
            for st in args.states.split(","):
                nsets = L.slot_sets_for(row, hv, STATE[st], bdec.L2_FLUSH_BYTES)
                case = L.LayerCase(hk, hv, row, STATE[st], "cuda", nsets=nsets)
                times = {i: [] for i in range(len(values))}
                for _ in range(2):
                    for i, value in enumerate(values):
                        with mock.patch.object(module, name, value):
                            times[i].append(layer_us(case, nsets, args.reps, args.graph_calls))
                cols = "  ".join(f"{name}={v!r} {t[0]:.2f}/{t[1]:.2f}" for v, t in zip(values, times.values()))
                print(f"{hk}/{hv} {text:>8} {st}: {cols}", flush=True)


if __name__ == "__main__":
    main()
