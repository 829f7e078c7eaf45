"""qla_serve/backends/sglang/verify_layer.py (SGLang's target verify with its conv taken over) on
SGLang-shaped objects, against a float64 oracle of the conv windows and the per-draft states.

No SGLang here: ``backend``, ``layer`` and ``forward_batch`` are stand-ins (SimpleNamespace) with
exactly the attributes verify_layer reads from SGLang 0.5.23's ``GDNAttnBackend``
(``verify_intermediate_state_indices``, ``req_to_token_pool.size``; ``forward_metadata`` with
``mamba_cache_indices`` and ``query_start_loc``), the layer's pool slice the hook hands over (its
``SpeculativeState``: conv ``[size+1, dim, W-1]``, temporal ``[size+1, Hv, 128, 128]``,
``intermediate_ssm [size+1, D, Hv, 128, 128]``, ``intermediate_conv_window[0] [size+1, D, dim,
W-1]``), ``RadixLinearAttention`` and ``ForwardBatch`` (``spec_info.
draft_token_num``), and SGLang's ``select_verify_intermediate_state_indices`` in its default
mode (the per-position table) as a stand-in, because SGLang's GPU build cannot run on the lent
H200. The CPU variant runs qla_serve's reference path, the gpu variants (H200) its TileLang
kernels, eagerly and captured in a CUDA graph replayed on new slot ids.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import _sglang_cases as C
from qla_serve.backends.sglang import verify_layer

W = 4


def _select_rows(default_indices, req_pool_indices, valid, pool_size):
    """SGLang's select_verify_intermediate_state_indices without pp_spec_stable_rows."""
    return default_indices


