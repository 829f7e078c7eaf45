"""The Python glue of one GDN layer call (`gdn_layer_forward`), every kernel launch a no-op.

    python benchmarks/layer_glue_host.py [--root DIR] [--calls 2000] [--to-launch [--no-replay]]

Runs on any machine (CPU tensors; the ops' path dispatch answers "tilelang" and launches nothing),
so a host-time change of a few microseconds shows, which the lent H200's host hides in its
run-to-run noise (30-50%: benchmarks/h200_validation.md, session 29; full record:
``git show 4e19e3d:benchmarks/h200_validation.md``). ``--to-launch``: down to
the raw launch instead, the kernel modules' host code included (variant lookup, alignment
checks, argument lists; the TileLang programs are never compiled and the launch function does
nothing: tests/kernels/launch_check.py's stand-ins), on meta-device tensors (CUDA's stand-in: no
values, so no CPU-only value checks); the calls cycle through 36 layers' tensors (Qwen3-Next's
GDN layers), as an engine's step does, so that later layers replay the launches the step
recorded (backends/launch_replay.py; ``--no-replay``: the ops' host code on every layer), and
a whole step of those 36 layer calls is timed too (its first layer's checks and the two
recording calls included). ``--root``: the checkout
whose qla_serve to import (e.g. an older commit unpacked with `git archive REV qla_serve | tar -x
-C DIR`), to compare two trees in turn. Per row (2/8 heads: one decode, 16 x 512 prefill, 32
decodes + 4 x 512): the median over ``--calls`` calls as a step's later layer (its checks passed)
and as its first layer (the checks run). The step plan and slot ids are outside the timed call.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROWS = {"d1": (1, []), "16x512": (0, [512] * 16), "d32+4x512": (32, [512] * 4)}
STEP_LAYERS = 36   # Qwen3-Next's GDN layers (48 layers, 3 of 4 linear attention)


def _case(GL, torch, decodes, lens, hk=2, hv=8, head=128, width=4, device="cpu", layers=1):
    """``layers`` layer calls (each on its own zero tensors of the row's shapes), and their step."""
    dim = (2 * hk + hv) * head
    T = decodes + sum(lens)
    kw = {}
    if decodes:
        kw["decode_slots"] = torch.arange(1, decodes + 1, dtype=torch.int32, device=device)
    if lens:
        kw.update(prefill_lens=lens,
                  prefill_slots=torch.arange(decodes + 1, decodes + 1 + len(lens), dtype=torch.int32, device=device),
                  prefill_has_initial_state=torch.ones(len(lens), dtype=torch.bool, device=device))
    step = GL.make_step_plan(num_actual_tokens=T, num_v_heads=hv, num_k_heads=hk, conv_width=width, device=device, **kw)
    if device == "cpu":
        n = {"decode": decodes, "prefill": len(lens)}
        step._derive = lambda kind: torch.arange(1, n[kind] + 1, dtype=torch.int32)   # no slot-id launch either
    bf16 = torch.bfloat16

    def zeros(*shape, dtype=bf16):
        return torch.zeros(*shape, dtype=dtype, device=device)
    def layer():
        x, a, b = zeros(T, dim), zeros(T, hv), zeros(T, hv)
        args = dict(conv_weight=zeros(dim, width), conv_bias=zeros(dim), activation="silu",
                    conv_state=zeros(64, dim, width - 1), ssm_state=zeros(64, hv, head, head, dtype=torch.float32),
                    A_log=zeros(hv, dtype=torch.float32), dt_bias=zeros(hv, dtype=torch.float32), num_k_heads=hk,
                    out=zeros(T, hv, head))
        return lambda: GL.gdn_layer_forward(step, x, a, b, **args)
    return [layer() for _ in range(layers)], step


def _no_op_launches(root: str) -> None:
    """The ops on the TileLang path down to a raw launch function that does nothing (the CPU launch
    tests' stand-ins, tests/kernels/launch_check.py, with the argument check left out)."""
    import pytest

    sys.path.insert(0, str(Path(root) / "tests" / "kernels"))
    import launch_check

    mp = pytest.MonkeyPatch()
    launch_check.force_tilelang_path(mp)
    launch_check.record_launches(mp)
    # (the prefill's launches moved from prefill_api to prefill_launch in 2026-12-07's split: an
    # older --root has the first)
    mods = [getattr(launch_check, m, None) for m in ("common", "prefill_api", "prefill_launch")]
    for mod in mods:
        if mod is not None and hasattr(mod, "raw_function"):
            mp.setattr(mod, "raw_function", lambda kernel, name: (lambda *args: None))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--to-launch", action="store_true",
                   help="time the kernel modules' host code too (no-op raw launches, meta tensors)")
    p.add_argument("--no-replay", action="store_true",
                   help="with --to-launch: no launch replay (gdn_layer.LAUNCH_REPLAY = False)")
    args = p.parse_args()
    sys.path.insert(0, args.root)
    import torch

    import qla_serve
    from qla_serve import layer_ops, ops
    from qla_serve.backends import gdn_layer as GL

    replay = args.to_launch and not args.no_replay and hasattr(GL, "LAUNCH_REPLAY")
    print(f"qla_serve from {Path(qla_serve.__file__).parent}" + (", down to the raw launch" if args.to_launch else "")
          + (", launch replay on" if replay else ""))
    if hasattr(GL, "LAUNCH_REPLAY"):
        GL.LAUNCH_REPLAY = replay   # (the glue-only form launches nothing to record)
    device, layers = "cpu", 1
    if args.to_launch:
        device, layers = "meta", STEP_LAYERS
        _no_op_launches(args.root)
    else:
        ops._run = lambda *a, **k: "tilelang"
        layer_ops._run = lambda *a, **k: None
        # the layer key is None for CPU slot ids (values checked on every call): key by metadata alone
        GL._layer_key = lambda step, tensors, scalars: ("gdn_layer", *scalars, *map(ops._metadata, tensors))
    for name, (decodes, lens) in ROWS.items():
        calls, step = _case(GL, torch, decodes, lens, device=device, layers=layers)
        for call in calls:
            call()
        res = []
        for first in (False, True):
            times = []
            for i in range(args.calls):
                if first:   # a fresh step's first layer: its checks, and its launches recorded
                    step._checked.clear()
                    if hasattr(step, "_replays"):
                        step._replays = type(step._replays)()
                call = calls[i % layers]
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            res.append(statistics.median(times) * 1e6)
        line = f"2/8 {name}: later layer {res[0]:.1f} us, first layer {res[1]:.1f} us"
        if args.to_launch:
            line += f"; a step of {layers} layers {_step_time(step, calls) * 1e6:.0f} us"
        print(line, flush=True)


def _step_time(step, calls, steps: int = 50) -> float:
    """The median time of all ``calls`` (a step's layers) on a step whose checks and recordings
    start afresh (its slot ids and buffers stay: a new step's first layer makes those too)."""
    times = []
    for _ in range(steps):
        step._checked.clear()
        if hasattr(step, "_replays"):
            step._replays = type(step._replays)()
        t0 = time.perf_counter()
        for call in calls:
            call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


if __name__ == "__main__":
    main()
