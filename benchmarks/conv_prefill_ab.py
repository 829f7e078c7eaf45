"""conv_prefill forms side by side (GPU time of the kernel, torch profiler), each checked
against the first form on the same inputs and caches: bit-for-bit, or where it differs the
largest relative L2 difference of its outputs (q, k, v, g, beta, conv state).

    python benchmarks/conv_prefill_ab.py --heads 2/8,16/64 --rows 1x32768,16x512,4x8192 \
        --forms 3:auto:fast,3:auto,3:8:fast,4:auto:fast,3:auto:fast+ex2

A form is ``stages:walk[:flags]``: conv.STAGES (the cp.async ring depth), the steps per half-warp
walk (a number: conv.WALK_STEPS, or "auto": conv.prefill_launch_form's choice), and flags joined
by "+": "fast" for conv.FAST_STEPS, "ex2" for conv.SILU_FORM = "ex2" (else "tanh"), "lc4" for
conv.PREFILL_LANE_CHANNELS = 4 and "lcauto" for its "auto" rule (else 8), "ro" for
conv.PREFILL_ROW_OFFSETS, "ef" for conv.PREFILL_LOAD_HINT = "evict_first" (else None; it applies
with "ro" only), "nohalve" for conv.HALVE_WALKS = False (3:auto:fast+lcauto+ro+ef is the default
form). Each form's q, k, v are also set against the torch reference on the same inputs
(reference_conv.conv_prefill: fp32 math, torch's SiLU), as "ref" relative L2 errors. A
benchmark, not a test; two rounds, forms interleaved, so that drift shows. (The gate forms compared at
96477cc were switches of this script then: data/conv_gate_blocks_ab_h200.txt.)
"""

import argparse

import torch

from qla_serve import layer_ops
from qla_serve.bench import layer as L
from qla_serve.kernels import reference_conv
from qla_serve.kernels.reference import rel_l2
from qla_serve.kernels.hopper import conv


def run_form(case, step, stages, walk, flags=""):
    flags = set(flags.split("+"))
    conv.STAGES, conv.FAST_STEPS = int(stages), "fast" in flags
    conv.SILU_FORM = "ex2" if "ex2" in flags else "tanh"
    conv.PREFILL_LANE_CHANNELS = 4 if "lc4" in flags else "auto" if "lcauto" in flags else 8
    conv.PREFILL_ROW_OFFSETS = "ro" in flags
    conv.PREFILL_LOAD_HINT = "evict_first" if "ef" in flags else None
    conv.WALK_STEPS = None if walk == "auto" else int(walk)   # (a set walk is never halved)
    conv.HALVE_WALKS = "nohalve" not in flags
    x, a, b = case.mixed_qkv[: case.row.tokens], case.a[: case.row.tokens], case.b[: case.row.tokens]
    plan = step.prefill_plan
    return lambda: layer_ops.gdn_layer_prefill_inputs(
        x, a, b, case.conv_state, step.ids("prefill"), plan, conv_weight=case.conv_weight,
        conv_bias=case.conv_bias, has_initial_state=step.prefill_has_initial_state, A_log=case.A_log,
        dt_bias=case.dt_bias, num_k_heads=case.hk, qk_dtype=torch.float16)


def reference_qkv(case, step):
    """q, k, v of reference_conv.conv_prefill on the case's inputs and a copy of its conv cache."""
    tokens = case.row.tokens
    x = case.mixed_qkv[:tokens]
    plan = step.prefill_plan
    out = layer_ops._prefill_outputs(tokens, case.hk, case.hv, torch.float16, x.dtype, x.device)
    reference_conv.conv_prefill(x, case.conv_state.clone(), case.conv_weight, case.conv_bias, step.ids("prefill"),
                                step.prefill_has_initial_state.view(torch.int8), plan.cu_seqlens,
                                case.a[:tokens], case.b[:tokens], case.A_log, case.dt_bias, activation="silu",
                                q_out=out[0], k_out=out[1], v_out=out[2], g_out=out[3], beta_out=out[4])
    return out[:3]


def kernel_us(fn, calls):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    t = sum(e.device_time_total for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and "conv_prefill_kernel" in e.name)
    return t / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="2/8,16/64")
    ap.add_argument("--rows", default="1x32768,16x512,4x8192")
    ap.add_argument("--forms", default="3:auto:fast,3:auto")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    forms = [tuple(f.split(":")) for f in args.forms.split(",")]
    for hk, hv in L.parse_heads(args.heads):
        for text in args.rows.split(","):
            case = L.LayerCase(hk, hv, L.parse_row(text), torch.float32, "cuda")
            step = L.qla_step(case, 0)
            snap = case.snapshot()
            want = None
            same, ref_err = {}, {}
            case.restore(snap)
            ref = reference_qkv(case, step)
            for f in forms:                       # exactness: every form from the same caches
                case.restore(snap)
                got = [t.clone() for t in run_form(case, step, *f)()] + [case.conv_state.clone()]
                if want is None:
                    want = got
                same[f] = max((0.0 if torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0)) else rel_l2(g, w))
                              for g, w in zip(got, want))
                ref_err[f] = "/".join(f"{rel_l2(g, r):.1e}" for g, r in zip(got[:3], ref))
            times = {f: [] for f in forms}
            for _ in range(2):
                for f in forms:
                    times[f].append(kernel_us(run_form(case, step, *f), args.calls))
            case.restore(snap)
            line = "  ".join(f"{':'.join(f)} {t[0]:.1f}/{t[1]:.1f}{f' (rel {same[f]:.1e})' if same[f] else ''}"
                             f" [ref q/k/v {ref_err[f]}]" for f, t in times.items())
            print(f"{hk}/{hv} {text:>8}: {line}", flush=True)


if __name__ == "__main__":
    main()
