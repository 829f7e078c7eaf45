"""Where one GDN layer call's host time goes (the adapters' `gdn_layer_forward`, eager).

    python benchmarks/layer_host.py [--rows 2/8:d1,2/8:16x512,...] [--calls 300] [--top 25] [--first-layer]
    python benchmarks/layer_host.py --memo-ab     # host time with / without the TMA descriptor memo
    python benchmarks/layer_host.py --switch conv.WINDOW_CTAS=False,True   # a module switch's values
    python benchmarks/layer_host.py --step [--switch gdn_layer.LAUNCH_REPLAY=False,True]   # whole steps

Engines run prefill and mixed steps eagerly, so every GDN layer of such a step pays this on the
CPU. For each row: the issue time of one call from an idle GPU (as `bench layer`'s "host issue
us") and of back-to-back calls, the GPU time per call (events), then a cProfile of the
back-to-back calls: the functions with the most own time. ``--first-layer``: every call as a
step's first GDN layer (its metadata not yet checked this step: the ops' checks run, from their
process-wide tables where those hold the metadata, and its launches are recorded); default: a step's later layers (bench
layer's qla_call: successive calls go through 36 layers' views, so that from the third call
on they replay the step's recorded launches, backends/launch_replay.py). ``--step``: instead,
the host time of whole steps of 36 layer calls, each on a fresh step plan (its first layer's
checks, the two recording calls and the replays), per step and per layer call.
"""

import argparse
import contextlib
import cProfile
import functools
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import layer_ab  # noqa: E402  (benchmarks/: its --switch parser)

DEFAULT_ROWS = "2/8:d1,2/8:d256,2/8:16x512,2/8:1x32768,2/8:d32+4x512,16/64:4x8192"


def main() -> None:
    import torch

    from qla_serve.bench import layer as L

    p = argparse.ArgumentParser()
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--first-layer", action="store_true")
    p.add_argument("--memo-ab", action="store_true",
                   help="only the host issue time, TMA descriptor memo (host_cache.py) on / off, "
                        "alternating rounds; no profile")
    p.add_argument("--step", action="store_true",
                   help="host time of whole steps (L.STEP_LAYERS layer calls on a fresh step plan each)")
    p.add_argument("--switch", type=layer_ab.parse_switch, default=None,
                   help="MODULE.NAME=V1,V2 (as benchmarks/layer_ab.py): only the host issue time per "
                        "value, alternating rounds; no profile")
    args = p.parse_args()
    for spec in args.rows.split(","):
        heads, row_text = spec.split(":")
        hk, hv = (int(x) for x in heads.split("/"))
        row = L.parse_row(row_text)
        case = L.LayerCase(hk, hv, row, torch.float32, "cuda", nsets=1)
        if args.step:
            _steps(spec, case, args.switch)
            continue
        step = L.qla_step(case, 0)
        call = L.qla_call(case, step)
        if args.first_layer:
            later = call

            def call():   # a fresh step's first layer: its checks, and its launches recorded
                step._checked.clear()
                step._replays = type(step._replays)()
                later()
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        if args.memo_ab:
            _memo_ab(spec, call)
            continue
        if args.switch:
            _switch_ab(spec, call, *args.switch)
            continue
        idle_us = _issue_us(call)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        t1 = time.perf_counter()
        b.record()
        b.synchronize()
        gpu_us = a.elapsed_time(b) * 1e3 / args.calls
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call()
        prof.disable()
        torch.cuda.synchronize()
        print(f"== {spec}: host issue us (idle GPU, median) {idle_us:.1f}; "
              f"back-to-back {(t1 - t0) * 1e6 / args.calls:.1f} us per call; GPU-bound wall {gpu_us:.1f} us "
              f"per call", flush=True)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[-6000:], flush=True)


def _issue_us(call, n: int = 50) -> float:
    """Median host time of one call issued onto an idle GPU."""
    import torch

    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(out) * 1e6


def _step_us(case, rounds: int = 20) -> tuple[list[float], object]:
    """Host us of whole steps: L.STEP_LAYERS layer calls, each step on a fresh step plan (made,
    with its slot ids, before the clock starts), issued onto an idle GPU; and the last step's
    launch replays (backends/launch_replay.LaunchReplays: how many layers replayed, or why not)."""
    import torch

    from qla_serve.bench import layer as L

    out = []
    for _ in range(rounds):
        step = L.qla_step(case, 0)
        call = L.qla_call(case, step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(L.STEP_LAYERS):
            call()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out, step._replays


def _steps(spec: str, case, switch) -> None:
    from qla_serve.bench import layer as L

    _step_us(case, 2)    # first calls: kernel loads
    settings = [("", contextlib.nullcontext)] if switch is None else _switch_settings(*switch)
    times = {label: [] for label, _ in settings}
    replays = {}
    for _ in range(3):
        for label, setting in settings:
            with setting():
                us, r = _step_us(case)
                times[label].append(statistics.median(us))
                replays[label] = f"{r.replayed} replayed" + (f", refused: {sorted(set(r.refused.values()))}" if r.refused else "")
    cols = ", ".join(f"{label + ' ' if label else ''}{min(t):.0f} us a step, {min(t) / L.STEP_LAYERS:.1f} per "
                     f"layer call (rounds {', '.join(f'{x:.0f}' for x in t)}; {replays[label]})"
                     for label, t in times.items())
    print(f"== {spec}: host time of steps of {L.STEP_LAYERS} layer calls: {cols}", flush=True)


def _alternate(spec: str, call, settings) -> None:
    """Host issue time per setting, 4 rounds with the settings alternating, so that the lent
    host's drift shows in every column. settings: (label, context manager factory) pairs."""
    times = {label: [] for label, _ in settings}
    for _ in range(4):
        for label, setting in settings:
            with setting():
                call()
                times[label].append(_issue_us(call))
    cols = ", ".join(f"{label} {statistics.median(t):.1f} ({', '.join(f'{x:.1f}' for x in t)})"
                     for label, t in times.items())
    print(f"== {spec}: host issue us per call (idle GPU, medians of 4 rounds) {cols}", flush=True)


def _switch_settings(module, name, values) -> list:
    """(label, context manager factory) per value of a module switch (layer_ab.parse_switch's)."""
    from unittest import mock

    return [(f"{name}={v!r}", functools.partial(mock.patch.object, module, name, v)) for v in values]


def _switch_ab(spec: str, call, module, name, values) -> None:
    _alternate(spec, call, _switch_settings(module, name, values))


def _memo_ab(spec: str, call) -> None:
    from qla_serve.kernels.hopper import host_cache

    if host_cache.install() != "installed":
        print(f"== {spec}: no TMA descriptor memo ({host_cache.install()})")
        return

    @contextlib.contextmanager
    def memo(flag):
        host_cache.set_enabled(flag)
        try:
            yield
        finally:
            host_cache.set_enabled(True)
    _alternate(spec, call, [("memo on", lambda: memo(True)), ("memo off", lambda: memo(False))])


if __name__ == "__main__":
    main()
