"""Where the step plan's host time goes: cProfile of gdn_layer.make_step_plan on one step shape
(step_plan_host.py's shapes), the top functions by own time, plus the planner's parts timed alone.

    python benchmarks/step_plan_profile.py --device cuda --shape "prefill 1 x 32768"
"""

import argparse
import cProfile
import pstats

import torch

import step_plan_host as S
from qla_serve import plan as P
from qla_serve.backends.gdn_layer import make_step_plan
from qla_serve.bench.layer import median_us
from qla_serve.costmodel import load_cost_model


def _median_us(fn, n=2000):
    for _ in range(50):
        fn()
    return median_us(fn, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", action="append")
    args = ap.parse_args()
    shapes = dict(S._shapes())
    for name in args.shape or ["prefill 1 x 32768", "prefill 256 x 1024 (262144 tokens)"]:
        kw = S._args(shapes[name], args.device)
        hk, hv = shapes[name].get("heads", (2, 8))
        lens = kw["prefill_lens"]
        chunks = [-(-n // P.CHUNK) for n in lens]
        device = torch.device(args.device)
        model = load_cost_model("sm90")
        sup = P.supported_prefill_strategies(device)
        choice = P._choose(model, chunks, hv, 132, "auto", sup)
        parts = {
            "make_step_plan": lambda: make_step_plan(**kw),
            "plan_prefill": lambda: P.plan_prefill(lens, hv, hk, device=device),
            "plan_prefill (cpu)": lambda: P.plan_prefill(lens, hv, hk, device="cpu"),
            "_choose": lambda: P._choose(model, chunks, hv, 132, "auto", sup),
            "_upload": lambda: P._upload(lens, chunks, P._segment_rows(chunks, choice.segment_chunks), device),
            "_resolve_arch": lambda: P._resolve_arch(device, None, None),
            "supported_prefill_strategies": lambda: P.supported_prefill_strategies(device),
        }
        print(f"== {name} ({args.device}): {choice}")
        for part, fn in parts.items():
            print(f"  {part:<30} {_median_us(fn):8.1f} us")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            make_step_plan(**kw)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
