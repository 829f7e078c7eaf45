"""The torch reference: the chunked and segmented (context-parallel) forms equal the per-token
recurrence, the gate-warmup form drops only decayed history; decode and verify
agree with prefill; pool-level semantics (slots, padding, has_initial_state, strides)."""

import pytest
import torch

import qla_serve
from qla_serve.kernels import reference as R

from gdn_inputs import make_inputs, rel_err

CASES = [([64], 2, 8), ([1, 63, 64, 65], 2, 4), ([0, 130, 0, 7], 1, 2), ([200], 4, 4)]


@pytest.mark.parametrize("seq_lens,Hk,Hv", CASES)
def test_chunked_equals_recurrent_float64(seq_lens, Hk, Hv):
    q, k, v, g, beta = make_inputs(seq_lens, Hk, Hv, seed=sum(seq_lens))
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    init = torch.randn(len(seq_lens), Hv, 128, 128, dtype=torch.float64) * 0.1
    o1, s1 = R.recurrent_gdn(q, k, v, g, beta, cu, init)
    o2, s2 = R.chunked_gdn(q, k, v, g, beta, cu, init)
    assert rel_err(o2, o1) < 1e-10
    assert rel_err(s2, s1) < 1e-10


@pytest.mark.parametrize("seq_lens,Hk,Hv,segment_chunks", [
    ([64 * 9 + 5], 2, 8, 2), ([1, 300, 0, 129], 2, 4, 1), ([700, 65], 1, 2, 3), ([200], 4, 4, 8)])
def test_segmented_equals_recurrent_float64(seq_lens, Hk, Hv, segment_chunks):
    """The exact context-parallel algebra (segment maps S_end = Phi S_start + S0, a scan, then
    the segments from their own initial states) is the recurrence, including heads with g = 0
    (no decay, so no warmup could truncate them) and segments longer than the sequence."""
    q, k, v, g, beta = make_inputs(seq_lens, Hk, Hv, seed=len(seq_lens) + segment_chunks)
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    init = torch.randn(len(seq_lens), Hv, 128, 128, dtype=torch.float64) * 0.1
    o1, s1 = R.recurrent_gdn(q, k, v, g, beta, cu, init)
    o2, s2 = R.segmented_gdn(q, k, v, g, beta, cu, init, segment_chunks=segment_chunks)
    assert rel_err(o2, o1) < 1e-10
    assert rel_err(s2, s1) < 1e-10


@pytest.mark.parametrize("solve", ["blocked_solve", "block_substitution_solve"])
@pytest.mark.parametrize("n_valid", [64, 50, 1])
def test_blocked_solve_equals_triangular_solve(n_valid, solve):
    """Stage 1's blocked inverses (reference.blocked_solve, the algebra of prefill_prep._solve;
    reference.block_substitution_solve, that of the mma solve in csrc/block_solve.cuh) are
    A diag(beta) from the triangular solve, exactly in float64; rows past n_valid have
    beta = 0 (a chunk's padding) and give zero columns. With their operands rounded to fp16, as
    the kernels keep them, both are ~2.0-2.1e-4 off here (relative L2; bound 1e-3): the
    solve's share of the outputs' 2e-3 budget (the kernels' own outputs are checked on the GPU,
    tests/kernels/test_prefill_gpu.py)."""
    solve_fn = getattr(R, solve)
    torch.manual_seed(n_valid)
    k = torch.nn.functional.normalize(torch.randn(3, 64, 128, dtype=torch.float64), dim=-1)
    beta = torch.rand(3, 64, dtype=torch.float64) * 0.98 + 0.01
    beta[:, n_valid:] = 0
    kkt = k @ k.transpose(-1, -2)
    eye = torch.eye(64, dtype=torch.float64)
    strict = torch.tril(torch.ones(64, 64, dtype=torch.bool), -1)
    A = torch.linalg.solve_triangular(eye + (beta[..., :, None] * kkt).masked_fill(~strict, 0),
                                      eye.expand(3, 64, 64), upper=False, unitriangular=True)
    want = A * beta[..., None, :]
    got = solve_fn(kkt, beta)
    assert (got - want).abs().max() < 1e-12
    assert torch.equal(torch.triu(got, 1), torch.zeros_like(got))
    assert not got[..., n_valid:].any()
    rounded = solve_fn(kkt.float(), beta.float(), operand_dtype=torch.float16).double()
    assert rel_err(rounded, want) < 1e-3


