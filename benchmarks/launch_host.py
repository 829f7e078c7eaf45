"""Host (CPU) time of a Hopper prefill call, launch by launch: raw launch functions vs TileLang's
adapter callable.

    python benchmarks/launch_host.py        # on the H200, with the TileLang kernels cached

For each case, the kernel-module call (prefill_launch.prefill, plan built once) is timed with the
kernels launched through their raw host functions (raw_launch.py, the default) and through
TileLang's adapter callable (``JITKernel.torch_function``, the path before raw_launch.py), and
raw with the TMA descriptor memo (host_cache.py) switched off. Each
launch is also timed alone (a perf_counter pair around it, so ~0.1 us of the figure is the
timer). Enqueue time only: no synchronisation inside a timed loop (the queue is drained every
100 calls). Median of 7 rounds. A benchmark, not a test.
"""

import statistics
import time

import torch

import qla_serve
from qla_serve.kernels.hopper import host_cache
from qla_serve.kernels.hopper import prefill_api as P
from qla_serve.kernels.hopper import prefill_launch as PL
from qla_serve.plan import force_plan

CASES = {  # name: (lengths, Hk, Hv, forced (strategy, v_split, segment_chunks) or None)
    "2/8 1x8192 cp/vs2/L16": ([8192], 2, 8, ("cp", 2, 16)),
    "2/8 1x32768 cp/vs1/L32": ([32768], 2, 8, ("cp", 1, 32)),
    "2/8 64x512 plain": ([512] * 64, 2, 8, ("plain", 1, 0)),
}


def _inputs(lens, hk, hv, dev):
    gen = torch.Generator(device=dev).manual_seed(0)
    T = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(T, hk, 128, device=dev, generator=gen), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(T, hk, 128, device=dev, generator=gen), dim=-1).bfloat16()
    v = torch.randn(T, hv, 128, device=dev, generator=gen).bfloat16()
    g = -torch.rand(T, hv, device=dev, generator=gen) * 0.1
    g[:, : hv // 4] = 0  # a quarter of the heads do not decay: the exact path (maps, scan)
    beta = torch.rand(T, hv, device=dev, generator=gen)
    pool = torch.zeros(len(lens), hv, 128, 128, device=dev)
    slots = torch.arange(len(lens), dtype=torch.int32, device=dev)
    return q, k, v, g, beta, pool, slots, torch.empty_like(v)


class _Timed:
    """A launch function that adds its own CPU time to a per-kernel total."""

    def __init__(self, fn, name, totals):
        self.fn, self.name, self.totals = fn, name, totals

    def __call__(self, *args):
        t = time.perf_counter()
        self.fn(*args)
        self.totals[self.name] = self.totals.get(self.name, 0.0) + time.perf_counter() - t


def _measure(case, adapter: bool, per_launch: bool):
    lens, hk, hv, forced = CASES[case]
    dev = torch.device("cuda")
    q, k, v, g, beta, pool, slots, out = _inputs(lens, hk, hv, dev)
    plan = qla_serve.plan_prefill(lens, hv, hk, device=dev)
    if forced:
        plan = force_plan(plan, *forced)
    totals = {}
    real_fn = PL._fn

    def fn_for(variant, target):
        kern = P.build(variant, target)
        fn = kern.torch_function if adapter else real_fn(variant, target)
        return _Timed(fn, variant["name"], totals) if per_launch else fn

    PL._fns.clear()
    PL._fn = fn_for
    try:
        def call():
            PL.prefill(q, k, v, g, beta, pool, slots, plan, has_initial_state=None, scale=None, out=out)
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        totals.clear()
        rounds, calls = [], 0
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(100):
                call()
            rounds.append((time.perf_counter() - t) / 100 * 1e6)
            calls += 100
            torch.cuda.synchronize()
    finally:
        PL._fn = real_fn
        PL._fns.clear()
    return statistics.median(rounds), {name: s / calls * 1e6 for name, s in totals.items()}


PATHS = {  # launch path: (TileLang's adapter callable?, TMA descriptor memo on?)
    "raw": (False, True),
    "raw no memo": (False, False),
    "adapter": (True, True),
}


def main() -> None:
    print(f"{'case':<26} {'launch path':<12} {'us per call':>11}  per launch (us, timed alone)")
    memo = host_cache.install() == "installed"
    for case in CASES:
        for path, (adapter, memo_on) in PATHS.items():
            if not memo and path == "raw":     # without the memo it is the "raw no memo" row
                continue
            if memo:
                host_cache.set_enabled(memo_on)
            whole, _ = _measure(case, adapter, per_launch=False)
            _, launches = _measure(case, adapter, per_launch=True)
            parts = ", ".join(f"{name.replace('gdn_prefill_', '')} {us:.1f}" for name, us in launches.items())
            print(f"{case:<26} {path:<12} {whole:11.1f}  {parts}")
    if memo:
        host_cache.set_enabled(True)
        print(f"memo: {host_cache.stats()}")


if __name__ == "__main__":
    main()
