"""FlashQLAGDNKernel on a CUDA GPU with SGLang-shaped inputs, against the float64 oracle.

Needs no SGLang (the kernel class falls back to a plain base without it), so it runs on the lent
H200 with qla_serve's kernels: ``python -m pytest -m gpu tests/backends/sglang_plugin/test_kernel_gpu.py``.
Shapes as SGLang 0.5.23 passes them (tests/backends/sglang_plugin/_sglang_cases.py): strided q/k/v
views, unnormalised q/k, raw a/b for decode/verify, fp32 g/beta for extend, a poisoned
``[size+1, Hv, 128, 128]`` pool (fp32 and bf16) with padding ids 0 and -1, TP-local heads 2/8
(Qwen3.5-397B at TP8) and 4/8. Decode is also captured in a CUDA graph and replayed on new
inputs, as SGLang's decode graph runner does.
"""

from __future__ import annotations

import pytest
import torch

import _sglang_cases as C
from qla_serve.backends.sglang.kernel import ExtendBatch, FlashQLAGDNKernel

pytestmark = pytest.mark.gpu

DEV = "cuda"
HEADS = [(2, 8), (4, 8)]
POOL_DTYPES = [torch.float32, torch.bfloat16]


def _tol(pool_dtype):
    return 2e-2 if pool_dtype == torch.bfloat16 else 1e-2


def _check_slots(pool, pool0, finals, tol):
    for s, fin in finals.items():
        assert C.rel(pool[s], fin) < tol, f"slot {s}"
    untouched = [s for s in range(pool.shape[0]) if s not in finals]
    idx = torch.tensor(untouched, device=pool.device)
    assert torch.equal(pool[idx], pool0[idx]), "a slot outside the batch changed"


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("Hk,Hv", HEADS)
def test_decode_gpu(Hk, Hv, pool_dtype):
    gen = torch.Generator().manual_seed(11)
    S = 40
    slots = [5, 0, 17, -1, 3, 0, 39, 22]
    B = len(slots)
    q, k, v = C.mixed_views(B, Hk, Hv, torch.bfloat16, DEV, gen)
    a, b, A_log, dt_bias = C.raw_gates(B, Hv, torch.bfloat16, DEV, gen)
    pool = C.pool(S, Hv, pool_dtype, DEV, gen)
    pool0 = pool.clone()
    out = FlashQLAGDNKernel(("decode",)).decode(
        q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
        cache_indices=torch.tensor(slots, dtype=torch.int32, device=DEV),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=DEV))
    g, beta = C.gating64(a, b, A_log, dt_bias)
    o_ref, finals = C.oracle(q, k, v, g, beta, [1] * B, slots, pool0.cpu())
    assert not torch.isnan(out).any()
    assert C.rel(out[0], o_ref) < _tol(pool_dtype)
    for i, s in enumerate(slots):
        if s <= 0:
            assert torch.count_nonzero(out[0, i]) == 0
    _check_slots(pool, pool0, finals, _tol(pool_dtype))


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("Hk,Hv", HEADS)
def test_extend_gpu(Hk, Hv, pool_dtype):
    gen = torch.Generator().manual_seed(12)
    S = 16
    lens = [1000, 64, 1, 0, 300, 63]
    slots = [4, 9, 1, 0, 15, 7]
    n = sum(lens)
    T = n + 5                                     # physical padding tokens
    q, k, v = C.mixed_views(T, Hk, Hv, torch.bfloat16, DEV, gen)
    a, b, A_log, dt_bias = C.raw_gates(T, Hv, torch.bfloat16, DEV, gen)
    g64, beta64 = C.gating64(a, b, A_log, dt_bias)
    g, beta = g64.float()[None].to(DEV), beta64.float()[None].to(DEV)
    pool = C.pool(S, Hv, pool_dtype, DEV, gen)
    pool0 = pool.clone()
    qsl = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=DEV)
    kern = FlashQLAGDNKernel(("prefill",))
    kern.bind_batch(ExtendBatch(query_start_loc=qsl, seq_lens=tuple(lens), num_tokens=n))
    o, _, _ = kern.extend(q, k, v, g, beta, ssm_states=pool,
                          cache_indices=torch.tensor(slots, dtype=torch.int32, device=DEV), query_start_loc=qsl)
    o_ref, finals = C.oracle(q, k, v, g64, beta64, lens, slots, pool0.cpu())
    assert not torch.isnan(o).any()
    assert C.rel(o[0, :n], o_ref[:n]) < _tol(pool_dtype)
    assert torch.count_nonzero(o[0, n:]) == 0
    _check_slots(pool, pool0, finals, _tol(pool_dtype))


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_extend_track_snapshot_gpu(pool_dtype):
    """extra_buffer: the fp32 snapshot after track_chunk_idx chunks, through two gathered passes."""
    gen = torch.Generator().manual_seed(15)
    Hk, Hv, S = 2, 8, 10
    lens, slots, chunks = [700, 90, 64, 30], [2, 5, 9, 1], [10, -1, 0, 0]
    n = sum(lens)
    q, k, v = C.mixed_views(n, Hk, Hv, torch.bfloat16, DEV, gen)
    a, b, A_log, dt_bias = C.raw_gates(n, Hv, torch.bfloat16, DEV, gen)
    g64, beta64 = C.gating64(a, b, A_log, dt_bias)
    pool = C.pool(S, Hv, pool_dtype, DEV, gen)
    pool0 = pool.clone()
    qsl = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=DEV)
    kern = FlashQLAGDNKernel(("prefill",))
    kern.bind_batch(ExtendBatch(query_start_loc=qsl, seq_lens=tuple(lens), num_tokens=n, track_chunks=tuple(chunks)))
    track = torch.full((len(lens), Hv, 128, 128), 7.0, device=DEV)
    o, _, _ = kern.extend(q, k, v, g64.float()[None].to(DEV), beta64.float()[None].to(DEV), ssm_states=pool,
                          cache_indices=torch.tensor(slots, dtype=torch.int32, device=DEV), query_start_loc=qsl,
                          track_state=track, track_chunk_idx=torch.tensor(chunks, dtype=torch.int32, device=DEV))
    o_ref, finals = C.oracle(q, k, v, g64, beta64, lens, slots, pool0.cpu())
    assert C.rel(o[0], o_ref) < _tol(pool_dtype)
    _check_slots(pool, pool0, finals, _tol(pool_dtype))
    start = 0
    for i, (ln, s_, c) in enumerate(zip(lens, slots, chunks)):
        if c < 0:
            assert torch.all(track[i] == 7.0)
        else:
            cut = c * 64
            _, fin = C.oracle(q[:, start:start + cut], k[:, start:start + cut], v[:, start:start + cut],
                              g64[start:start + cut], beta64[start:start + cut], [cut], [s_], pool0.cpu())
            want = fin[s_] if cut else pool0[s_].double().cpu()
            assert C.rel(track[i], want) < _tol(pool_dtype), f"row {i}"
        start += ln


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_target_verify_gpu(pool_dtype):
    gen = torch.Generator().manual_seed(13)
    Hk, Hv, S, Dn = 2, 8, 12, 4
    slots = [3, -1, 8, 0, 11]
    N = len(slots)
    T = N * Dn
    q, k, v = C.mixed_views(T, Hk, Hv, torch.bfloat16, DEV, gen)
    a, b, A_log, dt_bias = C.raw_gates(T, Hv, torch.bfloat16, DEV, gen)
    pool = C.pool(S, Hv, pool_dtype, DEV, gen)
    pool0 = pool.clone()
    inter = (torch.randn(S + 1, Dn, Hv, 128, 128, generator=gen) * 0.1).to(DEV, pool_dtype)
    inter0 = inter.clone()
    out = FlashQLAGDNKernel(("verify",)).target_verify(
        A_log, dt_bias, q, k, v, a, b, ssm_states=pool,
        cache_indices=torch.tensor(slots, dtype=torch.int32, device=DEV),
        query_start_loc=torch.arange(0, T + 1, Dn, dtype=torch.int32, device=DEV),
        intermediate_states_buffer=inter,
        intermediate_state_indices=torch.arange(S + 1, dtype=torch.int32, device=DEV), cache_steps=Dn)
    g, beta = C.gating64(a, b, A_log, dt_bias)
    o_ref, states = C.verify_oracle(q, k, v, g, beta, [Dn] * N, slots, pool0.cpu())
    assert C.rel(out[0], o_ref) < _tol(pool_dtype)
    assert torch.equal(pool, pool0)
    for i, s in enumerate(slots):
        if s > 0:
            assert C.rel(inter[i], states[s]) < _tol(pool_dtype), f"request {i}"
        else:
            assert torch.equal(inter[i], inter0[i])


