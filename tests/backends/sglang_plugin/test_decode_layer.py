"""qla_serve/backends/sglang/decode_layer.py (SGLang's decode step with its conv taken over) on
SGLang-shaped objects, against a float64 oracle of the conv and the recurrence.

No SGLang here: ``backend`` and ``layer`` are stand-ins (SimpleNamespace) with exactly the
attributes decode_layer reads from SGLang 0.5.23's ``GDNAttnBackend`` and ``RadixLinearAttention``
(the conv cache ``[size+1, dim, W-1]`` contiguous, window innermost, memory_pool.py:722-729; the
temporal pool ``[size+1, Hv, 128, 128]``; ``forward_metadata.mamba_cache_indices`` int32 with
padding ids 0 and -1), because SGLang's GPU build cannot run on the lent H200 and its CPU import
needs .venv-sglang. The real backend drives the same function on the CPU in test_sglang_kit.py.
The CPU variant runs qla_serve's reference path; the gpu variants (H200) its TileLang kernels,
eagerly and captured in a CUDA graph replayed on new slot ids in SGLang's persistent index buffer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import _sglang_cases as C
from qla_serve.backends.sglang import decode_layer

W = 4


def _meta(idx):
    """SGLang's per-forward-batch metadata (a new object per batch)."""
    return SimpleNamespace(mamba_cache_indices=idx, replayssm_write_pos=None)


def _backend(conv, ssm, meta):
    tracked = []
    cache = SimpleNamespace(conv=[conv], temporal=ssm)
    return SimpleNamespace(
        forward_metadata=meta,
        req_to_token_pool=SimpleNamespace(mamba2_layer_cache=lambda layer_id: cache),
        _track_mamba_state_decode=lambda fb, c, s, ids, layer_id: tracked.append((ids, layer_id)),
        tracked=tracked)


def _layer(Hk, Hv, dev, gen, layer_id=3):
    dim = (2 * Hk + Hv) * C.D
    return SimpleNamespace(layer_id=layer_id, conv_weights=(torch.randn(dim, W, generator=gen) * 0.5).to(dev, torch.bfloat16),
                           bias=None, activation="silu", num_k_heads=Hk, num_v_heads=Hv, head_k_dim=C.D,
                           A_log=(torch.rand(Hv, generator=gen) * 0.5 - 1.0).to(dev),
                           dt_bias=(torch.randn(Hv, generator=gen) * 0.1).to(dev, torch.bfloat16))


def _oracle(x, a, b, layer, conv0, ssm0, slots, Hk, Hv):
    """float64: the conv over each live slot's window (then SiLU), the gates and one recurrence
    step; returns (o [B, Hv, 128], {slot: (conv window after, SSM state after)})."""
    y = torch.zeros(x.shape, dtype=torch.float64)
    windows = {}
    for i, s in enumerate(slots):
        if s > 0:
            full = torch.cat([conv0[s].double().cpu(), x[i].double().cpu()[:, None]], 1)       # [dim, W]
            y[i] = F.silu((full * layer.conv_weights.double().cpu()).sum(-1))
            windows[s] = full[:, 1:]
    kd = Hk * C.D
    q, k, v = (y[:, :kd].view(1, -1, Hk, C.D), y[:, kd:2 * kd].view(1, -1, Hk, C.D),
               y[:, 2 * kd:].view(1, -1, Hv, C.D))
    g, beta = C.gating64(a, b, layer.A_log, layer.dt_bias)
    o, finals = C.oracle(q, k, v, g, beta, [1] * len(slots), slots, ssm0)
    return o, {s: (windows[s], finals[s]) for s in finals}