def test_chunked_float32_close_to_float64():
    seq_lens, Hk, Hv = [150, 40], 2, 4
    q, k, v, g, beta = make_inputs(seq_lens, Hk, Hv, seed=7)
    cu = [0, 150, 190]
    o64, s64 = R.recurrent_gdn(q, k, v, g, beta, cu)
    o32, s32 = R.chunked_gdn(q.float(), k.float(), v.float(), g.float(), beta.float(), cu)
    assert o32.dtype == torch.float32
    assert rel_err(o32, o64) < 1e-5
    assert rel_err(s32, s64) < 1e-5


def test_recurrence_matches_closed_form_single_token():
    """One token from state S0: S1 = a S0 (I - b k k^T) + b v k^T, o = scale S1 q."""
    q, k, v, g, beta = make_inputs([1], 1, 1, seed=3)
    S0 = torch.randn(1, 1, 128, 128, dtype=torch.float64)
    o, S1 = R.recurrent_gdn(q, k, v, g, beta, [0, 1], S0)
    a, b, kk, vv = torch.exp(g[0, 0]), beta[0, 0], k[0, 0], v[0, 0]
    want = a * S0[0, 0] @ (torch.eye(128, dtype=torch.float64) - b * torch.outer(kk, kk)) + b * torch.outer(vv, kk)
    assert torch.allclose(S1[0, 0], want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(o[0, 0], 128 ** -0.5 * want @ q[0, 0], rtol=1e-12, atol=1e-12)


def test_decode_steps_equal_prefill():
    T, Hk, Hv = 9, 2, 4
    q, k, v, g, beta = make_inputs([T], Hk, Hv, seed=11, dtype=torch.float32)
    pool_a = torch.randn(3, Hv, 128, 128) * 0.1
    pool_b = pool_a.clone()
    slot = torch.tensor([2], dtype=torch.int32)
    plan = qla_serve.plan_prefill([T], Hv, Hk, device="cpu")
    o_pre = qla_serve.gdn_prefill(q, k, v, g, beta, pool_a, slot, plan)
    outs = [qla_serve.gdn_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], pool_b, slot,
                                 g=g[t:t + 1], beta=beta[t:t + 1]) for t in range(T)]
    assert rel_err(torch.cat(outs), o_pre) < 1e-5
    assert rel_err(pool_b[2], pool_a[2]) < 1e-5
    assert torch.equal(pool_a[:2], pool_b[:2])


def test_decode_fused_gating_and_l2norm():
    B, Hk, Hv = 3, 1, 2
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(B, Hk, 128, generator=gen) * 3, torch.randn(B, Hk, 128, generator=gen) * 3
    v = torch.randn(B, Hv, 128, generator=gen)
    a, b = torch.randn(B, Hv, generator=gen), torch.randn(B, Hv, generator=gen)
    A_log, dt_bias = torch.randn(Hv, generator=gen) * 0.5, torch.randn(Hv, generator=gen)
    pool1 = torch.randn(4, Hv, 128, 128, generator=gen) * 0.1
    pool2 = pool1.clone()
    ids = torch.tensor([3, -1, 0], dtype=torch.int32)
    o1 = qla_serve.gdn_decode(q, k, v, pool1, ids, a=a, b=b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True)
    g = -torch.exp(A_log) * torch.nn.functional.softplus(a + dt_bias)
    o2 = qla_serve.gdn_decode(R.l2norm(q), R.l2norm(k), v, pool2, ids, g=g, beta=torch.sigmoid(b))
    assert torch.allclose(o1, o2, atol=1e-6)
    assert torch.equal(o1[1], torch.zeros_like(o1[1]))  # padding row: zero output
    assert torch.allclose(pool1, pool2, atol=1e-6)


