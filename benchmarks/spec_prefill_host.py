"""vLLM's spec step beside a chunked prefill (MTP with its defaults) through the adapter's own
function: host and GPU time of whole steps of GDN layer calls.

    python benchmarks/spec_prefill_host.py [--heads 2/8] [--specs 8,32] [--drafts 2] [--prefill 4x512]

Per point: ``--layers`` GDN layers (each its own inputs, weights and caches; vLLM's layout: conv
state [S, dim, W - 1 + D - 1] seq-first, the SSM pool [S, Hv, 128, 128] fp32; bf16 activations)
of one step that holds N spec decodes of D = 1 + drafts tokens and the prefills, their tokens
interleaved as vLLM 0.33 orders them (gdn_attn.py: both token indices from one argsort of the
spec-token mask), every call ``backends/gdn_layer.gdn_layer_forward``. Host us per step: the
layer calls of a step on a fresh ``make_step_plan`` (made before the clock starts), issued onto
an idle GPU, median of ``--steps`` steps; GPU us per layer call: CUDA events over back-to-back
steps. Also the step's replayed layers (backends/launch_replay.py), or why none were.

What it is for: the spec and non-spec rows' gathers and scatter, which run on every layer call
outside the launch replay (gdn_layer._interleaved_rows); compare two trees by running it in
each. ``--device cpu``: a smoke run of the script itself on the reference path (tiny sizes).
A benchmark, not a test.
"""

import argparse
import statistics
import time

import torch

from qla_serve.backends import gdn_layer as GL

HEAD, W = 128, 4


def _layer(hk, hv, S, D, dev, gen):
    dim = (2 * hk + hv) * HEAD

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale
    return dict(conv_weight=(rnd(dim, W) * 0.5).to(dev, torch.bfloat16),
                conv_bias=(rnd(dim) * 0.1).to(dev, torch.bfloat16), activation="silu",
                conv_state=rnd(S, W - 1 + D - 1, dim).to(dev, torch.bfloat16).transpose(1, 2),
                ssm_state=(rnd(S, hv, HEAD, HEAD) * 0.1).to(dev),
                A_log=(torch.rand(hv, generator=gen) - 1.0).to(dev),
                dt_bias=(rnd(hv) * 0.1).to(dev, torch.bfloat16), num_k_heads=hk)


def point(hk, hv, N, D, lens, layers, steps, dev):
    gen = torch.Generator().manual_seed(N * 10 + D)
    Ts, Tp = N * D, sum(lens)
    T, S = Ts + Tp, 1 + N * D + len(lens) + 8
    slots = torch.randperm(S - 1, generator=gen) + 1
    spec_slots = slots[:Ts].to(torch.int32).view(N, D).to(dev)
    pre_slots = slots[Ts:Ts + len(lens)].to(torch.int32).to(dev)
    # vLLM's request order: spec decodes first, then the prefills; its indices from one argsort
    mask = torch.cat([torch.ones(Ts, dtype=torch.bool), torch.zeros(Tp, dtype=torch.bool)])
    order = torch.argsort(mask.int(), stable=True).to(torch.int32)
    kw = dict(num_actual_tokens=T, num_v_heads=hv, num_k_heads=hk, conv_width=W, device=dev,
              prefill_lens=lens, prefill_slots=pre_slots,
              prefill_has_initial_state=torch.ones(len(lens), dtype=torch.bool, device=dev),
              spec_slots=spec_slots, spec_cu_seqlens=torch.arange(0, Ts + 1, D, dtype=torch.int32, device=dev),
              num_accepted=torch.randint(1, D + 1, (N,), generator=gen, dtype=torch.int32).to(dev),
              num_spec_tokens=Ts, spec_token_idx=order[Tp:].to(dev), non_spec_token_idx=order[:Tp].to(dev))
    dim = (2 * hk + hv) * HEAD

    def inputs(*shape):
        return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)
    kit = [(_layer(hk, hv, S, D, dev, gen), inputs(T, dim), inputs(T, hv), inputs(T, hv),
            torch.empty(T, hv, HEAD, dtype=torch.bfloat16, device=dev)) for _ in range(layers)]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def run_step(step):
        for layer, x, a, b, out in kit:
            GL.gdn_layer_forward(step, x, a, b, out=out, **layer)

    run_step(GL.make_step_plan(**kw))   # first calls: kernel loads
    host = []
    for _ in range(steps):
        step = GL.make_step_plan(**kw)
        sync()
        t0 = time.perf_counter()
        run_step(step)
        host.append((time.perf_counter() - t0) * 1e6)
        sync()
    gpu = None
    if dev == "cuda":
        plans = [GL.make_step_plan(**kw) for _ in range(steps)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for step in plans:
            run_step(step)
        end.record()
        end.synchronize()
        gpu = start.elapsed_time(end) * 1e3 / (steps * layers)
    replays = step._replays
    why = f", refused: {sorted(set(replays.refused.values()))}" if replays.refused else ""
    host_us = statistics.median(host)
    print(f"{hk}/{hv} {N} spec x D{D} + {Tp} prefill tokens: host {host_us:.0f} us a step of {layers} "
          f"({host_us / layers:.1f} per layer call); GPU {gpu and f'{gpu:.1f}'} us per layer call; "
          f"{replays.replayed} layers replayed{why}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", default="2/8")
    p.add_argument("--specs", default="8,32", help="spec decodes per step, comma-separated")
    p.add_argument("--drafts", default="2", help="draft tokens per spec decode (D = 1 + drafts), comma-separated")
    p.add_argument("--prefill", default="4x512", help="prefill lengths: NxL items joined by '+'")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    lens = []
    for item in args.prefill.split("+"):
        n, length = item.split("x") if "x" in item else ("1", item)
        lens += [int(length)] * int(n)
    for heads in args.heads.split(","):
        hk, hv = (int(v) for v in heads.split("/"))
        for N in (int(v) for v in args.specs.split(",")):
            for drafts in (int(v) for v in args.drafts.split(",")):
                point(hk, hv, N, 1 + drafts, lens, args.layers, args.steps, args.device)


if __name__ == "__main__":
    main()