def _run(dev, Hk, Hv, pool_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    S, slots = 24, [5, 0, 17, -1, 3, 23]
    B, dim = len(slots), (2 * Hk + Hv) * C.D
    layer = _layer(Hk, Hv, dev, gen)
    conv = torch.randn(S, dim, W - 1, generator=gen).to(dev, torch.bfloat16)
    ssm = C.pool(S, Hv, pool_dtype, dev, gen)
    x = torch.randn(B, dim, generator=gen).to(dev, torch.bfloat16)
    a, b = (torch.randn(B, Hv, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    conv0, ssm0 = conv.clone(), ssm.clone()
    backend = _backend(conv, ssm, _meta(torch.tensor(slots, dtype=torch.int32, device=dev)))
    out = decode_layer.forward_decode(backend, layer, None, x, a, b)
    assert out.shape == (1, B, Hv, C.D) and out.dtype == x.dtype
    o_ref, want = _oracle(x, a, b, layer, conv0, ssm0.cpu(), slots, Hk, Hv)
    tol = 2e-2 if pool_dtype == torch.bfloat16 else 1e-2
    assert C.rel(out[0], o_ref) < tol
    for i, s in enumerate(slots):
        if s <= 0:
            assert torch.count_nonzero(out[0, i]) == 0, f"padding row {i}"
    C.check_slots(conv, ssm, conv0, ssm0, want, tol)
    assert backend.tracked == [(backend.forward_metadata.mamba_cache_indices, 3)]


def test_decode_layer_cpu():
    _run("cpu", 2, 4, torch.float32, seed=21)


def test_each_forward_pass_over_one_metadata_makes_its_step(monkeypatch):
    """SGLang 0.5.23 captures a decode graph with one metadata object for two warmup passes and
    the captured pass (runner/decode_cuda_graph_runner.py:1400, then
    runner_backend/full_cuda_graph_backend.py:162-182): the first GDN layer of every pass makes
    that pass's step and derives its slot ids (for the captured pass: inside the graph), the
    later layers of the pass share them."""
    from qla_serve import layer_ops

    derived = []
    real = layer_ops.slot_ids
    monkeypatch.setattr(layer_ops, "slot_ids", lambda *a, **k: derived.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(24)
    Hk, Hv, S, B = 2, 4, 12, 3
    dim = (2 * Hk + Hv) * C.D
    layers = [_layer(Hk, Hv, "cpu", gen, layer_id=i) for i in (3, 7, 11)]
    caches = [(torch.randn(S, dim, W - 1, generator=gen).to(torch.bfloat16), C.pool(S, Hv, torch.float32, "cpu", gen))
              for _ in layers]
    x = torch.randn(B, dim, generator=gen).to(torch.bfloat16)
    a, b = (torch.randn(B, Hv, generator=gen).to(torch.bfloat16) for _ in range(2))
    meta = _meta(torch.tensor([4, 0, 9], dtype=torch.int32))
    passes = []
    for _ in range(3):
        steps = []
        for layer, (conv, ssm) in zip(layers, caches):
            decode_layer.forward_decode(_backend(conv, ssm, meta), layer, None, x, a, b)
            steps.append(meta.qla_decode)
        assert steps[0] is steps[1] is steps[2]
        passes.append(steps[0])
    assert len({id(step) for step in passes}) == 3
    assert len(derived) == 3, "one slot-id derivation per pass"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hk,Hv", [(2, 8), (4, 8)])
def test_decode_layer_gpu(Hk, Hv, pool_dtype):
    _run("cuda", Hk, Hv, pool_dtype, seed=22)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_layer_in_a_cuda_graph():
    """SGLang's decode graph: captured once after two warmup passes over the same metadata, as
    SGLang does (two layers of one forward batch: the step's slot ids derived once per pass, in
    the graph for the captured one), replayed after SGLang rewrites its persistent index buffer
    in place (other slots, a padding row moved): the same as eager calls on copies of the caches."""
    gen = torch.Generator().manual_seed(23)
    Hk, Hv, S, B = 2, 8, 30, 5
    dim = (2 * Hk + Hv) * C.D
    layers = [_layer(Hk, Hv, "cuda", gen, layer_id=i) for i in (3, 7)]
    caches = [(torch.randn(S, dim, W - 1, generator=gen).to("cuda", torch.bfloat16),
               C.pool(S, Hv, torch.float32, "cuda", gen)) for _ in range(2)]
    x = torch.randn(B, dim, generator=gen).to("cuda", torch.bfloat16)
    a, b = (torch.randn(B, Hv, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    idx = torch.tensor([4, 9, -1, 12, 0], dtype=torch.int32, device="cuda")

    def forward(caches_, meta):
        """Both layers of one forward batch (one metadata object)."""
        return [decode_layer.forward_decode(_backend(conv, ssm, meta), layer, None, x, a, b)
                for layer, (conv, ssm) in zip(layers, caches_)]

    # SGLang's capture: one metadata object for two warmup passes and the captured one
    # (runner/decode_cuda_graph_runner.py:1400, runner_backend/full_cuda_graph_backend.py:162-182)
    captured = _meta(idx)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):                                    # compile and launch outside the capture
            forward([(c.clone(), p.clone()) for c, p in caches], captured)
    torch.cuda.current_stream().wait_stream(s)
    warm = captured.qla_decode
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = forward(caches, captured)
    assert captured.qla_decode.decode_slots is idx and captured.qla_decode is not warm
    for trial, new in enumerate(([7, 9, 21, -1, 2], [0, 3, 4, 28, 15], [11, -1, 0, 6, 9])):
        idx.copy_(torch.tensor(new, dtype=torch.int32))
        x.copy_(torch.randn(B, dim, generator=gen).to(torch.bfloat16))
        ref_caches = [(c.clone(), p.clone()) for c, p in caches]
        ref = forward(ref_caches, _meta(idx.clone()))
        graph.replay()
        torch.cuda.synchronize()
        for i in range(2):
            assert torch.equal(static[i], ref[i]), f"trial {trial} layer {i}: out"
            assert torch.equal(caches[i][0], ref_caches[i][0]), f"trial {trial} layer {i}: conv"
            assert torch.equal(caches[i][1], ref_caches[i][1]), f"trial {trial} layer {i}: ssm"
