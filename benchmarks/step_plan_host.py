"""Host time of the engines' step plan, gdn_layer.make_step_plan (target: <= 0.2 ms for any batch
up to 256 sequences / 262144 tokens), and its scaling in tokens and in sequences.

    python benchmarks/step_plan_host.py [--device cuda] [--iters 500]

A benchmark, not a test: the median host time of one call (what vLLM's metadata builder runs
once per step), for prefill, mixed decode + prefill, decode-only and spec-decode steps. The
plan holds no per-token index: its time should not grow with the token count.
"""

import argparse
import statistics
import time

import torch

from qla_serve.backends.gdn_layer import make_step_plan


def _shapes():
    yield "prefill 1 x 32768", dict(prefill=[32768])
    yield "prefill 1 x 262144", dict(prefill=[262144])
    yield "prefill 4 x 8192, 16/64 heads", dict(prefill=[8192] * 4, heads=(16, 64))
    yield "prefill 16 x 512", dict(prefill=[512] * 16)
    yield "prefill 256 x 1024 (262144 tokens)", dict(prefill=[1024] * 256)
    yield "mixed 200 decodes + 56 x 512", dict(decodes=200, prefill=[512] * 56)
    yield "decode 256", dict(decodes=256)
    yield "spec 256 x (1+3)", dict(spec=(256, 4))
    yield "spec 8 x (1+3) + 4 x 512", dict(spec=(8, 4), prefill=[512] * 4)
    yield "spec 64 x (1+3) + 2 x 4096", dict(spec=(64, 4), prefill=[4096] * 2)


def _args(shape: dict, device):
    hk, hv = shape.get("heads", (2, 8))
    kw = dict(num_v_heads=hv, num_k_heads=hk, conv_width=4, device=device, null_slot=0)
    T = 0
    if shape.get("decodes"):
        kw["decode_slots"] = torch.arange(1, 1 + shape["decodes"], dtype=torch.int32, device=device)
        T += shape["decodes"]
    if shape.get("prefill"):
        lens = shape["prefill"]
        kw["prefill_lens"] = list(lens)
        kw["prefill_slots"] = torch.arange(300, 300 + len(lens), dtype=torch.int32, device=device)
        kw["prefill_has_initial_state"] = torch.ones(len(lens), dtype=torch.bool, device=device)
        T += sum(lens)
    if shape.get("spec"):
        n, d = shape["spec"]
        kw["spec_slots"] = torch.arange(1, 1 + n * d, dtype=torch.int32, device=device).view(n, d)
        kw["spec_cu_seqlens"] = torch.arange(0, n * d + 1, d, dtype=torch.int32, device=device)
        kw["num_accepted"] = torch.ones(n, dtype=torch.int32, device=device)
        kw["num_spec_tokens"] = n * d
        T += n * d
    kw["num_actual_tokens"] = T
    return kw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=500)
    args = ap.parse_args()
    print(f"{'step':<38} {'median us':>10} {'p90 us':>8}   (make_step_plan, {args.device})")
    for name, shape in _shapes():
        kw = _args(shape, args.device)
        for _ in range(20):
            make_step_plan(**kw)
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            make_step_plan(**kw)
            times.append((time.perf_counter() - t0) * 1e6)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.sort()
        print(f"{name:<38} {statistics.median(times):>10.1f} {times[int(0.9 * len(times))]:>8.1f}")


if __name__ == "__main__":
    main()
