"""The prefill layer's preamble against the layer issue's target: GPU us per layer call of the whole
layer (backends/gdn_layer.gdn_layer_forward, as `qla-serve bench layer` times it), of the layer
with its core (gdn_prefill) left out, and of the core alone on the layer's own buffers (the
preamble left out, its outputs from the call before), in one process, interleaved, two rounds.

    python benchmarks/layer_preamble.py --heads 2/8 --rows 1x32768,4x8192,16x512,mixed --silu-forms tanh,ex2
    # conv_prefill's forms (conv.PREFILL_LANE_CHANNELS 8, 4 or auto, "ro": conv.PREFILL_ROW_OFFSETS)
    python benchmarks/layer_preamble.py --heads 2/8,4/16 --rows 1x8192,16x512,mixed --conv-forms 8,4,8ro,4ro
    # "ef": conv.PREFILL_LOAD_HINT = "evict_first" (the row-offsets form's reads under L2::evict_first)
    python benchmarks/layer_preamble.py --heads 2/8,4/16 --rows 1x8192,16x512,mixed --conv-forms autoro,autoroef

The target (issue 24): layer - core <= 1.25 x the preamble's memory floor, the bytes it must
move (x read; q, k, v, g, beta written; a, b read) at 4.2 TB/s. A benchmark, not a test.
"""

import argparse
import contextlib
from unittest import mock

import torch

import qla_serve
from qla_serve import layer_ops
from qla_serve.backends import gdn_layer
from qla_serve.bench import layer as L
from qla_serve.bench import prefill as bpre
from qla_serve.kernels.hopper import conv

COPY_BYTES_PER_US = 4.2e6   # the H200's copy bandwidth, 4.2 TB/s


def floor_us(case) -> float:
    """The preamble's memory floor: what it reads and writes at COPY_BYTES_PER_US."""
    T, io = case.row.tokens, case.mixed_qkv.element_size()
    hk, hv, hd = case.hk, case.hv, 128
    moved = T * (case.dim * io + 2 * hk * hd * 2 + hv * hd * io + 2 * hv * 4 + 2 * hv * case.a.element_size())
    return moved / COPY_BYTES_PER_US


def timed(fn, reps, graph_calls, skip=None) -> float:
    """GPU us per call (bench prefill's graph timing), with ``skip`` ("gdn_prefill": the core, or
    "gdn_layer_prefill_inputs": the preamble) a no-op while the graph is captured. Without the
    launch replay (graph replays: the same GPU time), which would replay a skipped op's
    launches recorded by an earlier call of the step."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(gdn_layer, "LAUNCH_REPLAY", False))
        if skip is not None:
            owner = qla_serve if skip == "gdn_prefill" else layer_ops
            stack.enter_context(mock.patch.object(owner, skip, lambda *a, **k: None))
        ms, how, _ = bpre._gpu_time_ms(fn, reps, graph_calls)
    assert how == "graph", how
    return ms * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="2/8")
    ap.add_argument("--rows", default="1x32768,4x8192,16x512,mixed")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--graph-calls", type=int, default=4)
    ap.add_argument("--silu-forms", default=conv.SILU_FORM, help="conv.SILU_FORM values, each a pass")
    ap.add_argument("--conv-forms", default=f"{conv.PREFILL_LANE_CHANNELS}{'ro' if conv.PREFILL_ROW_OFFSETS else ''}"
                                            f"{'ef' if conv.prefill_load_hint(conv.PREFILL_ROW_OFFSETS) else ''}",
                    help="conv_prefill forms, each a pass: conv.PREFILL_LANE_CHANNELS (8, 4 or auto), 'ro' "
                         "appended for conv.PREFILL_ROW_OFFSETS, then 'ef' for conv.PREFILL_LOAD_HINT = "
                         "'evict_first', else None (e.g. 8,4,8ro,4ro,autoro,autoroef)")
    args = ap.parse_args()
    points = [(f, c, hk, hv, t) for f in args.silu_forms.split(",")
              for c in args.conv_forms.split(",") for hk, hv in L.parse_heads(args.heads)
              for t in args.rows.split(",")]
    for form, cform, hk, hv, text in points:
        conv.SILU_FORM = form
        conv.PREFILL_LOAD_HINT = "evict_first" if cform.endswith("ef") else None
        rform = cform.removesuffix("ef")
        lanes = rform.removesuffix("ro")
        conv.PREFILL_LANE_CHANNELS = lanes if lanes == "auto" else int(lanes)
        conv.PREFILL_ROW_OFFSETS = rform.endswith("ro")
        case = L.LayerCase(hk, hv, L.parse_row(text), torch.float32, "cuda")
        fn = L.qla_call(case, L.qla_step(case, 0))
        fn()
        torch.cuda.synchronize()
        got = {"layer": [], "no core": [], "core": []}
        for _ in range(2):
            got["layer"].append(timed(fn, args.reps, args.graph_calls))
            got["no core"].append(timed(fn, args.reps, args.graph_calls, skip="gdn_prefill"))
            got["core"].append(timed(fn, args.reps, args.graph_calls, skip="gdn_layer_prefill_inputs"))
        layer, core = min(got["layer"]), min(got["core"])
        fl = floor_us(case)
        cells = "  ".join(f"{k} {v[0]:.1f}/{v[1]:.1f}" for k, v in got.items())
        print(f"{form:>4} {cform:>3} {hk}/{hv} {text:>8}: {cells}  layer-core {layer - core:.1f} "
              f"(target 1.25 x floor {1.25 * fl:.1f}; floor {fl:.1f})", flush=True)


if __name__ == "__main__":
    main()
