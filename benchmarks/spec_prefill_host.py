"""vLLM's spec step beside a chunked prefill (MTP with its defaults) through the adapter's own
function: host and GPU time of whole steps of GDN layer calls, per token layout.

    python benchmarks/spec_prefill_host.py [--heads 2/8] [--specs 8,32] [--drafts 2] [--prefill 4x512]
        [--layouts leading,indexed,interleaved] [--rounds 2]

Per point: ``--layers`` GDN layers (each its own inputs, weights and caches; vLLM's layout: conv
state [S, dim, W - 1 + D - 1] seq-first, the SSM pool [S, Hv, 128, 128] fp32; bf16 activations)
of one step that holds N spec decodes of D = 1 + drafts tokens and the prefills, every call
``backends/gdn_layer.gdn_layer_forward``. Layouts (tokens ordered as vLLM 0.33 orders them;
its token indices from one stable argsort of the spec-token mask, gdn_attn.py):

* ``leading``: the spec requests first (vLLM's batch reorder puts decodes first), no token
  indices: the layer takes row views (what the vLLM adapter hands such a step);
* ``indexed``: the same batch with vLLM's token indices ([0, Ts) and [Ts, T)): the rows gathered
  into step buffers and the outputs scattered back (gdn_layer._interleaved_rows; what the
  adapter handed every such step before);
* ``interleaved``: the first prefill ahead of the spec requests (in vLLM: a non-spec request
  among the decodes, or a batch its reorder leaves alone), the indices a true permutation:
  gathered as ``indexed``.

Host us per step: the layer calls of a step on a fresh ``make_step_plan`` (made before the
clock starts), issued onto an idle GPU, median of ``--steps`` steps. GPU us per layer call: one
step captured in a CUDA graph after two warm-up steps (its slot ids derived before the capture),
median of ``--steps`` replays (the host out of the figure; data/spec_layouts_h100.txt's
figures derived them inside the graph, a few tiny launches per step). The
layouts alternate within each round, all in one process. Also the step's replayed layers
(backends/launch_replay.py), or why none were. ``--device cpu``: a smoke run of the script
itself on the reference path (tiny sizes; its times mean nothing). A benchmark, not a test.
"""

import argparse
import statistics
import time

import torch

from qla_serve.backends import gdn_layer as GL
from qla_serve.bench import decode as bdec

HEAD, W = 128, 4
LAYOUTS = ("leading", "indexed", "interleaved")


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


def _step_kwargs(layout, hk, hv, N, D, lens, dev, gen):
    """make_step_plan's arguments for the layout (module doc), and the step's token count."""
    Ts, Tp = N * D, sum(lens)
    T = Ts + Tp
    slots = torch.randperm(T + len(lens) + 8, generator=gen) + 1
    # request order: spec decodes first, or the first prefill ahead of them
    spec_first = layout != "interleaved"
    qlens = [D] * N + lens if spec_first else lens[:1] + [D] * N + lens[1:]
    spec_rows = [True] * N + [False] * len(lens) if spec_first else [False] + [True] * N + [False] * (len(lens) - 1)
    mask = torch.repeat_interleave(torch.tensor(spec_rows), torch.tensor(qlens))
    order = torch.argsort(mask.int(), stable=True).to(torch.int32)
    kw = dict(num_actual_tokens=T, num_v_heads=hv, num_k_heads=hk, conv_width=W, device=dev,
              prefill_lens=lens, prefill_slots=slots[Ts:Ts + len(lens)].to(torch.int32).to(dev),
              prefill_has_initial_state=torch.ones(len(lens), dtype=torch.bool, device=dev),
              spec_slots=slots[:Ts].to(torch.int32).view(N, D).to(dev),
              spec_cu_seqlens=torch.arange(0, Ts + 1, D, dtype=torch.int32, device=dev),
              num_accepted=torch.randint(1, D + 1, (N,), generator=gen, dtype=torch.int32).to(dev),
              num_spec_tokens=Ts)
    if layout != "leading":
        kw.update(spec_token_idx=order[Tp:].to(dev), non_spec_token_idx=order[:Tp].to(dev))
    return kw, T


class Point:
    """One (heads, N, D, prefill) point: its layers' inputs and caches, and a step per layout."""

    def __init__(self, hk, hv, N, D, lens, layers, dev):
        gen = torch.Generator().manual_seed(N * 10 + D)
        self.dev, self.label = dev, f"{hk}/{hv} {N} spec x D{D} + {sum(lens)} prefill tokens"
        self.kw = {}
        for layout in LAYOUTS:
            self.kw[layout], T = _step_kwargs(layout, hk, hv, N, D, lens, dev, torch.Generator().manual_seed(1))
        S = 1 + T + len(lens) + 8
        dim = (2 * hk + hv) * HEAD

        def inputs(*shape):
            return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)
        self.kit = [(_layer(hk, hv, S, D, dev, gen), inputs(T, dim), inputs(T, hv), inputs(T, hv),
                     torch.empty(T, hv, HEAD, dtype=torch.bfloat16, device=dev)) for _ in range(layers)]

    def run_step(self, step):
        for layer, x, a, b, out in self.kit:
            GL.gdn_layer_forward(step, x, a, b, out=out, **layer)

    def measure(self, layout, steps):
        kw, cuda = self.kw[layout], self.dev == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.run_step(GL.make_step_plan(**kw))   # first calls: kernel loads, the replay's watcher
        host = []
        for _ in range(steps):
            step = GL.make_step_plan(**kw)
            sync()
            t0 = time.perf_counter()
            self.run_step(step)
            host.append((time.perf_counter() - t0) * 1e6)
            sync()
        gpu = None
        if cuda:   # bench decode's graph timing: warm-up calls, then one captured step replayed
            graph_step = GL.make_step_plan(**kw)
            gpu = bdec._graph_time_us(torch, [lambda: self.run_step(graph_step)], steps) / len(self.kit)
        replays = step._replays
        why = f", refused: {sorted(set(replays.refused.values()))}" if replays.refused else ""
        host_us = statistics.median(host)
        layers = len(self.kit)
        print(f"{self.label}, {layout:11s}: host {host_us:.0f} us a step of {layers} ({host_us / layers:.1f} "
              f"per layer call); GPU {gpu and f'{gpu:.1f}'} us per layer call; {replays.replayed} layers "
              f"replayed{why}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", default="2/8")
    p.add_argument("--specs", default="8,32", help="spec decodes per step, comma-separated")
    p.add_argument("--drafts", default="2", help="draft tokens per spec decode (D = 1 + drafts), comma-separated")
    p.add_argument("--prefill", default="4x512", help="prefill lengths: NxL items joined by '+'")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2, help="rounds over the layouts, alternating")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        p.error(f"--layouts: unknown {sorted(unknown)}; expected some of {LAYOUTS}")
    lens = []
    for item in args.prefill.split("+"):
        n, length = item.split("x") if "x" in item else ("1", item)
        lens += [int(length)] * int(n)
    for heads in args.heads.split(","):
        hk, hv = (int(v) for v in heads.split("/"))
        for N in (int(v) for v in args.specs.split(",")):
            for drafts in (int(v) for v in args.drafts.split(",")):
                point = Point(hk, hv, N, 1 + drafts, lens, args.layers, args.device)
                for _ in range(args.rounds):
                    for layout in layouts:
                        point.measure(layout, args.steps)


if __name__ == "__main__":
    main()
