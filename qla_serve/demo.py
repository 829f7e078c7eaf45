"""`qla-serve demo`: a small varlen batch through prefill, then decode steps, on the best
available path, checked against the float64 per-token recurrence.

The sequence lengths include an empty and a one-token sequence on purpose; one slot of the
pool is never part of the batch and must stay bit-identical.
"""

from __future__ import annotations

import time

import torch

import qla_serve
from qla_serve.kernels import reference

TOL = {torch.float32: 2e-3, torch.bfloat16: 1e-2}


def _random_inputs(T, Hk, Hv, dtype, device, gen):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)
    q, k = reference.l2norm(rnd(T, Hk, 128)), reference.l2norm(rnd(T, Hk, 128))
    v = rnd(T, Hv, 128)
    g = -torch.rand(T, Hv, generator=gen, dtype=torch.float64).to(device) * 0.2
    g[:, : Hv // 4] = 0.0  # some heads do not decay (the hard case for context parallelism)
    beta = torch.rand(T, Hv, generator=gen, dtype=torch.float64).to(device) * 0.9 + 0.05
    return [x.to(dtype) for x in (q, k, v)] + [g.float(), beta.float()]


def run_demo(device=None, heads=(2, 8), seqlens=(300, 1, 0, 129), decode_steps=4, seed=0) -> int:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    Hk, Hv = heads
    io_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(seed)
    N, T = len(seqlens), sum(seqlens)
    pool = torch.randn(N + 1, Hv, 128, 128, generator=gen).mul_(0.05).to(device)
    slot_ids = torch.arange(1, N + 1, dtype=torch.int32)         # slot 0 stays out of the batch
    untouched = pool[0].clone()
    start = pool.double()[slot_ids.long()].clone()

    qla_serve.plan_prefill(list(seqlens), Hv, Hk, device=device)  # first call: imports, CUDA init
    t0 = time.perf_counter()
    plan = qla_serve.plan_prefill(list(seqlens), Hv, Hk, device=device)
    t_plan = time.perf_counter() - t0
    q, k, v, g, beta = _random_inputs(T, Hk, Hv, io_dtype, device, gen)
    path = qla_serve.explain_path("prefill", device, io_dtype)
    t0 = time.perf_counter()
    o = qla_serve.gdn_prefill(q, k, v, g, beta, pool, slot_ids.to(device), plan)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_prefill = time.perf_counter() - t0
    o_ref, s_ref = reference.recurrent_gdn(q.double(), k.double(), v.double(), g.double(),
                                           beta.double(), plan.cu_seqlens_cpu, start)
    errs = {"prefill o": reference.rel_l2(o, o_ref),
            "prefill state": reference.rel_l2(pool[slot_ids.long()], s_ref)}

    state = s_ref
    for step in range(decode_steps):
        qd, kd, vd, gd, bd = _random_inputs(N, Hk, Hv, io_dtype, device, gen)
        od = qla_serve.gdn_decode(qd, kd, vd, pool, slot_ids.to(device), g=gd, beta=bd)
        od_ref, state = reference.recurrent_gdn(qd.double(), kd.double(), vd.double(), gd.double(),
                                                bd.double(), list(range(N + 1)), state)
        errs[f"decode {step} o"] = reference.rel_l2(od, od_ref)
    errs["decode state"] = reference.rel_l2(pool[slot_ids.long()], state)

    print(f"qla_serve demo on {device}: {N} sequences {list(seqlens)}, heads {Hk}/{Hv}, "
          f"q/k/v {str(io_dtype).replace('torch.', '')}, fp32 pool")
    print(f"paths: prefill {path[0]} ({path[1]}), decode {qla_serve.explain_path('decode', device, io_dtype)[0]}")
    print(f"plan: {plan.strategy}, v_split {plan.v_split}, {plan.num_segments} segments, "
          f"built in {t_plan * 1e6:.0f} us; prefill call {t_prefill * 1e3:.2f} ms (first call, incl. any compile)")
    tol = TOL[torch.float32 if io_dtype == torch.float32 else torch.bfloat16]
    ok = True
    for name, e in errs.items():
        good = e <= tol and e == e
        ok &= good
        print(f"  {name:<16} rel L2 error vs float64 recurrence {e:.2e}  {'ok' if good else 'FAIL'} (<= {tol:g})")
    same = bool(torch.equal(pool[0], untouched))
    ok &= same
    print(f"  slot outside the batch bit-identical: {'ok' if same else 'FAIL'}")
    print("demo passed" if ok else "demo FAILED")
    return 0 if ok else 1
