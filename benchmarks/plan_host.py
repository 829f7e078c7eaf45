"""Host time of qla_serve.plan_prefill (target: <= 100 us for 256 sequences).

    python benchmarks/plan_host.py [--device cuda]

A benchmark, not a test: prints the median over many calls for a few batch shapes.
"""

import argparse
import statistics
import time

import torch

from qla_serve.plan import plan_prefill

SHAPES = {
    "256 x mixed (decode-heavy step)": ([1] * 200 + [512] * 56, 8, 2),
    "256 x 512": ([512] * 256, 8, 2),
    "64 x 512": ([512] * 64, 8, 2),
    "1 x 32768 (TP8 long prompt)": ([32768], 8, 2),
    "4 x 8192, 16/64 heads": ([8192] * 4, 64, 16),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    for name, (lens, hv, hk) in SHAPES.items():
        kw = dict(device=args.device, sm_count=132, arch="sm90", supported_strategies={"plain", "vsplit", "cp"})
        for _ in range(50):
            plan_prefill(lens, hv, hk, **kw)
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            plan = plan_prefill(lens, hv, hk, **kw)
            times.append(time.perf_counter() - t0)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        print(f"{name:<34} {statistics.median(times) * 1e6:8.1f} us median, {min(times) * 1e6:6.1f} us min  -> {plan.strategy}, "
              f"v_split {plan.v_split}, {plan.num_segments} segments")


if __name__ == "__main__":
    main()