def test_decode_cuda_graph_replay():
    """Capture decode once (as SGLang's decode graph runner does), replay on new inputs in the
    same static buffers, compare with eager on a copy of the pool."""
    gen = torch.Generator().manual_seed(14)
    Hk, Hv, S, B = 2, 8, 20, 6
    kern = FlashQLAGDNKernel(("decode",))
    q, k, v = C.mixed_views(B, Hk, Hv, torch.bfloat16, DEV, gen)
    a, b, A_log, dt_bias = C.raw_gates(B, Hv, torch.bfloat16, DEV, gen)
    idx = torch.tensor([2, 7, -1, 11, 0, 19], dtype=torch.int32, device=DEV)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    pool = C.pool(S, Hv, torch.float32, DEV, gen)

    def step():
        return kern.decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
                           cache_indices=idx, query_start_loc=qsl)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()                                   # warm-up: compile/launch outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for trial in range(3):
        q2, k2, v2 = C.mixed_views(B, Hk, Hv, torch.bfloat16, DEV, gen)
        a2, b2, _, _ = C.raw_gates(B, Hv, torch.bfloat16, DEV, gen)
        for dst, src in ((q, q2), (k, k2), (v, v2), (a, a2), (b, b2)):
            dst.copy_(src)
        ref_pool = pool.clone()
        ref_out = kern.decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ref_pool,
                              cache_indices=idx, query_start_loc=qsl)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, ref_out), f"trial {trial}: replay != eager"
        assert torch.equal(pool, ref_pool), f"trial {trial}: replayed state != eager"
