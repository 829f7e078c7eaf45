"""One GDN layer call, kernel by kernel: where the layer's GPU time goes (torch profiler), and
where the step plan's host time goes (cProfile), for the rows of `qla-serve bench layer`.

    python benchmarks/layer_profile.py --heads 2/8 --rows 1x32768,d1 [--state fp32] [--calls 20]

A benchmark, not a test. Prints, per row, each kernel's mean GPU us per layer call and its
share, then the step plan's top host functions. A kernel launched as its predecessor's
programmatic dependent (the conv-state write-back, the small-batch decode) starts before that
one ends: its duration here includes the wait, so the kernels' sum exceeds the layer's GPU time
(`qla-serve bench layer`'s graph replay is the layer's figure).
"""

import argparse
import cProfile
import collections
import io
import pstats

import torch

from qla_serve.bench import layer as L


def kernels(case, step, calls: int) -> list[tuple[str, float]]:
    fn = L.qla_call(case, step)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:70]] += e.device_time_total / calls if hasattr(e, "device_time_total") else e.cuda_time_total / calls
    return sorted(per.items(), key=lambda kv: -kv[1])


def plan_profile(case, reps: int = 200) -> str:
    for _ in range(20):
        L.qla_step(case, 0)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        L.qla_step(case, 0)
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(12)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="2/8")
    ap.add_argument("--rows", default="1x32768,1x8192,d1,d256")
    ap.add_argument("--state", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--plan", action="store_true", help="also cProfile the step plan")
    args = ap.parse_args()
    state = torch.float32 if args.state == "fp32" else torch.bfloat16
    for hk, hv in L.parse_heads(args.heads):
        for text in args.rows.split(","):
            row = L.parse_row(text)
            case = L.LayerCase(hk, hv, row, state, "cuda")
            step = L.qla_step(case, 0)
            ks = kernels(case, step, args.calls)
            total = sum(t for _, t in ks)
            print(f"== {hk}/{hv} {text} {args.state}: {total:.1f} us of kernels per layer call")
            for name, t in ks:
                print(f"  {t:8.2f} us {100 * t / total:5.1f}%  {name}")
            if args.plan and row.prefill_lens:
                print(plan_profile(case))


if __name__ == "__main__":
    main()
