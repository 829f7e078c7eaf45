"""Host (CPU) time per eager call: the public ops vs the kernel-module call they dispatch to.

    python benchmarks/ops_host.py          # on a CUDA machine with the TileLang kernels

What ops.py adds per call (validation from host metadata + dispatch) is the difference of the
two columns. Enqueue time only: no synchronisation inside the timed loop (the queue is drained
every 200 calls so it never fills). A benchmark, not a test.
"""

import statistics
import time

import torch

import qla_serve
from qla_serve.ops import _arch_of, kernel_module


def _per_call_us(fn, n=2000, drain=200):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for i in range(0, n, drain):
        t0 = time.perf_counter()
        for _ in range(drain):
            fn()
        samples.append((time.perf_counter() - t0) / drain)
        torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def main() -> None:
    dev = torch.device("cuda")
    mod = kernel_module(_arch_of(0))
    Hk, Hv, B = 2, 8, 1
    gen = torch.Generator(device=dev).manual_seed(0)
    pool = torch.randn(64, Hv, 128, 128, device=dev, generator=gen) * 0.05
    q = torch.nn.functional.normalize(torch.randn(B, Hk, 128, device=dev, generator=gen), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(B, Hk, 128, device=dev, generator=gen), dim=-1).bfloat16()
    v = torch.randn(B, Hv, 128, device=dev, generator=gen).bfloat16()
    g = -torch.rand(B, Hv, device=dev, generator=gen) * 0.1
    beta = torch.rand(B, Hv, device=dev, generator=gen)
    ids = torch.arange(1, B + 1, dtype=torch.int32, device=dev)
    out = torch.empty(B, Hv, 128, device=dev, dtype=torch.bfloat16)
    kw = dict(g=g, beta=beta, a=None, b=None, A_log=None, dt_bias=None, use_qk_l2norm=False,
              scale=128 ** -0.5, out=out)
    rows = [("decode B=1, 2/8", _per_call_us(lambda: qla_serve.gdn_decode(q, k, v, pool, ids, g=g, beta=beta, out=out)),
             _per_call_us(lambda: mod.decode(q, k, v, pool, ids, **kw)))]

    # the engines' decode call: raw gating (SGLang mixes an fp32 A_log with a bf16 dt_bias), the
    # L2 norm in the kernel, q/k/v strided views of one projection, batch 8
    Bd = 8
    qkv = torch.randn(Bd, (2 * Hk + Hv) * 128, device=dev, generator=gen).bfloat16()
    qd, kd, vd = (qkv[:, a * 128:b * 128].unflatten(1, (-1, 128)) for a, b in ((0, Hk), (Hk, 2 * Hk), (2 * Hk, 2 * Hk + Hv)))
    ad, bd = (torch.randn(Bd, Hv, device=dev, generator=gen).bfloat16() for _ in range(2))
    A_log, dt_bias = torch.rand(Hv, device=dev, generator=gen), torch.rand(Hv, device=dev, generator=gen).bfloat16()
    idd = torch.arange(1, Bd + 1, dtype=torch.int32, device=dev)
    outd = torch.empty(Bd, Hv, 128, device=dev, dtype=torch.bfloat16)
    kwd = dict(g=None, beta=None, a=ad, b=bd, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True,
               scale=128 ** -0.5, out=outd)
    rows.append(("decode B=8, 2/8, raw gating + l2norm", _per_call_us(lambda: qla_serve.gdn_decode(
        qd, kd, vd, pool, idd, a=ad, b=bd, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True, out=outd)),
        _per_call_us(lambda: mod.decode(qd, kd, vd, pool, idd, **kwd))))

    lens = [512] * 4
    T = sum(lens)
    qp = torch.nn.functional.normalize(torch.randn(T, Hk, 128, device=dev, generator=gen), dim=-1).bfloat16()
    kp = torch.nn.functional.normalize(torch.randn(T, Hk, 128, device=dev, generator=gen), dim=-1).bfloat16()
    vp = torch.randn(T, Hv, 128, device=dev, generator=gen).bfloat16()
    gp = -torch.rand(T, Hv, device=dev, generator=gen) * 0.1
    bp = torch.rand(T, Hv, device=dev, generator=gen)
    sid = torch.arange(1, 5, dtype=torch.int32, device=dev)
    outp = torch.empty(T, Hv, 128, device=dev, dtype=torch.bfloat16)
    plan = qla_serve.plan_prefill(lens, Hv, Hk, device=dev)
    rows.append(("prefill 4x512, 2/8", _per_call_us(lambda: qla_serve.gdn_prefill(qp, kp, vp, gp, bp, pool, sid, plan, out=outp), n=400),
                 _per_call_us(lambda: mod.prefill(qp, kp, vp, gp, bp, pool, sid, plan, has_initial_state=None,
                                                  scale=128 ** -0.5, out=outp), n=400)))
    many = [1] * 200 + [512] * 56
    rows.append(("plan_prefill 256 seqs (cuda upload)", _per_call_us(lambda: qla_serve.plan_prefill(many, Hv, Hk, device=dev), n=1000), float("nan")))
    print(f"{'call':<38} {'public op us':>12} {'kernel module us':>16}")
    for name, a, b in rows:
        print(f"{name:<38} {a:12.1f} {b:16.1f}")


if __name__ == "__main__":
    main()
