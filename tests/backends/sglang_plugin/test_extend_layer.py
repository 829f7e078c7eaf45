"""qla_serve/backends/sglang/extend_layer.py (SGLang's extend step with its conv, split and gating
taken over) on SGLang-shaped objects, against a float64 oracle of the conv and the recurrence.

No SGLang here: ``backend``, ``layer`` and ``forward_batch`` are stand-ins (SimpleNamespace) with
exactly the attributes extend_layer reads from SGLang 0.5.23's ``GDNAttnBackend``
(``forward_metadata.mamba_cache_indices`` int32), ``RadixLinearAttention``, ``ForwardBatch``
(``extend_prefix_lens`` int32 on the device) and the layer's pool slice the hook hands over
(``mamba2_layer_cache``'s object: the conv cache ``[size+1, dim, W-1]``, window innermost; the
temporal pool ``[size+1, Hv, 128, 128]``), because SGLang's GPU build cannot run on the
lent H200 and its CPU import needs .venv-sglang; the real backend drives the same function on the
CPU in test_sglang_kit.py. The CPU variant runs qla_serve's reference path, the gpu variants
(H200) its TileLang kernels.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import _sglang_cases as C
from qla_serve.backends.sglang import extend_layer
from qla_serve.backends.sglang.kernel import ExtendBatch

W = 4


def _layer(Hk, Hv, dev, gen, layer_id):
    dim = (2 * Hk + Hv) * C.D
    return SimpleNamespace(layer_id=layer_id,
                           conv_weights=(torch.randn(dim, W, generator=gen) * 0.5).to(dev, torch.bfloat16),
                           bias=(torch.randn(dim, generator=gen) * 0.1).to(dev, torch.bfloat16),
                           activation="silu", num_k_heads=Hk, num_v_heads=Hv, head_k_dim=C.D,
                           A_log=(torch.rand(Hv, generator=gen) * 0.5 - 1.0).to(dev),
                           dt_bias=(torch.randn(Hv, generator=gen) * 0.1).to(dev, torch.bfloat16))


def _oracle(x, a, b, layer, conv0, ssm0, lens, slots, prefix, Hk, Hv):
    """float64: per request the conv over its history (zeros without a prefix: the slot is not
    read) and its tokens, conv bias and SiLU, the gates and the recurrence from its slot (zeros
    without a prefix). Returns (o [T, Hv, 128], {slot: (conv window after, SSM state after)})."""
    w, bias = layer.conv_weights.double().cpu(), layer.bias.double().cpu()
    x64 = x.double().cpu()
    ys, windows, start = [], {}, 0
    init = ssm0.double().cpu().clone()
    for n, s, p in zip(lens, slots, prefix):
        hist = conv0[s].double().cpu() if p > 0 else torch.zeros(x.shape[1], W - 1, dtype=torch.float64)
        if p == 0:
            init[s] = 0
        full = torch.cat([hist, x64[start:start + n].T], 1)
        ys.append(F.silu(F.conv1d(full[None], w[:, None], bias, groups=x.shape[1])[0]).T)
        windows[s] = full[:, -(W - 1):]
        start += n
    y = torch.cat(ys)
    kd = Hk * C.D
    q, k = (y[:, j:j + kd].view(1, -1, Hk, C.D) for j in (0, kd))
    v = y[:, 2 * kd:].view(1, -1, Hv, C.D)
    g, beta = C.gating64(a[:start], b[:start], layer.A_log, layer.dt_bias)
    o, finals = C.oracle(q, k, v, g, beta, list(lens), list(slots), init)
    return o, {s: (windows[s], finals[s]) for s in finals}


def _run(dev, Hk, Hv, pool_dtype, seed):
    """Two GDN layers of one forward batch (one metadata object, one ExtendBatch): requests with
    and without a prefix, one of them on a recycled slot holding NaN (never read), SGLang's
    physical padding rows past the batch, and SGLang's ``linear_attn_output`` buffer."""
    gen = torch.Generator().manual_seed(seed)
    S, dim = 24, (2 * Hk + Hv) * C.D
    lens, slots, prefix = (37, 1, 130, 64, 5), [5, 17, 3, 23, 9], [0, 12, 70, 0, 3]
    n, T = sum(lens), sum(lens) + 3
    layers = [_layer(Hk, Hv, dev, gen, layer_id) for layer_id in (3, 7)]
    caches = {}
    for lay in layers:
        conv = torch.randn(S, dim, W - 1, generator=gen).to(dev, torch.bfloat16)
        ssm = C.pool(S, Hv, pool_dtype, dev, gen)
        conv[slots[3]], ssm[slots[3]] = float("nan"), float("nan")     # recycled, no prefix
        caches[lay.layer_id] = SimpleNamespace(conv=[conv], temporal=ssm)
    x = torch.randn(T, dim, generator=gen).to(dev, torch.bfloat16)
    a, b = (torch.randn(T, Hv, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    before = {i: (c.conv[0].clone(), c.temporal.clone()) for i, c in caches.items()}
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    meta = SimpleNamespace(mamba_cache_indices=torch.tensor(slots, dtype=torch.int32, device=dev),
                           query_start_loc=qsl)
    backend = SimpleNamespace(forward_metadata=meta)
    fb = SimpleNamespace(extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=dev))
    batch = ExtendBatch(query_start_loc=qsl, seq_lens=lens, num_tokens=n)
    outs = []
    for i, lay in enumerate(layers):
        given = torch.full((1, T, Hv, C.D), 7.0, dtype=torch.bfloat16, device=dev) if i == 0 else None
        out = extend_layer.forward_extend(backend, lay, fb, x, a, b, batch, caches[lay.layer_id], output=given)
        assert out.shape == (1, T, Hv, C.D) and out.dtype == x.dtype
        assert given is None or out is given
        outs.append(out)
    assert batch.step is not None and batch.step.prefill_plan is batch.plan
    tol = 2e-2 if pool_dtype == torch.bfloat16 else 1e-2
    for lay, out in zip(layers, outs):
        conv0, ssm0 = before[lay.layer_id]
        conv, ssm = caches[lay.layer_id].conv[0], caches[lay.layer_id].temporal
        o_ref, want = _oracle(x, a, b, lay, conv0, ssm0, lens, slots, prefix, Hk, Hv)
        assert torch.isfinite(out).all()
        assert C.rel(out[0, :n], o_ref) < tol
        assert torch.count_nonzero(out[0, n:]) == 0, "physical padding rows"
        C.check_slots(conv, ssm, conv0, ssm0, want, tol)


def test_extend_layer_cpu():
    _run("cpu", 2, 4, torch.float32, seed=31)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hk,Hv", [(2, 8), (4, 8)])
def test_extend_layer_gpu(Hk, Hv, pool_dtype):
    _run("cuda", Hk, Hv, pool_dtype, seed=32)
