"""FlashQLAGDNKernel on SGLang's pool layout against a float64 oracle (CPU, real sglang base class).

Inputs are shaped as SGLang 0.5.23's GDNAttnBackend passes them (tests/backends/sglang_plugin/_cases.py):
strided q/k/v views, unnormalised q/k, raw a/b for decode and verify, fp32 log-space g/beta for
extend, a ``[size+1, Hv, 128, 128]`` pool in fp32 or bf16 filled with random values. Checked:
outputs and final states of live requests; padding ids 0 (SGLang's dummy slot, also repeated)
and -1 give zero output and leave their slot alone; every slot not in the batch is bit-identical
afterwards; GVA (Hv = 2 Hk) and Hv = Hk; physical padding tokens past the logical batch.
On CPU qla_serve's ops run the torch reference path, so this checks the adapter (shapes, views,
slot mapping, gating, normalisation, plan, write-back), not TileLang numerics (test_kernel_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (.venv-sglang: bash scripts/setup_sglang_env.sh)")

from qla_serve.backends.sglang.kernel import ExtendBatch, FlashQLAGDNKernel  # noqa: E402
from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase  # noqa: E402

import _sglang_cases as C  # noqa: E402

pytestmark = pytest.mark.engine

POOL_DTYPES = [torch.float32, torch.bfloat16]
HEADS = [(2, 4), (2, 2)]


def _tol(pool_dtype):
    return 2e-2 if pool_dtype == torch.bfloat16 else 1e-2  # bf16 I/O (and a bf16 pool)


def test_is_sglang_kernel():
    k = FlashQLAGDNKernel(("decode",))
    assert isinstance(k, LinearAttnKernelBase)
    assert k.supports_packed_decode is False and k.uses_state_checkpoints is False
    assert k.supports_track_state_snapshot is True


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("Hk,Hv", HEADS)
def test_decode(Hk, Hv, pool_dtype):
    gen = torch.Generator().manual_seed(1)
    S = 9
    slots = [3, 0, 7, -1, 1, 0]          # 0 twice (eager padding) and -1 (graph padding)
    B = len(slots)
    q, k, v = C.mixed_views(B, Hk, Hv, torch.bfloat16, "cpu", gen)
    a, b, A_log, dt_bias = C.raw_gates(B, Hv, torch.bfloat16, "cpu", gen)
    pool = C.pool(S, Hv, pool_dtype, "cpu", gen)
    pool0 = pool.clone()
    idx = torch.tensor(slots, dtype=torch.int32)
    out = FlashQLAGDNKernel(("decode",)).decode(
        q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool, cache_indices=idx,
        query_start_loc=torch.arange(B + 1, dtype=torch.int32))
    assert out.shape == (1, B, Hv, 128) and out.dtype == q.dtype
    g, beta = C.gating64(a, b, A_log, dt_bias)
    o_ref, finals = C.oracle(q, k, v, g, beta, [1] * B, slots, pool0)
    assert C.rel(out[0], o_ref) < _tol(pool_dtype)
    for i, s in enumerate(slots):
        if s <= 0:
            assert torch.count_nonzero(out[0, i]) == 0, f"padding row {i} (slot {s}) must be zero"
    for s, fin in finals.items():
        assert C.rel(pool[s], fin) < _tol(pool_dtype), f"slot {s}"
    for s in range(S):
        if s not in finals:
            assert torch.equal(pool[s], pool0[s]), f"slot {s} not in the batch was changed"


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("Hk,Hv", HEADS)
@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
def test_extend(Hk, Hv, pool_dtype, planned):
    gen = torch.Generator().manual_seed(2)
    S = 8
    lens = [5, 70, 1, 0, 3]              # a 2-chunk request, a 1-token one, an empty padded row
    slots = [2, 5, 1, 0, 6]
    pad_tokens = 3                       # SGLang's physical padding past the logical tokens
    n = sum(lens)
    T = n + pad_tokens
    q, k, v = C.mixed_views(T, Hk, Hv, torch.bfloat16, "cpu", gen)
    a, b, A_log, dt_bias = C.raw_gates(T, Hv, torch.bfloat16, "cpu", gen)
    g64, beta64 = C.gating64(a, b, A_log, dt_bias)
    g, beta = g64.float().unsqueeze(0), beta64.float().unsqueeze(0)      # [1, T, Hv] fp32
    pool = C.pool(S, Hv, pool_dtype, "cpu", gen)
    pool0 = pool.clone()
    qsl = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    kern = FlashQLAGDNKernel(("prefill",))
    if planned:
        batch = ExtendBatch(query_start_loc=qsl, seq_lens=tuple(lens), num_tokens=n)
        kern.bind_batch(batch)
    o, last, h = kern.extend(q, k, v, g, beta, ssm_states=pool,
                             cache_indices=torch.tensor(slots, dtype=torch.int32), query_start_loc=qsl)
    assert last is None and h is None
    assert o.shape == (1, T, Hv, 128) and o.dtype == q.dtype
    if planned:
        assert batch.plan is not None and batch.plan.seq_lens == tuple(lens)  # cached for later layers
    o_ref, finals = C.oracle(q, k, v, g64, beta64, lens, slots, pool0)
    assert C.rel(o[0, :n], o_ref[:n]) < _tol(pool_dtype)
    assert torch.count_nonzero(o[0, n:]) == 0, "physical padding tokens must be zeroed"
    for s, fin in finals.items():
        assert C.rel(pool[s], fin) < _tol(pool_dtype), f"slot {s}"
    for s in range(S):
        if s not in finals:
            assert torch.equal(pool[s], pool0[s]), f"slot {s} not in the batch was changed"


def test_extend_writes_into_sglang_output_buffer():
    gen = torch.Generator().manual_seed(3)
    lens, slots, Hk, Hv = [4, 6], [1, 2], 2, 4
    T = sum(lens)
    q, k, v = C.mixed_views(T, Hk, Hv, torch.bfloat16, "cpu", gen)
    a, b, A_log, dt_bias = C.raw_gates(T, Hv, torch.bfloat16, "cpu", gen)
    g64, beta64 = C.gating64(a, b, A_log, dt_bias)
    pool = C.pool(4, Hv, torch.float32, "cpu", gen)
    qsl = torch.tensor([0, 4, 10], dtype=torch.int32)
    buf = torch.full((1, T, Hv, 128), float("nan"), dtype=torch.bfloat16)
    kern = FlashQLAGDNKernel(("prefill",))
    kern.bind_batch(ExtendBatch(query_start_loc=qsl, seq_lens=tuple(lens), num_tokens=T))
    o, _, _ = kern.extend(q, k, v, g64.float()[None], beta64.float()[None], ssm_states=pool,
                          cache_indices=torch.tensor(slots, dtype=torch.int32), query_start_loc=qsl,
                          output=buf)
    assert o.data_ptr() == buf.data_ptr() and not torch.isnan(buf).any()


def test_extend_refuses_what_it_cannot_do():
    kern = FlashQLAGDNKernel(("prefill",))
    x = torch.zeros(1, 2, 2, 128, dtype=torch.bfloat16)
    gb = torch.zeros(1, 2, 2)
    common = dict(ssm_states=torch.zeros(3, 2, 128, 128), cache_indices=torch.tensor([1], dtype=torch.int32),
                  query_start_loc=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="inplace_update"):
        kern.extend(x, x, x, gb, gb, inplace_update=False, **common)
    with pytest.raises(ValueError, match="track_chunk_idx"):
        kern.extend(x, x, x, gb, gb, track_state=torch.zeros(1, 2, 128, 128), **common)
    with pytest.raises(ValueError, match="snapshots after 64 tokens"):
        kern.extend(x, x, x, gb, gb, track_state=torch.zeros(1, 2, 128, 128),
                    track_chunk_idx=torch.tensor([1], dtype=torch.int32), **common)


@pytest.mark.parametrize("lens,chunks", [([70, 30], [0, 0]), ([64, 5], [1, -1])], ids=["no-head", "no-tail"])
def test_extend_track_snapshot_one_pass(lens, chunks):
    """Every cut at 0 (the head pass is empty) or at the end (the tail pass is empty)."""
    gen = torch.Generator().manual_seed(6)
    Hk, Hv, slots = 2, 2, [1, 2]
    n = sum(lens)
    q, k, v = C.mixed_views(n, Hk, Hv, torch.bfloat16, "cpu", gen)
    a, b, A_log, dt_bias = C.raw_gates(n, Hv, torch.bfloat16, "cpu", gen)
    g64, beta64 = C.gating64(a, b, A_log, dt_bias)
    pool = C.pool(3, Hv, torch.float32, "cpu", gen)
    pool0 = pool.clone()
    qsl = torch.tensor([0, lens[0], n], dtype=torch.int32)
    kern = FlashQLAGDNKernel(("prefill",))
    kern.bind_batch(ExtendBatch(query_start_loc=qsl, seq_lens=tuple(lens), num_tokens=n, track_chunks=tuple(chunks)))
    track = torch.zeros(2, Hv, 128, 128)
    o, _, _ = kern.extend(q, k, v, g64.float()[None], beta64.float()[None], ssm_states=pool,
                          cache_indices=torch.tensor(slots, dtype=torch.int32), query_start_loc=qsl,
                          track_state=track)
    o_ref, finals = C.oracle(q, k, v, g64, beta64, lens, slots, pool0)
    assert C.rel(o[0], o_ref) < 1e-2
    for s, fin in finals.items():
        assert C.rel(pool[s], fin) < 1e-2
    if chunks[0] == 0:
        assert torch.equal(track[0], pool0[1]) and torch.equal(track[1], pool0[2])  # initial states
    else:
        assert C.rel(track[0], finals[1]) < 1e-2 and torch.count_nonzero(track[1]) == 0


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("planned", [True, False], ids=["host-track-plan", "device-track-idx"])
def test_extend_track_snapshot(pool_dtype, planned):
    """extra_buffer radix cache: track_state[i] = state after track_chunk_idx[i] 64-token chunks of
    request i's extend (fp32), rows with -1 untouched; outputs and final states as without it."""
    gen = torch.Generator().manual_seed(5)
    Hk, Hv, S = 2, 4, 8
    lens = [150, 40, 70, 129, 0]
    slots = [3, 1, 6, 2, 0]
    chunks = [2, -1, 0, 1, -1]            # cut at 128, none, 0 (the initial state), 64, padding row
    n = sum(lens)
    q, k, v = C.mixed_views(n, Hk, Hv, torch.bfloat16, "cpu", gen)
    a, b, A_log, dt_bias = C.raw_gates(n, Hv, torch.bfloat16, "cpu", gen)
    g64, beta64 = C.gating64(a, b, A_log, dt_bias)
    pool = C.pool(S, Hv, pool_dtype, "cpu", gen)
    pool0 = pool.clone()
    qsl = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    kern = FlashQLAGDNKernel(("prefill",))
    batch = ExtendBatch(query_start_loc=qsl, seq_lens=tuple(lens), num_tokens=n,
                        track_chunks=tuple(chunks) if planned else None)
    kern.bind_batch(batch)
    track = torch.full((len(lens), Hv, 128, 128), 7.0)
    o, _, _ = kern.extend(q, k, v, g64.float()[None], beta64.float()[None], ssm_states=pool,
                          cache_indices=torch.tensor(slots, dtype=torch.int32), query_start_loc=qsl,
                          track_state=track, track_chunk_idx=torch.tensor(chunks, dtype=torch.int32))
    o_ref, finals = C.oracle(q, k, v, g64, beta64, lens, slots, pool0)
    assert C.rel(o[0], o_ref) < _tol(pool_dtype)
    for s, fin in finals.items():
        assert C.rel(pool[s], fin) < _tol(pool_dtype), f"slot {s}"
    start = 0
    for i, (ln, s, c) in enumerate(zip(lens, slots, chunks)):
        if c < 0:
            assert torch.all(track[i] == 7.0), f"row {i} has no snapshot but was written"
        else:
            cut = c * 64
            _, fin = C.oracle(q[:, start:start + cut], k[:, start:start + cut], v[:, start:start + cut],
                              g64[start:start + cut], beta64[start:start + cut], [cut], [s], pool0)
            want = fin[s] if cut else pool0[s].double()
            assert C.rel(track[i], want) < _tol(pool_dtype), f"row {i} snapshot"
        start += ln
    assert batch.split is not None and batch.track_chunks == tuple(chunks)


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("Hk,Hv", HEADS)
def test_target_verify(Hk, Hv, pool_dtype):
    gen = torch.Generator().manual_seed(4)
    S, Dn = 7, 3                          # pool slots, draft tokens per request
    slots = [4, -1, 2, 0]                 # graph padding (-1) and eager padding (0)
    N = len(slots)
    lens = [Dn] * N
    T = N * Dn
    q, k, v = C.mixed_views(T, Hk, Hv, torch.bfloat16, "cpu", gen)
    a, b, A_log, dt_bias = C.raw_gates(T, Hv, torch.bfloat16, "cpu", gen)
    pool = C.pool(S, Hv, pool_dtype, "cpu", gen)
    pool0 = pool.clone()
    inter = (torch.randn(S + 1, Dn, Hv, 128, 128, generator=gen) * 0.1).to(pool_dtype)
    inter0 = inter.clone()
    # SGLang's default intermediate ids are positional and longer than the batch.
    inter_ids = torch.arange(S + 1, dtype=torch.int32)
    qsl = torch.arange(0, T + 1, Dn, dtype=torch.int32)
    out = FlashQLAGDNKernel(("verify",)).target_verify(
        A_log, dt_bias, q, k, v, a, b, ssm_states=pool,
        cache_indices=torch.tensor(slots, dtype=torch.int32), query_start_loc=qsl,
        intermediate_states_buffer=inter, intermediate_state_indices=inter_ids, cache_steps=Dn,
        retrieve_parent_token=None)
    assert out.shape == v.shape and out.dtype == q.dtype
    g, beta = C.gating64(a, b, A_log, dt_bias)
    o_ref, states = C.verify_oracle(q, k, v, g, beta, lens, slots, pool0)
    assert C.rel(out[0], o_ref) < _tol(pool_dtype)
    assert torch.equal(pool, pool0), "verify must not touch the main slots"
    for i, s in enumerate(slots):
        if s > 0:
            assert C.rel(inter[i], states[s]) < _tol(pool_dtype), f"request {i}"
        else:
            assert torch.count_nonzero(out[0, i * Dn:(i + 1) * Dn]) == 0
            assert torch.equal(inter[i], inter0[i]), f"padding request {i} wrote its draft states"
    assert torch.equal(inter[N:], inter0[N:])


def test_target_verify_refuses_tree_drafts():
    with pytest.raises(NotImplementedError, match="linear draft chains"):
        FlashQLAGDNKernel(("verify",)).target_verify(
            None, None, None, None, None, None, None, ssm_states=None, cache_indices=None,
            query_start_loc=None, retrieve_parent_token=torch.zeros(1))
