"""SGLang-shaped inputs for FlashQLAGDNKernel and their float64 oracle (no SGLang import).

Shapes are what SGLang 0.5.23's GDNAttnBackend hands its kernel (see
qla_serve/backends/sglang/kernel.py): q/k/v are strided views of one conv output
``mixed [T, 2*Hk*128 + Hv*128]`` reshaped to ``[1, T, H, 128]`` and not L2-normalised; the pool
is ``[size+1, Hv, 128, 128]`` whose slot 0 is SGLang's padding slot; cache ids -1 and 0 are
padding. The pool is filled with random values ("poisoned") so untouched slots can be compared
bit for bit. The oracle runs qla_serve.kernels.reference.recurrent_gdn in float64 per request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qla_serve.kernels import reference

D = 128


def mixed_views(T, Hk, Hv, dtype, device, gen):
    """q, k [1, T, Hk, 128] and v [1, T, Hv, 128]: strided views of one [T, qkv] tensor."""
    mixed = torch.randn(T, (2 * Hk + Hv) * D, generator=gen).to(device, dtype)
    kd = Hk * D
    q = mixed[:, :kd].view(1, T, Hk, D)
    k = mixed[:, kd:2 * kd].view(1, T, Hk, D)
    v = mixed[:, 2 * kd:].view(1, T, Hv, D)
    assert q.stride(1) == mixed.stride(0) and not q.is_contiguous()
    return q, k, v


def pool(num_slots, Hv, dtype, device, gen):
    """[num_slots, Hv, 128, 128], random ("poisoned"): every slot holds a distinct state."""
    return (torch.randn(num_slots, Hv, D, D, generator=gen) * 0.1).to(device, dtype)


def raw_gates(T, Hv, dtype, device, gen):
    a = torch.randn(T, Hv, generator=gen).to(device, dtype)
    b = torch.randn(T, Hv, generator=gen).to(device, dtype)
    A_log = (torch.rand(Hv, generator=gen) * 0.5 - 1.0).to(device)
    dt_bias = (torch.randn(Hv, generator=gen) * 0.1).to(device, dtype)
    return a, b, A_log, dt_bias


def gating64(a, b, A_log, dt_bias):
    g = -torch.exp(A_log.double().cpu()) * F.softplus(a.double().cpu() + dt_bias.double().cpu())
    return g, torch.sigmoid(b.double().cpu())


def _float64_inputs(q, k, v):
    """[1, T, H, 128] kernel inputs -> float64 CPU q, k (normalised here), v and a zero o."""
    q64 = reference.l2norm(q[0].double().cpu())
    k64 = reference.l2norm(k[0].double().cpu())
    v64 = v[0].double().cpu()
    return q64, k64, v64, torch.zeros(v64.shape, dtype=torch.float64)


def oracle(q, k, v, g, beta, lens, slots, pool0):
    """Per request, float64: (o [T, Hv, 128], {slot: final state}). Padding (slot <= 0): o = 0.

    q, k, v: [1, T, H, 128] as the kernel gets them (normalised here); g, beta: [T, Hv] float64.
    """
    q64, k64, v64, o = _float64_inputs(q, k, v)
    finals = {}
    start = 0
    for n, s in zip(lens, slots):
        if s > 0:
            init = pool0[s].double().cpu().unsqueeze(0)
            oi, fin = reference.recurrent_gdn(q64[start:start + n], k64[start:start + n], v64[start:start + n],
                                              g[start:start + n], beta[start:start + n], [0, n], init, D ** -0.5)
            o[start:start + n] = oi
            finals[s] = fin[0]
        start += n
    return o, finals


def verify_oracle(q, k, v, g, beta, lens, slots, pool0):
    """Like :func:`oracle` but also every per-token state: {slot: [n, Hv, 128, 128]}."""
    q64, k64, v64, o = _float64_inputs(q, k, v)
    states = {}
    start = 0
    for n, s in zip(lens, slots):
        if s > 0:
            st = pool0[s].double().cpu().unsqueeze(0)
            per = []
            for t in range(start, start + n):
                ot, st = reference.recurrent_gdn(q64[t:t + 1], k64[t:t + 1], v64[t:t + 1], g[t:t + 1],
                                                 beta[t:t + 1], [0, 1], st, D ** -0.5)
                o[t] = ot[0]
                per.append(st[0])
            states[s] = torch.stack(per)
        start += n
    return o, states


def rel(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def check_slots(conv, ssm, conv0, ssm0, want, tol):
    """A layer step's conv and SSM slots after the call: each slot in ``want`` ({slot: (conv window
    [dim, W-1], state [Hv, 128, 128])}, the oracle's) holds its window bit for bit (as bf16) and
    its state within ``tol``; every other slot is bit-identical to before (conv0, ssm0)."""
    for s in range(conv.shape[0]):
        if s in want:
            assert torch.equal(conv[s].cpu(), want[s][0].to(torch.bfloat16)), f"conv window of slot {s}"
            assert rel(ssm[s], want[s][1]) < tol, f"state of slot {s}"
        else:
            assert torch.equal(conv[s], conv0[s]) and torch.equal(ssm[s], ssm0[s]), f"slot {s} outside the batch"