def _setup(dev, Hk, Hv, pool_dtype, D, slots, seed):
    gen = torch.Generator().manual_seed(seed)
    S, N, dim = 24, len(slots), (2 * Hk + Hv) * C.D
    cache = SimpleNamespace(
        conv=[torch.randn(S, dim, W - 1, generator=gen).to(dev, torch.bfloat16)],
        temporal=C.pool(S, Hv, pool_dtype, dev, gen),
        intermediate_ssm=(torch.randn(S, D, Hv, C.D, C.D, generator=gen) * 0.1).to(dev, pool_dtype),
        intermediate_conv_window=[torch.randn(S, D, dim, W - 1, generator=gen).to(dev, torch.bfloat16)])
    layer = SimpleNamespace(layer_id=2, conv_weights=(torch.randn(dim, W, generator=gen) * 0.5).to(dev, torch.bfloat16),
                            bias=(torch.randn(dim, generator=gen) * 0.1).to(dev, torch.bfloat16), activation="silu",
                            num_k_heads=Hk, head_k_dim=C.D, A_log=(torch.rand(Hv, generator=gen) * 0.5 - 1.0).to(dev),
                            dt_bias=(torch.randn(Hv, generator=gen) * 0.1).to(dev, torch.bfloat16))
    x = torch.randn(N * D, dim, generator=gen).to(dev, torch.bfloat16)
    a, b = (torch.randn(N * D, Hv, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    return cache, layer, x, a, b


def _backend(slots, D, dev):
    N = len(slots)
    meta = SimpleNamespace(mamba_cache_indices=torch.tensor(slots, dtype=torch.int32, device=dev),
                           query_start_loc=torch.arange(0, (N + 1) * D, D, dtype=torch.int32, device=dev))
    backend = SimpleNamespace(forward_metadata=meta, verify_intermediate_state_indices=torch.arange(
                                  30, dtype=torch.int32, device=dev),
                              req_to_token_pool=SimpleNamespace(size=23))
    fb = SimpleNamespace(spec_info=SimpleNamespace(draft_token_num=D),
                         req_pool_indices=torch.arange(N, dtype=torch.int64, device=dev))
    return backend, fb


def _oracle(x, a, b, layer, conv0, ssm0, slots, D, Hk, Hv):
    """float64: per live request (slot > 0) its D tokens' conv from the slot's window, the
    window after each token, and the state after each token from its SSM slot. Returns
    (o [N D, Hv, 128], {slot: windows [D, dim, W-1]}, {slot: states [D, Hv, 128, 128]},
    {slot: the window after the last token})."""
    w, bias = layer.conv_weights.double().cpu(), layer.bias.double().cpu()
    y = torch.zeros(x.shape, dtype=torch.float64)
    windows, last = {}, {}
    for i, s in enumerate(slots):
        if s > 0:
            full = torch.cat([conv0[s].double().cpu(), x[i * D:(i + 1) * D].double().cpu().T], 1)
            y[i * D:(i + 1) * D] = F.silu(F.conv1d(full[None], w[:, None], bias, groups=x.shape[1])[0]).T
            windows[s] = torch.stack([full[:, j + 1:j + W] for j in range(D)])
            last[s] = full[:, D:]
    kd = Hk * C.D
    q, k = (y[:, j:j + kd].view(1, -1, Hk, C.D) for j in (0, kd))
    v = y[:, 2 * kd:].view(1, -1, Hv, C.D)
    g, beta = C.gating64(a, b, layer.A_log, layer.dt_bias)
    o, states = C.verify_oracle(q, k, v, g, beta, [D] * len(slots), slots, ssm0)
    return o, windows, states, last


def _run(dev, Hk, Hv, pool_dtype, D, seed):
    slots = [5, 0, 17, -1, 3, 23]
    cache, layer, x, a, b = _setup(dev, Hk, Hv, pool_dtype, D, slots, seed)
    conv0, ssm0 = cache.conv[0].clone(), cache.temporal.clone()
    iconv0, issm0 = cache.intermediate_conv_window[0].clone(), cache.intermediate_ssm.clone()
    backend, fb = _backend(slots, D, dev)
    out = verify_layer.forward_verify(backend, layer, fb, x, a, b, cache, select_rows=_select_rows)
    N = len(slots)
    assert out.shape == (1, N * D, Hv, C.D) and out.dtype == x.dtype
    o_ref, windows, states, last = _oracle(x, a, b, layer, conv0, ssm0.cpu(), slots, D, Hk, Hv)
    tol = 2e-2 if pool_dtype == torch.bfloat16 else 1e-2
    assert C.rel(out[0], o_ref) < tol
    for i, s in enumerate(slots):
        rows = out[0, i * D:(i + 1) * D]
        if s <= 0:
            assert torch.count_nonzero(rows) == 0, f"padding request {i}"
            continue
        assert torch.equal(cache.intermediate_conv_window[0][i].cpu(), windows[s].to(torch.bfloat16)), f"windows {i}"
        assert torch.equal(cache.conv[0][s].cpu(), last[s].to(torch.bfloat16)), f"conv slot {s}"
        assert C.rel(cache.intermediate_ssm[i], states[s]) < tol, f"states of request {i}"
    assert torch.equal(cache.temporal, ssm0), "verify must not touch the main SSM slots"
    live = {i for i, s in enumerate(slots) if s > 0}
    for r in range(cache.intermediate_ssm.shape[0]):
        if r not in live:
            assert torch.equal(cache.intermediate_ssm[r], issm0[r]), f"intermediate SSM row {r}"
            assert torch.equal(cache.intermediate_conv_window[0][r], iconv0[r]), f"window row {r}"
    for s in range(conv0.shape[0]):
        if s not in {x for x in slots if x > 0}:
            assert torch.equal(cache.conv[0][s], conv0[s]), f"conv slot {s} outside the batch"
    step = backend.forward_metadata.qla_verify
    assert (step.num_seqs, step.draft) == (N, D)


def test_verify_layer_cpu():
    _run("cpu", 2, 4, torch.float32, 3, seed=41)


def test_each_forward_pass_over_one_metadata_makes_its_step(monkeypatch):
    """SGLang 0.5.23 captures a target-verify graph (the decode runner's, with draft-token-wide
    requests) with one metadata object for two warmup passes and the captured pass
    (runner/decode_cuda_graph_runner.py:1400, runner_backend/full_cuda_graph_backend.py:162-182):
    the first GDN layer of every pass makes that pass's VerifyStep and derives its ids (for the
    captured pass: inside the graph), the pass's later layers share it."""
    from qla_serve import layer_ops

    derived = []
    real = layer_ops.slot_ids
    monkeypatch.setattr(layer_ops, "slot_ids", lambda *a, **k: derived.append(1) or real(*a, **k))
    slots, D = [5, 0, 17], 2
    backend, fb = _backend(slots, D, "cpu")
    model = []
    for layer_id, seed in ((2, 45), (6, 46)):
        cache, layer, x, a, b = _setup("cpu", 1, 2, torch.float32, D, slots, seed)
        layer.layer_id = layer_id
        model.append((cache, layer, x, a, b))
    passes = []
    for _ in range(3):
        steps = []
        for cache, layer, x, a, b in model:
            verify_layer.forward_verify(backend, layer, fb, x, a, b, cache, select_rows=_select_rows)
            steps.append(backend.forward_metadata.qla_verify)
        assert steps[0] is steps[1]
        passes.append(steps[0])
    assert len({id(step) for step in passes}) == 3
    assert len(derived) == 3, "one slot-id derivation per pass"


def test_verify_layer_refuses_a_ragged_batch():
    slots = [5, 7]
    cache, layer, x, a, b = _setup("cpu", 1, 2, torch.float32, 3, slots, 42)
    backend, fb = _backend(slots, 3, "cpu")
    with pytest.raises(ValueError, match=r"^mixed_qkv: expected draft_token_num \(3\) rows per request"):
        verify_layer.forward_verify(backend, layer, fb, x[:5], a[:5], b[:5], cache, select_rows=_select_rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hk,Hv,D", [(2, 8, 4), (4, 8, 2)])
def test_verify_layer_gpu(Hk, Hv, D, pool_dtype):
    _run("cuda", Hk, Hv, pool_dtype, D, seed=43)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verify_layer_in_a_cuda_graph():
    """SGLang's verify graph: captured once after two warmup passes over the same metadata, as
    SGLang does (the step's ids derived in each pass, in the graph for the captured one),
    replayed after SGLang rewrites its persistent index buffer in place: the same as eager calls
    on copies."""
    D, slots = 3, [4, 9, -1, 12]
    cache, layer, x, a, b = _setup("cuda", 2, 8, torch.float32, D, slots, 44)
    backend, fb = _backend(slots, D, "cuda")
    idx = backend.forward_metadata.mamba_cache_indices

    def forward(cache_, meta):
        backend_ = SimpleNamespace(forward_metadata=meta,
                                   verify_intermediate_state_indices=backend.verify_intermediate_state_indices,
                                   req_to_token_pool=SimpleNamespace(size=23))
        return verify_layer.forward_verify(backend_, layer, fb, x, a, b, cache_, select_rows=_select_rows)

    def copy(c):
        return SimpleNamespace(conv=[c.conv[0].clone()], temporal=c.temporal.clone(),
                               intermediate_ssm=c.intermediate_ssm.clone(),
                               intermediate_conv_window=[c.intermediate_conv_window[0].clone()])

    def meta_of(ids):
        return SimpleNamespace(mamba_cache_indices=ids, query_start_loc=backend.forward_metadata.query_start_loc)

    # SGLang's capture: one metadata object for two warmup passes and the captured one
    # (runner/decode_cuda_graph_runner.py:1400, runner_backend/full_cuda_graph_backend.py:162-182)
    captured = meta_of(idx)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            forward(copy(cache), captured)
    torch.cuda.current_stream().wait_stream(s)
    warm = captured.qla_verify
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = forward(cache, captured)
    assert captured.qla_verify is not warm
    for trial, new in enumerate(([7, 9, 21, -1], [0, 3, 4, 18], [11, -1, 0, 6])):
        idx.copy_(torch.tensor(new, dtype=torch.int32))
        ref_cache = copy(cache)
        ref = forward(ref_cache, meta_of(idx.clone()))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, ref), f"trial {trial}: out"
        for name in ("temporal", "intermediate_ssm"):
            assert torch.equal(getattr(cache, name), getattr(ref_cache, name)), f"trial {trial}: {name}"
        assert torch.equal(cache.conv[0], ref_cache.conv[0]), f"trial {trial}: conv"
        assert torch.equal(cache.intermediate_conv_window[0], ref_cache.intermediate_conv_window[0]), trial
