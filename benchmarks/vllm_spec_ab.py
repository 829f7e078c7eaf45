"""vLLM's speculative (MTP) step through the adapter's own function, gdn_verify_slots launched
after conv_spec as a plain launch and as its programmatic dependent, side by side in one process.

    python benchmarks/vllm_spec_ab.py --heads 2/8,16/32 --batches 1,4,8,32 --drafts 2,4 --states fp32,bf16

Per point: ``--layers`` GDN layers of one spec-only step (each its own caches, vLLM's layout:
conv state [S, dim, W - 1 + D - 1] seq-first, the SSM pool [S, Hv, 128, 128]; bf16 activations,
A_log fp32 beside a bf16 dt_bias as vLLM's layer holds them), every layer call
``backends/gdn_layer.gdn_layer_forward`` on one ``make_step_plan``, all in one CUDA graph; GPU us
per layer call, median of ``--reps`` replays. "plain" / "dependent": ``gdn_layer.
SPEC_AFTER_CONV_MAX_ROWS`` at 0 / unbounded; "default" its value (64). Checks that both forms
write the same outputs and states (bit for bit). vLLM's own spec path on Hopper (a compiled ``_C``
kernel) cannot run without its GPU build; this compares qla_serve's two launch forms only.
A benchmark, not a test.
"""

import argparse
from unittest import mock

import torch

from qla_serve.backends import gdn_layer as GL
from qla_serve.bench import decode as bdec

HEAD, W = 128, 4


def make_layer(hk, hv, S, D, state_dtype, gen):
    dim = (2 * hk + hv) * HEAD
    conv = torch.randn(S, W - 1 + D - 1, dim, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
    ssm = (torch.randn(S, hv, HEAD, HEAD, generator=gen) * 0.1).to("cuda", state_dtype)
    w = (torch.randn(dim, W, generator=gen) * 0.5).to("cuda", torch.bfloat16)
    bias = (torch.randn(dim, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    A_log = (torch.rand(hv, generator=gen) - 1.0).cuda()
    dt_bias = (torch.randn(hv, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    return dict(conv_weight=w, conv_bias=bias, activation="silu", conv_state=conv, ssm_state=ssm, A_log=A_log,
                dt_bias=dt_bias, num_k_heads=hk)


def point(hk, hv, N, D, state_dtype, layers, reps):
    gen = torch.Generator().manual_seed(N * 10 + D)
    T, S = N * D, 1 + N * D + 8
    dim = (2 * hk + hv) * HEAD
    slots = (torch.randperm(S - 1, generator=gen)[:T] + 1).to(torch.int32).view(N, D).cuda()
    acc = torch.randint(1, D + 1, (N,), generator=gen, dtype=torch.int32).cuda()
    cu = torch.arange(0, T + 1, D, dtype=torch.int32, device="cuda")
    step = GL.make_step_plan(num_actual_tokens=T, num_v_heads=hv, num_k_heads=hk, conv_width=W, device="cuda",
                             spec_slots=slots, spec_cu_seqlens=cu, num_accepted=acc, num_spec_tokens=T)
    x = torch.randn(T, dim, generator=gen).to("cuda", torch.bfloat16)
    a, b = (torch.randn(T, hv, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    rec, results = {}, {}
    default = GL.SPEC_AFTER_CONV_MAX_ROWS
    for form, bound in (("plain", 0), ("dependent", 1 << 30), ("default", default)):
        lgen = torch.Generator().manual_seed(5)
        kit = [(make_layer(hk, hv, S, D, state_dtype, lgen),
                torch.empty(T, hv, HEAD, dtype=torch.bfloat16, device="cuda")) for _ in range(layers)]

        def call(layer, out):
            return lambda: GL.gdn_layer_forward(step, x, a, b, out=out, **layer)
        fns = [call(layer, out) for layer, out in kit]
        with mock.patch.object(GL, "SPEC_AFTER_CONV_MAX_ROWS", bound):
            rec[form] = round(bdec._graph_time_us(torch, fns, reps), 2)
        results[form] = (kit[0][1], kit[0][0]["ssm_state"], kit[0][0]["conv_state"])
    rec["same"] = all(torch.equal(p, q) for p, q in zip(results["plain"], results["dependent"]))
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", default="2/8,16/32")
    p.add_argument("--batches", default="1,4,8,32")
    p.add_argument("--drafts", default="2,4")
    p.add_argument("--states", default="fp32,bf16")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    print("| heads | sequences | draft D | state | rows | plain us | dependent us | default us | same |")
    print("|---|---|---|---|---|---|---|---|---|")
    for heads in args.heads.split(","):
        hk, hv = map(int, heads.split("/"))
        for N in map(int, args.batches.split(",")):
            for D in map(int, args.drafts.split(",")):
                for st in args.states.split(","):
                    r = point(hk, hv, N, D, dtypes[st], args.layers, args.reps)
                    print(f"| {heads} | {N} | {D} | {st} | {N * hv} | {r['plain']} | {r['dependent']} | "
                          f"{r['default']} | {r['same']} |", flush=True)


if __name__ == "__main__":
    main()
