"""The Python glue of one GDN layer call (`gdn_layer_forward`), every kernel launch a no-op.

    python benchmarks/layer_glue_host.py [--root DIR] [--calls 2000]

Runs on any machine (CPU tensors; the ops' path dispatch answers "tilelang" and launches nothing),
so a host-time change of a few microseconds shows, which the lent H200's host hides in its
run-to-run noise (30-50%: benchmarks/h200_validation.md, session 29). ``--root``: the checkout
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


def _case(GL, torch, decodes, lens, hk=2, hv=8, head=128, width=4):
    """A layer call on zero CPU tensors of the row's shapes, and its step."""
    dim = (2 * hk + hv) * head
    T = decodes + sum(lens)
    kw = {}
    if decodes:
        kw["decode_slots"] = torch.arange(1, decodes + 1, dtype=torch.int32)
    if lens:
        kw.update(prefill_lens=lens, prefill_slots=torch.arange(decodes + 1, decodes + 1 + len(lens), dtype=torch.int32),
                  prefill_has_initial_state=torch.ones(len(lens), dtype=torch.bool))
    step = GL.make_step_plan(num_actual_tokens=T, num_v_heads=hv, num_k_heads=hk, conv_width=width, device="cpu", **kw)
    n = {"decode": decodes, "prefill": len(lens)}
    step._derive = lambda kind: torch.arange(1, n[kind] + 1, dtype=torch.int32)   # no slot-id launch either
    bf16 = torch.bfloat16
    x, a, b = torch.zeros(T, dim, dtype=bf16), torch.zeros(T, hv, dtype=bf16), torch.zeros(T, hv, dtype=bf16)
    args = dict(conv_weight=torch.zeros(dim, width, dtype=bf16), conv_bias=torch.zeros(dim, dtype=bf16),
                activation="silu", conv_state=torch.zeros(64, dim, width - 1, dtype=bf16),
                ssm_state=torch.zeros(64, hv, head, head), A_log=torch.zeros(hv), dt_bias=torch.zeros(hv),
                num_k_heads=hk, out=torch.zeros(T, hv, head, dtype=bf16))
    return (lambda: GL.gdn_layer_forward(step, x, a, b, **args)), step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    sys.path.insert(0, args.root)
    import torch

    import qla_serve
    from qla_serve import layer_ops, ops
    from qla_serve.backends import gdn_layer as GL

    print(f"qla_serve from {Path(qla_serve.__file__).parent}")
    ops._run = lambda *a, **k: "tilelang"
    layer_ops._run = lambda *a, **k: None
    # the layer key is None for CPU slot ids (values checked on every call): key by metadata alone
    GL._layer_key = lambda step, tensors, scalars: ("gdn_layer", *scalars, *map(ops._metadata, tensors))
    for name, (decodes, lens) in ROWS.items():
        call, step = _case(GL, torch, decodes, lens)
        call()
        res = []
        for first in (False, True):
            times = []
            for _ in range(args.calls):
                if first:
                    step._checked.clear()
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            res.append(statistics.median(times) * 1e6)
        print(f"2/8 {name}: later layer {res[0]:.1f} us, first layer {res[1]:.1f} us", flush=True)


if __name__ == "__main__":
    main()
