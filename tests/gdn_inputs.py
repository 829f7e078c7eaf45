"""Random GDN inputs and error metrics shared by the top-level tests (a uniquely named module:
several test folders have their own conftest.py, so `from conftest import ...` is ambiguous)."""

import torch

from qla_serve.kernels import reference


def make_inputs(seq_lens, Hk, Hv, *, dtype=torch.float64, device="cpu", seed=0, zero_gate_heads=True):
    """Fresh random GDN inputs with realistic gates: unit-norm q/k, g in [-0.3, 0] with a
    quarter of the heads not decaying (g = 0), beta in (0.05, 0.95)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k = reference.l2norm(rnd(T, Hk, 128)), reference.l2norm(rnd(T, Hk, 128))
    v = rnd(T, Hv, 128)
    g = -torch.rand(T, Hv, generator=gen, dtype=torch.float64) * 0.3
    if zero_gate_heads:
        g[:, : max(1, Hv // 4)] = 0.0
    beta = torch.rand(T, Hv, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return ([x.to(device, dtype) for x in (q, k, v)] + [x.to(device, gate_dtype) for x in (g, beta)])


def rel_err(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
