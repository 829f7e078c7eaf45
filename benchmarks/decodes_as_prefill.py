"""GPU time of a mixed step's core: N decodes through gdn_decode + 4 x 512 through gdn_prefill,
against all of it as one gdn_prefill over [1]*N + [512]*4 (the decodes as one-token sequences).
2/8 heads, bf16 q/k/v, fp32 pool; CUDA-graph replays of each form, median of 20, us per call.

    python benchmarks/decodes_as_prefill.py     # on a GPU; figures: data/decodes_as_prefill_h200.txt

The question (benchmarks/layer.md, "Next"): would a mixed step save launches by running its
decodes as one-token prefill sequences? A benchmark, not a test."""
import torch

import qla_serve
from qla_serve.bench.prefill import _gpu_time_ms

torch.manual_seed(0)
dev = "cuda"
HK, HV, D = 2, 8, 128


def timed(fn) -> float:
    """GPU us per call: the prefill bench's CUDA-graph replay timing (5 calls per graph, median of 20)."""
    return _gpu_time_ms(fn, reps=20, graph_calls=5)[0] * 1e3


for N in (8, 32, 128, 256):
    lens = [512] * 4
    T = N + sum(lens)
    q = torch.nn.functional.normalize(torch.randn(T, HK, D, device=dev), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(T, HK, D, device=dev), dim=-1).bfloat16()
    v = torch.randn(T, HV, D, device=dev).bfloat16()
    g = -torch.rand(T, HV, device=dev) * 0.1
    beta = torch.rand(T, HV, device=dev)
    pool = torch.randn(N + 8, HV, D, D, device=dev) * 0.1
    dslots = torch.arange(N, dtype=torch.int32, device=dev)
    pslots = torch.arange(N, N + 4, dtype=torch.int32, device=dev)
    out = torch.empty(T, HV, D, dtype=torch.bfloat16, device=dev)
    plan_p = qla_serve.plan_prefill(lens, HV, HK, device=dev)
    plan_all = qla_serve.plan_prefill([1] * N + lens, HV, HK, device=dev)
    allslots = torch.cat([dslots, pslots])

    def apart():
        qla_serve.gdn_decode(q[:N], k[:N], v[:N], pool, dslots, g=g[:N], beta=beta[:N], out=out[:N])
        qla_serve.gdn_prefill(q[N:], k[N:], v[N:], g[N:], beta[N:], pool, pslots,
                              plan_p, out=out[N:])
    gc, bc = g.contiguous(), beta.contiguous()

    def together():
        qla_serve.gdn_prefill(q, k, v, gc, bc, pool, allslots, plan_all, out=out)

    def decode_only():
        qla_serve.gdn_decode(q[:N], k[:N], v[:N], pool, dslots, g=g[:N], beta=beta[:N], out=out[:N])
    ra, rt, rd = timed(apart), timed(together), timed(decode_only)
    print(f"2/8 N={N} decodes + 4x512: apart {ra:.1f} us (decode alone {rd:.1f}), as one prefill {rt:.1f} us "
          f"(plan {plan_all.strategy}/vs{plan_all.v_split})", flush=True)