def test_verify_intermediates_equal_sequential_decode_and_commit():
    lens, Hk, Hv = [3, 1, 2], 1, 2
    q, k, v, g, beta = make_inputs(lens, Hk, Hv, seed=13, dtype=torch.float32)
    pool = torch.randn(5, Hv, 128, 128) * 0.1
    before = pool.clone()
    slots = torch.tensor([4, -1, 1], dtype=torch.int32)
    inter = torch.full((3, 3, Hv, 128, 128), float("nan"))
    inter_ids = torch.tensor([2, 0, 1], dtype=torch.int32)
    cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    o = qla_serve.gdn_verify(q, k, v, pool, slots, cu, inter, inter_ids, g=g, beta=beta)
    assert torch.equal(pool, before)                      # main slots untouched
    seq_pool = before.clone()
    for i, (s, e) in enumerate([(0, 3), (3, 4), (4, 6)]):
        for t in range(s, e):
            od = qla_serve.gdn_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], seq_pool, slots[i:i + 1],
                                      g=g[t:t + 1], beta=beta[t:t + 1])
            assert rel_err(o[t:t + 1], od) < 1e-6 if slots[i] >= 0 else torch.equal(o[t], torch.zeros_like(o[t]))
            if slots[i] >= 0:
                assert rel_err(inter[inter_ids[i], t - s], seq_pool[slots[i]]) < 1e-6
    assert torch.isnan(inter[0]).all()                    # padding sequence wrote nothing
    qla_serve.commit_verified(pool, slots, inter, inter_ids, torch.tensor([2, 1, 0]))
    assert torch.equal(pool[4], inter[2, 1])
    assert torch.equal(pool[1], before[1])                # 0 accepted: slot kept
    assert torch.equal(pool[[0, 2, 3]], before[[0, 2, 3]])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefill_pool_semantics(pool_dtype):
    """Padding slots untouched, has_initial_state False ignores the slot, 0-length sequences
    keep (or zero) their state, a strided (paged) pool is written in place."""
    lens, Hk, Hv = [70, 0, 5, 0, 33], 2, 4
    q, k, v, g, beta = make_inputs(lens, Hk, Hv, seed=17, dtype=torch.float32)
    pages = torch.randn(8, 2, Hv, 128, 128).to(pool_dtype)       # page = slot + other data
    pool = pages[:, 0]                                             # stride(0) = 2 slots
    assert pool.stride(0) == 2 * Hv * 128 * 128
    before = pages.clone()
    slots = torch.tensor([5, 2, -1, 7, 0], dtype=torch.int32)
    has_init = torch.tensor([True, False, True, True, False])
    plan = qla_serve.plan_prefill(lens, Hv, Hk, device="cpu")
    o = qla_serve.gdn_prefill(q, k, v, g, beta, pool, slots, plan, has_initial_state=has_init)
    init = before[:, 0].double()[[5, 2, 0, 7, 0]]
    init[[1, 2, 4]] = 0                                            # no initial state / padding
    o_ref, s_ref = R.recurrent_gdn(q, k, v, g, beta, plan.cu_seqlens_cpu, init)
    cu = plan.cu_seqlens_cpu
    assert torch.count_nonzero(o[cu[2]:cu[3]]) == 0                 # the padding sequence's rows: zeros
    o_ref[cu[2]:cu[3]] = 0
    tol = 2e-3 if pool_dtype == torch.float32 else 1e-2
    assert rel_err(o, o_ref) < tol
    live = [0, 1, 3, 4]
    assert rel_err(pool[slots[live].long()], s_ref[live]) < tol
    assert torch.equal(pool[2], torch.zeros_like(pool[2]))        # empty seq, no initial state
    assert torch.equal(pages[:, 1], before[:, 1])                  # the rest of each page
    assert torch.equal(pages[[1, 3, 4, 6], 0], before[[1, 3, 4, 6], 0])  # slots outside the batch


def test_prefill_follows_a_cp_plan():
    """On the reference path a "cp" plan runs the exact segmented form (its segment length
    taken from the plan): same results as the recurrence, final states in the pool slots."""
    from qla_serve.plan import force_plan

    lens, Hk, Hv = [64 * 5 + 3, 0, 129], 2, 4
    q, k, v, g, beta = make_inputs(lens, Hk, Hv, seed=23)
    pool = torch.randn(4, Hv, 128, 128, dtype=torch.float64) * 0.1
    before = pool.clone()
    slots = torch.tensor([3, 1, 0], dtype=torch.int32)
    plan = qla_serve.plan_prefill(lens, Hv, Hk, device="cpu", cp="exact")
    plan = force_plan(plan, "cp", 1, 2)
    out = torch.empty_like(v)
    R.prefill(q, k, v, g, beta, pool, slots, plan, has_initial_state=None, scale=None, out=out)
    o_ref, s_ref = R.recurrent_gdn(q, k, v, g, beta, plan.cu_seqlens_cpu, before[[3, 1, 0]])
    assert rel_err(out, o_ref) < 1e-10
    assert rel_err(pool[[3, 1, 0]], s_ref) < 1e-10
    assert torch.equal(pool[2], before[2])
    with pytest.raises(ValueError, match="form"):
        R.prefill(q, k, v, g, beta, pool, slots, plan, has_initial_state=None, scale=None, out=out,
                  form="segmented")


def test_warmup_start_chunks():
    """The latest chunk whose summed log decay up to the segment passes the threshold; 0 (whole
    history, exact) for a head that never decays that far."""
    g = torch.zeros(64 * 6, 3, dtype=torch.float64)
    g[:, 1] = -0.1            # -6.4 per chunk: two chunks pass -10
    g[:64 * 3, 2] = -1.0      # decays only in chunks 0-2
    assert R.warmup_start_chunks(g, 5) == [0, 3, 2]
    assert R.warmup_start_chunks(g, 0) == [0, 0, 0]
    assert R.warmup_start_chunks(g, 5, threshold=-1e9) == [0, 0, 0]


def test_warmup_form_truncates_only_what_decayed():
    """Gate warmup against the recurrence (float64): exact with an unreachable threshold; with
    the default e^-10 the dropped history moves o and the final state by far less than the
    kernels' 2e-3 budget, on inputs where most heads do truncate (g in [-0.3, 0]: ~2 chunks of
    warmup) while the g = 0 heads keep their whole history."""
    seq_lens, Hk, Hv, L = [64 * 12 + 9, 130], 2, 8, 2
    q, k, v, g, beta = make_inputs(seq_lens, Hk, Hv, seed=41)
    cu = [0, seq_lens[0], sum(seq_lens)]
    init = torch.randn(2, Hv, 128, 128, dtype=torch.float64) * 0.1
    o1, s1 = R.recurrent_gdn(q, k, v, g, beta, cu, init)
    o2, s2 = R.warmup_gdn(q, k, v, g, beta, cu, init, segment_chunks=L, threshold=-1e9)
    assert rel_err(o2, o1) < 1e-10 and rel_err(s2, s1) < 1e-10
    starts = R.warmup_start_chunks(g[: seq_lens[0]], 10)
    assert starts[: Hv // 4] == [0] * (Hv // 4) and all(0 < w < 10 for w in starts[Hv // 4:])
    o3, s3 = R.warmup_gdn(q, k, v, g, beta, cu, init, segment_chunks=L)
    e_o, e_s = rel_err(o3, o1), rel_err(s3, s1)
    assert 1e-9 < e_o < 1e-4 and 1e-9 < e_s < 1e-4, (e_o, e_s)  # truncated, and by little
    # History before a head's warmup start is really dropped: changing v in chunk 0 leaves that
    # head's outputs from chunk 10 on unchanged (the recurrence's change), unlike a g = 0 head's.
    v2 = v.clone()
    v2[:64] += 1.0
    o4, _ = R.warmup_gdn(q, k, v2, g, beta, cu, init, segment_chunks=L)
    late = slice(64 * 10, seq_lens[0])
    assert torch.equal(o4[late, Hv - 1], o3[late, Hv - 1])
    assert not torch.equal(o4[late, 0], o3[late, 0])
