"""The layer ops' TileLang kernels (kernels/hopper/conv.py, decode.py's verify_slots) against the
torch reference (kernels/reference_conv.py) on fresh random inputs, on the lent H200 (marker
gpu). The reference's own truth is the float64 layer oracle (tests/backends/test_gdn_layer.py,
tests/test_layer_ops.py on CPU). Every cache slot outside the batch is poisoned and must stay
bit-identical; slots that start new sequences hold NaN, which must never be read.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from qla_serve import layer_ops, plan_prefill
from qla_serve.kernels import reference_conv
from qla_serve.kernels.hopper import conv as conv_kernels

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEAD = 128


def _conv_cache(S, dim, L, dtype, layout, gen):
    raw = torch.randn(S, dim, L, generator=gen) if layout == "dim_first" else \
        torch.randn(S, L, dim, generator=gen).transpose(1, 2)
    return raw.to("cuda", dtype)


def _rel(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _weights(dim, W, dtype, gen, bias):
    w = (torch.randn(dim, W, generator=gen) * 0.5).to("cuda", dtype)
    return w, ((torch.randn(dim, generator=gen) * 0.1).to("cuda", dtype) if bias else None)


@pytest.mark.parametrize("hk,hv", [(2, 8), (4, 16)])
@pytest.mark.parametrize("layout", ["dim_first", "seq_first"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dt_bias_dtype", [torch.float32, torch.bfloat16])   # bf16: vLLM's layer
# steps per half-warp walk: 3 (sequences cross walks; gate CTAs of 96 tokens, the last partial), 8, 32
# (one gate CTA of 1024 tokens for the 571: rounds past the batch's end)
@pytest.mark.parametrize("walk", [None, 3, 8, 32])
# (conv.FAST_STEPS: straight-line steps inside sequences, and the checked steps alone)
@pytest.mark.parametrize("fast", [True, False])
def test_conv_prefill_matches_reference(hk, hv, layout, bias, dt_bias_dtype, walk, fast, monkeypatch):
    if walk is not None:   # the host's choice is 1 at this size; force a longer walk
        monkeypatch.setattr(conv_kernels, "WALK_STEPS", walk)
    monkeypatch.setattr(conv_kernels, "FAST_STEPS", fast)
    _check_conv_prefill(hk, hv, [70, 0, 1, 2, 3, 333, 1, 64, 97], [3, -1, 5, 7, 9, 11, 13, 15, 17],
                        [True, False, False, True, True, False, True, True, True], layout, bias, dt_bias_dtype,
                        seed=hk * 100 + hv + bias)


# conv_prefill's fixed forms beside the default rule (conv.py, PREFILL_LANE_CHANNELS = "auto" and
# PREFILL_ROW_OFFSETS = True pick one per call): 4 channels per lane (a warp per 128-channel row,
# 8-byte pieces, 4 walkers per CTA), the rows' cp.async addresses from one offset, and both; the
# walk lengths, the checked steps alone, random batches and the widths below run them too, and
# the plain form (8, False)
FIXED_FORMS = [(4, False), (8, True), (4, True)]


def _conv_form(monkeypatch, lanes, offsets):
    """conv_prefill's form for this test: channels per lane and row offsets (conv.py's switches)."""
    monkeypatch.setattr(conv_kernels, "PREFILL_LANE_CHANNELS", lanes)
    monkeypatch.setattr(conv_kernels, "PREFILL_ROW_OFFSETS", offsets)


@pytest.mark.parametrize("hk,hv", [(2, 8), (4, 16)])
@pytest.mark.parametrize("walk", [None, 3])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("lanes,offsets", FIXED_FORMS)
def test_conv_prefill_fixed_forms(hk, hv, walk, fast, lanes, offsets, monkeypatch):
    _conv_form(monkeypatch, lanes, offsets)
    if walk is not None:
        monkeypatch.setattr(conv_kernels, "WALK_STEPS", walk)
    monkeypatch.setattr(conv_kernels, "FAST_STEPS", fast)
    _check_conv_prefill(hk, hv, [70, 0, 1, 2, 3, 333, 1, 64, 97], [3, -1, 5, 7, 9, 11, 13, 15, 17],
                        [True, False, False, True, True, False, True, True, True], "seq_first", True,
                        torch.float32, seed=hk * 100 + hv + 7)


# steps per walk: ranges of 4, 8, 12, 16 and 20 tokens (8-channel lanes; twice that for 4), so
# that many sequences' first W - 1 tokens (the ones that read the old window) straddle a range
# boundary; 4 steps: the 4-lane walk that conv.HALVE_WALKS takes
@pytest.mark.parametrize("walk", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
# conv.WINDOW_CTAS: the sequences' first W - 1 tokens and their windows in the conv grid's window
# CTAs, or the walkers' history taps and the after_conv write-back kernel (the form before it)
@pytest.mark.parametrize("windows", [True, False])
@pytest.mark.parametrize("lanes,offsets", [(8, False)] + FIXED_FORMS)
def test_conv_prefill_on_random_batches(walk, seed, windows, lanes, offsets, monkeypatch):
    """Random batches of mostly short sequences (0-7 tokens, a few long ones; empty sequences with
    and without a history, padding slots) through conv_prefill and its conv-state write-back,
    against the reference: outputs, every live slot's new window bit-exact, every other slot
    bit-identical."""
    monkeypatch.setattr(conv_kernels, "WALK_STEPS", walk)
    monkeypatch.setattr(conv_kernels, "WINDOW_CTAS", windows)
    _conv_form(monkeypatch, lanes, offsets)
    gen = torch.Generator().manual_seed(1000 + seed)
    N = 48
    lens = torch.randint(0, 8, (N,), generator=gen)
    lens[torch.randperm(N, generator=gen)[:3]] = torch.randint(20, 90, (3,), generator=gen)
    slots = (torch.randperm(2 * N, generator=gen)[:N] + 1).tolist()
    for i in torch.randperm(N, generator=gen)[:4].tolist():
        slots[i] = -1                                       # padding
    has = (torch.rand(N, generator=gen) < 0.6).tolist()
    _check_conv_prefill(2, 8, lens.tolist(), slots, has, "seq_first", True, torch.float32, seed=seed,
                        num_slots=2 * N + 1)


@pytest.mark.parametrize("hk,hv,lens", [(2, 8, [8192]), (2, 8, [512] * 16), (4, 16, [700, 0, 1, 3, 2048, 65])])
@pytest.mark.parametrize("lanes", [4, 8])
def test_conv_prefill_load_hint_changes_nothing(hk, hv, lens, lanes, monkeypatch):
    """conv.PREFILL_LOAD_HINT (the row copies under an L2::evict_first policy, the default) is a
    cache policy only: q, k, v, g, beta and the conv state bit-identical to the copies without it
    on the same inputs (the fixed forms' tests above run the default hint against the reference)."""
    monkeypatch.setattr(conv_kernels, "PREFILL_LANE_CHANNELS", lanes)
    monkeypatch.setattr(conv_kernels, "PREFILL_ROW_OFFSETS", True)
    gen = torch.Generator().manual_seed(77 + lanes + len(lens))
    dim, T, N = (2 * hk + hv) * HEAD, sum(lens), len(lens)
    x = torch.randn(T, dim, generator=gen).to("cuda", torch.bfloat16)
    a, b = (torch.randn(T, hv, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    A_log, dt_bias = (torch.rand(hv, generator=gen) - 1.0).cuda(), (torch.randn(hv, generator=gen) * 0.1).cuda()
    w, bv = _weights(dim, 4, torch.bfloat16, gen, True)
    cs0 = _conv_cache(N + 2, dim, 3, torch.bfloat16, "seq_first", gen)
    plan = plan_prefill(lens, hv, hk, device="cuda")
    ids = torch.arange(1, N + 1, dtype=torch.int32, device="cuda")
    has = torch.rand(N, generator=gen).cuda() < 0.5
    outs = {}
    for hint in (None, "evict_first"):
        monkeypatch.setattr(conv_kernels, "PREFILL_LOAD_HINT", hint)
        cs = cs0.clone()
        got = layer_ops.gdn_layer_prefill_inputs(x, a, b, cs, ids, plan, conv_weight=w, conv_bias=bv,
                                                 has_initial_state=has, A_log=A_log, dt_bias=dt_bias,
                                                 num_k_heads=hk, qk_dtype=torch.float16)
        outs[hint] = [t.clone() for t in got] + [cs]
    for name, plain, hinted in zip("q k v g beta conv_state".split(), outs[None], outs["evict_first"]):
        assert torch.equal(plain, hinted), name


# widths other than Qwen's 4: one history column (W = 2: a window of one token), and more history
# columns (W = 6: 5) than a walk step's 4 tokens (the window CTAs then take two steps)
@pytest.mark.parametrize("width", [2, 6])
@pytest.mark.parametrize("layout", ["dim_first", "seq_first"])
@pytest.mark.parametrize("lanes,offsets", [(8, False)] + FIXED_FORMS)
def test_conv_prefill_widths(width, layout, lanes, offsets, monkeypatch):
    _conv_form(monkeypatch, lanes, offsets)
    gen = torch.Generator().manual_seed(50 + width)
    N = 24
    lens = torch.randint(0, 9, (N,), generator=gen)
    lens[:2] = torch.tensor([40, 77])
    slots = (torch.randperm(2 * N, generator=gen)[:N] + 1).tolist()
    slots[5] = -1
    has = (torch.rand(N, generator=gen) < 0.6).tolist()
    _check_conv_prefill(2, 8, lens.tolist(), slots, has, layout, True, torch.float32, seed=width,
                        num_slots=2 * N + 1, width=width)


def _check_conv_prefill(hk, hv, lens, slots, has, layout, bias, dt_bias_dtype, seed, num_slots=24, width=4):
    """layer_ops.gdn_layer_prefill_inputs on random inputs for sequences of ``lens`` in ``slots``
    (-1: padding; a slot without a history filled with NaN) against reference_conv.conv_prefill."""
    gen = torch.Generator().manual_seed(seed)
    dim, W, S = (2 * hk + hv) * HEAD, width, num_slots
    T = sum(lens)
    x = torch.randn(T, dim + 64, generator=gen).to("cuda", torch.bfloat16)[:, 32:32 + dim]  # row-strided
    a, b = (torch.randn(T, hv, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    A_log = (torch.rand(hv, generator=gen) - 1.0).cuda()
    dt_bias = (torch.randn(hv, generator=gen) * 0.1).to("cuda", dt_bias_dtype)
    w, bv = _weights(dim, W, torch.bfloat16, gen, bias)
    cs = _conv_cache(S, dim, W - 1, torch.bfloat16, layout, gen)
    for s, h in zip(slots, has):
        if s >= 0 and not h:
            cs[s].fill_(float("nan"))       # a recycled slot: never read
    ref_cs = cs.clone()
    plan = plan_prefill(lens, hv, hk, device="cuda")
    ids = torch.tensor(slots, dtype=torch.int32, device="cuda")
    hi = torch.tensor(has, device="cuda")
    got = layer_ops.gdn_layer_prefill_inputs(x, a, b, cs, ids, plan, conv_weight=w, conv_bias=bv,
                                             has_initial_state=hi, A_log=A_log, dt_bias=dt_bias,
                                             num_k_heads=hk, qk_dtype=torch.float16)
    want = [torch.empty_like(t) for t in got]
    reference_conv.conv_prefill(x, ref_cs, w, bv, ids, hi.view(torch.int8), plan.cu_seqlens, a, b, A_log,
                                dt_bias, activation="silu", q_out=want[0], k_out=want[1], v_out=want[2],
                                g_out=want[3], beta_out=want[4])
    for name, g_, w_ in zip("q k v g beta".split(), got, want):
        assert torch.isfinite(g_).all(), name
        assert _rel(g_, w_) < 4e-3, f"{name}: rel {_rel(g_, w_):.2e}"
    live = [s for s in slots if s >= 0]
    for s in range(S):
        if s in live:
            # the window is the inputs' (or the old window's) values, copied: bit-exact
            assert torch.equal(cs[s], ref_cs[s]), f"conv slot {s}"
        else:
            assert torch.equal(cs[s].nan_to_num(7.0), ref_cs[s].nan_to_num(7.0)), f"conv slot {s} touched"


# decode rows: one, a few (one of them padding), and 300 (the separate conv_decode then runs
# conv.DECODE_SEQS sequences per thread)
@pytest.mark.parametrize("B", [1, 5, 300])
@pytest.mark.parametrize("layout", ["dim_first", "seq_first"])
@pytest.mark.parametrize("lanes,offsets", [(8, False)] + FIXED_FORMS)
def test_conv_prefill_with_decode_rows_matches_two_launches(B, layout, lanes, offsets, monkeypatch):
    """A mixed step's decode rows convolved by the prefill conv's decode CTAs
    (gdn_layer_prefill_inputs' _decodes, gdn_layer.MIXED_CONV) give bit for bit what the prefill
    conv and causal_conv_decode give as two launches: q, k, v, g, beta, the decode rows' outputs
    and every conv slot (prefill windows written back, decode windows shifted, the others
    untouched)."""
    _conv_form(monkeypatch, lanes, offsets)
    gen = torch.Generator().manual_seed(90 + B)
    hk, hv, W = 2, 8, 4
    dim = (2 * hk + hv) * HEAD
    lens, has = [70, 5, 0, 130], [True, False, True, True]
    S = B + 12
    pre_slots = [B + 1, B + 2, B + 3, B + 4]
    dec_slots = list(range(1, B + 1))
    if B > 1:
        dec_slots[2] = -1                                   # padding
    T = sum(lens)
    x = torch.randn(B + T, dim + 64, generator=gen).to("cuda", torch.bfloat16)[:, :dim]   # row-strided
    xd, xp = x[:B], x[B:]
    a, b = (torch.randn(T, hv, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    A_log = (torch.rand(hv, generator=gen) - 1.0).cuda()
    dt_bias = (torch.randn(hv, generator=gen) * 0.1).cuda()
    w, bv = _weights(dim, W, torch.bfloat16, gen, True)
    cs0 = _conv_cache(S, dim, W - 1, torch.bfloat16, layout, gen)
    plan = plan_prefill(lens, hv, hk, device="cuda")
    ids = torch.tensor(pre_slots, dtype=torch.int32, device="cuda")
    dids = torch.tensor(dec_slots, dtype=torch.int32, device="cuda")
    hi = torch.tensor(has, device="cuda")
    got = {}
    for fused in (True, False):
        cs = cs0.clone()
        y = torch.full((B, dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        kw = dict(conv_weight=w, conv_bias=bv, has_initial_state=hi, A_log=A_log, dt_bias=dt_bias, num_k_heads=hk,
                  qk_dtype=torch.float16)
        if fused:
            outs = layer_ops.gdn_layer_prefill_inputs(xp, a, b, cs, ids, plan, _decodes=(xd, dids, y), **kw)
        else:
            layer_ops.causal_conv_decode(xd, cs, dids, conv_weight=w, conv_bias=bv, num_v_heads=hv, out=y)
            outs = layer_ops.gdn_layer_prefill_inputs(xp, a, b, cs, ids, plan, **kw)
        got[fused] = (*outs, y, cs)
    for name, f, s in zip("q k v g beta y conv_state".split(), got[True], got[False]):
        assert torch.equal(f.nan_to_num(7.0), s.nan_to_num(7.0)), name
    assert not torch.equal(got[True][-1], cs0)        # the windows moved


# B = 256: 3072 one-sequence blocks, so conv.DECODE_SEQS per thread; 7 and 1 below the bound: one per
# thread, or (four_per_thread) the DECODE_SEQS form forced, whose last group is partial
@pytest.mark.parametrize("B,four_per_thread", [(256, False), (7, False), (1, False), (7, True), (1, True)])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_conv_decode_matches_reference(state_dtype, B, four_per_thread, monkeypatch):
    if four_per_thread:
        monkeypatch.setattr(conv_kernels, "DECODE_SEQS_MIN_BLOCKS", 0)
    gen = torch.Generator().manual_seed(7 + B)
    hk, hv, W, S = 2, 8, 4, 300
    dim = (2 * hk + hv) * HEAD
    x = torch.randn(B, dim, generator=gen).to("cuda", torch.bfloat16)
    w, bv = _weights(dim, W, torch.bfloat16, gen, True)
    cs = _conv_cache(S, dim, W - 1, state_dtype, "seq_first", gen)
    ref_cs = cs.clone()
    ids = torch.randperm(S - 1, generator=gen)[:B].to(torch.int32) + 1
    ids[::17] = -1
    ids = ids.cuda()
    y = layer_ops.causal_conv_decode(x, cs, ids, conv_weight=w, conv_bias=bv, num_v_heads=hv)
    want = torch.empty_like(y)
    reference_conv.conv_decode(x, ref_cs, w, bv, ids, num_v_heads=hv, activation="silu", out=want)
    assert _rel(y, want) < 4e-3
    assert (y[ids.cpu() < 0] == 0).all()
    assert _rel(cs, ref_cs) < 4e-3
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[ids[ids >= 0].long().cpu()] = False
    assert torch.equal(cs[untouched.cuda()], ref_cs[untouched.cuda()])


def _spec_batch(gen, N, D, pad_rows, Ts_extra):
    lens = [int(torch.randint(1, D + 1, (1,), generator=gen)) for _ in range(N)]
    for r in pad_rows:
        lens[r] = 0
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    acc = [int(torch.randint(1, D + 1, (1,), generator=gen)) for _ in range(N)]
    return lens, cu, acc, cu[-1] + Ts_extra


@pytest.mark.parametrize("D,tile", [(2, None), (4, None), (4, "bv32"), (3, "bv4w1l32-cs")])
def test_conv_spec_and_verify_slots_match_reference(D, tile, monkeypatch):
    """Padded rows in the middle and at the end, and tokens past cu_seqlens[-1] (vLLM's padded
    spec batch under a captured graph): those rows of y / o keep their poison. ``tile``: verify's
    tile forced (decode.TILE_OVERRIDE), else the one the kernel picks."""
    monkeypatch.setattr(importlib.import_module("qla_serve.kernels.hopper.decode"), "TILE_OVERRIDE", tile)
    gen = torch.Generator().manual_seed(D)
    hk, hv, W, N = 2, 8, 4, 12
    dim = (2 * hk + hv) * HEAD
    lens, cu, acc, Ts = _spec_batch(gen, N, D, pad_rows=[4, N - 1], Ts_extra=5)
    S = 1 + N * D + 8
    slot_rows = torch.arange(1, 1 + N * D, dtype=torch.int32).view(N, D)
    slot_rows[4] = -1
    slot_rows[N - 1] = -1
    slot_rows[2, D - 1] = -1          # an unused draft position: not written
    x = torch.randn(Ts, dim, generator=gen).to("cuda", torch.bfloat16)
    w, bv = _weights(dim, W, torch.bfloat16, gen, True)
    cs = _conv_cache(S, dim, W - 2 + D, torch.bfloat16, "seq_first", gen)
    ref_cs = cs.clone()
    ids0 = slot_rows[:, 0].contiguous().cuda()
    acc_t = torch.tensor(acc, dtype=torch.int32, device="cuda")
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    y = torch.full((Ts, dim), 3.0, dtype=torch.bfloat16, device="cuda")
    layer_ops.causal_conv_spec(x, cs, ids0, acc_t, cu_t, conv_weight=w, conv_bias=bv, num_v_heads=hv,
                               draft=D, out=y)
    want = y.clone().fill_(3.0)
    reference_conv.conv_spec(x, ref_cs, w, bv, ids0, acc_t, cu_t, num_v_heads=hv, draft=D,
                             activation="silu", out=want)
    assert _rel(y, want) < 4e-3 and (y[cu[-1]:] == 3.0).all()
    assert _rel(cs, ref_cs) < 4e-3
    # verify into the slots, from the conv's q | k | v
    pool = (torch.randn(S, hv, HEAD, HEAD, generator=gen) * 0.1).cuda()
    ref_pool = pool.clone()
    a, b = (torch.randn(Ts, hv, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    A_log = (torch.rand(hv, generator=gen) - 1.0).cuda()
    dt_bias = (torch.randn(hv, generator=gen) * 0.1).cuda()
    kd = hk * HEAD
    q, k, v = y[:, :kd].view(Ts, hk, HEAD), y[:, kd:2 * kd].view(Ts, hk, HEAD), y[:, 2 * kd:].view(Ts, hv, HEAD)
    ids2 = slot_rows.cuda()
    o = torch.full((Ts, hv, HEAD), 5.0, dtype=torch.bfloat16, device="cuda")
    layer_ops.gdn_verify_slots(q, k, v, pool, ids2, acc_t, cu_t, a=a, b=b, A_log=A_log, dt_bias=dt_bias, out=o)
    o_ref = o.clone().fill_(5.0)
    reference_conv.verify_slots(q, k, v, ref_pool, ids2, acc_t, cu_t, a=a, b=b, A_log=A_log,
                                dt_bias=dt_bias, use_qk_l2norm=True, scale=HEAD ** -0.5, out=o_ref)
    assert _rel(o, o_ref) < 4e-3 and (o[cu[-1]:] == 5.0).all()
    assert _rel(pool, ref_pool) < 1e-4
    written = {int(s) for i in range(N) for j, s in enumerate(slot_rows[i].tolist()) if j < lens[i] and s >= 0
               and slot_rows[i, 0] >= 0}
    for s in range(S):
        if s not in written:
            assert torch.equal(pool[s], ref_pool[s]), f"pool slot {s} touched"


def test_conv_decode_captures_in_a_graph():
    gen = torch.Generator().manual_seed(3)
    hk, hv, W, S, B = 2, 8, 4, 64, 32
    dim = (2 * hk + hv) * HEAD
    x = torch.randn(B, dim, generator=gen).to("cuda", torch.bfloat16)
    w, bv = _weights(dim, W, torch.bfloat16, gen, True)
    cs = _conv_cache(S, dim, W - 1, torch.bfloat16, "dim_first", gen)
    ids = (torch.randperm(S, generator=gen)[:B]).to(torch.int32).cuda()
    y = torch.empty_like(x)
    layer_ops.causal_conv_decode(x, cs, ids, conv_weight=w, conv_bias=bv, num_v_heads=hv, out=y)  # compile
    ref_cs = cs.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer_ops.causal_conv_decode(x, cs, ids, conv_weight=w, conv_bias=bv, num_v_heads=hv, out=y)
    x.copy_(torch.randn(B, dim, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    want = torch.empty_like(y)
    reference_conv.conv_decode(x, ref_cs, w, bv, ids, num_v_heads=hv, activation="silu", out=want)
    assert _rel(y, want) < 4e-3 and _rel(cs, ref_cs) < 4e-3


def _draft_batch(N, D, dim, hv, gen):
    """A speculative batch of N sequences x D draft tokens: cu_seqlens, mixed_qkv x [N D, dim],
    a, b [N D, hv] (bf16), and fresh_inputs() that refills x, a, b from ``gen``."""
    cu = torch.arange(0, N * D + 1, D, dtype=torch.int32, device="cuda")
    x = torch.empty(N * D, dim, dtype=torch.bfloat16, device="cuda")
    a, b = (torch.empty(N * D, hv, dtype=torch.bfloat16, device="cuda") for _ in range(2))

    def fresh_inputs():
        x.copy_(torch.randn(N * D, dim, generator=gen).to("cuda", torch.bfloat16))
        a.copy_(torch.randn(N * D, hv, generator=gen).to("cuda", torch.bfloat16))
        b.copy_(torch.randn(N * D, hv, generator=gen).to("cuda", torch.bfloat16))
    return cu, x, a, b, fresh_inputs


def _both_launch_forms(layer, fresh_inputs):
    """Run ``layer(after)`` for the plain (False) and the dependent (True) launch form: once
    eagerly (also compiles), then 3 replays of a captured graph of each, fresh inputs before each
    round; synchronised at the end."""
    fresh_inputs()
    for after in (False, True):
        layer(after)
    graphs = {}
    for after in (False, True):
        graphs[after] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[after]):
            layer(after)
    for _ in range(3):
        fresh_inputs()
        for after in (False, True):
            graphs[after].replay()
    torch.cuda.synchronize()


@pytest.mark.parametrize("B", [1, 7, 256])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_decode_after_conv_matches_the_plain_launch(B, pool_dtype, monkeypatch):
    """The layer's decode launched as the conv's programmatic dependent (decode.py after_conv:
    states loaded while the conv runs, q/k/v read after it) gives bit-for-bit what the plain
    launch gives on the same inputs, eagerly and over 3 replays of a captured graph (a read of
    q/k/v before the conv finished would differ); slots outside the batch stay untouched. Both
    launches run the after_conv form's tile (TILE_OVERRIDE): the two forms' default tiles may
    differ (decode.AFTER_CONV_TILES), and another tile sums in another order."""
    import qla_serve
    # (the hopper package exports a function named decode: import the module by its path)
    decode_kernels = importlib.import_module("qla_serve.kernels.hopper.decode")

    gen = torch.Generator().manual_seed(B)
    hk, hv, W, S = 2, 8, 4, B + 40
    pool_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[pool_dtype]
    monkeypatch.setattr(decode_kernels, "TILE_OVERRIDE",
                        decode_kernels.decode_tile(pool_name, B * hv, after_conv=True))
    dim = (2 * hk + hv) * HEAD
    w, bv = _weights(dim, W, torch.bfloat16, gen, True)
    A_log = (torch.rand(hv, generator=gen) - 1.0).cuda()
    dt_bias = (torch.randn(hv, generator=gen) * 0.1).cuda()
    ids = (torch.randperm(S, generator=gen)[:B]).to(torch.int32)
    if B > 1:
        ids[::5] = -1
    ids = ids.cuda()
    x = torch.empty(B, dim, dtype=torch.bfloat16, device="cuda")
    a, b = (torch.empty(B, hv, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    caches = {}
    for after in (False, True):
        cgen = torch.Generator().manual_seed(99)
        caches[after] = (_conv_cache(S, dim, W - 1, torch.bfloat16, "seq_first", cgen),
                         (torch.randn(S, hv, HEAD, HEAD, generator=cgen) * 0.1).to("cuda", pool_dtype),
                         torch.empty(B, dim, dtype=torch.bfloat16, device="cuda"),
                         torch.empty(B, hv, HEAD, dtype=torch.bfloat16, device="cuda"))
    before = [c.clone() for c in caches[True][:2]]

    def layer(after):
        cs, pool, y, out = caches[after]
        layer_ops.causal_conv_decode(x, cs, ids, conv_weight=w, conv_bias=bv, num_v_heads=hv, out=y)
        q, k, v = y[:, :hk * HEAD].view(B, hk, HEAD), y[:, hk * HEAD:2 * hk * HEAD].view(B, hk, HEAD), \
            y[:, 2 * hk * HEAD:].view(B, hv, HEAD)
        qla_serve.gdn_decode(q, k, v, pool, ids, a=a, b=b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True,
                             out=out, _after_conv=after)

    def fresh_inputs():
        x.copy_(torch.randn(B, dim, generator=gen).to("cuda", torch.bfloat16))
        a.copy_(torch.randn(B, hv, generator=gen).to("cuda", torch.bfloat16))
        b.copy_(torch.randn(B, hv, generator=gen).to("cuda", torch.bfloat16))

    _both_launch_forms(layer, fresh_inputs)
    for name, got, want in zip(("conv state", "pool", "y", "out"), caches[True], caches[False]):
        assert torch.equal(got, want), name
    assert torch.isfinite(caches[True][3].float()).all()
    live = ids[ids >= 0].long()
    untouched = torch.ones(S, dtype=torch.bool, device="cuda")
    untouched[live] = False
    assert torch.equal(caches[True][1][untouched], before[1][untouched])
    assert torch.equal(caches[True][0][untouched], before[0][untouched])
    assert not torch.equal(caches[True][1][live], before[1][live])   # the step did run


@pytest.mark.parametrize("N,D", [(1, 2), (6, 4), (40, 3)])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_verify_after_conv_matches_the_plain_launch(N, D, pool_dtype):
    """SGLang's verify step: gdn_verify launched as conv_verify's programmatic dependent
    (decode.py after_conv: ids and states loaded while the conv runs, q/k/v read after it) gives
    bit-for-bit what the plain launch gives, eagerly and over 3 replays of a captured graph with
    fresh inputs each (a read of q/k/v before the conv finished would differ); padded requests
    (slot -1) get zero outputs, the main SSM slots and the scratch rows the batch does not own
    stay untouched. 40 requests x 8 v-heads take verify's other tile (decode.VERIFY_TILES)."""
    import qla_serve

    gen = torch.Generator().manual_seed(100 + N)
    hk, hv, W, S = 2, 8, 4, N + 6
    dim = (2 * hk + hv) * HEAD
    w, bv = _weights(dim, W, torch.bfloat16, gen, True)
    A_log = (torch.rand(hv, generator=gen) - 1.0).cuda()
    dt_bias = (torch.randn(hv, generator=gen) * 0.1).to("cuda", torch.bfloat16)     # SGLang's dtypes
    ids = torch.randperm(S, generator=gen)[:N].to(torch.int32)
    if N > 1:
        ids[N // 2] = -1
    ids, wid = ids.cuda(), torch.randperm(S, generator=gen)[:N].to(torch.int32).cuda()
    cu, x, a, b, fresh_inputs = _draft_batch(N, D, dim, hv, gen)
    caches = {}
    for after in (False, True):
        cgen = torch.Generator().manual_seed(7)
        caches[after] = (_conv_cache(S, dim, W - 1, torch.bfloat16, "dim_first", cgen),
                         torch.randn(S, D, dim, W - 1, generator=cgen).to("cuda", torch.bfloat16),
                         (torch.randn(S, hv, HEAD, HEAD, generator=cgen) * 0.1).to("cuda", pool_dtype),
                         torch.randn(S, D, hv, HEAD, HEAD, generator=cgen).to("cuda", pool_dtype),
                         torch.empty(N * D, dim, dtype=torch.bfloat16, device="cuda"),
                         torch.empty(N * D, hv, HEAD, dtype=torch.bfloat16, device="cuda"))
    before = [c.clone() for c in caches[True][:4]]

    def layer(after):
        cs, windows, pool, inter, y, out = caches[after]
        layer_ops.causal_conv_verify(x, cs, ids, windows, wid, conv_weight=w, conv_bias=bv, num_v_heads=hv,
                                     draft=D, out=y)
        heads = y.view(N * D, 2 * hk + hv, HEAD)
        qla_serve.gdn_verify(heads[:, :hk], heads[:, hk:2 * hk], heads[:, 2 * hk:], pool, ids, cu, inter, wid,
                             a=a, b=b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True, out=out,
                             _after_conv=after)

    _both_launch_forms(layer, fresh_inputs)
    for name, got, want in zip(("conv state", "windows", "pool", "intermediate", "y", "out"),
                               caches[True], caches[False]):
        assert torch.equal(got, want), name
    out = caches[True][5]
    assert torch.isfinite(out.float()).all()
    pad = (ids < 0).nonzero().flatten().tolist()
    for i in pad:
        assert (out[i * D:(i + 1) * D] == 0).all(), "padded request"
    assert torch.equal(caches[True][2], before[2]), "verify must not write the main SSM slots"
    owned = torch.zeros(S, dtype=torch.bool, device="cuda")
    owned[wid[ids >= 0].long()] = True
    assert torch.equal(caches[True][3][~owned], before[3][~owned]), "scratch rows outside the batch"
    assert not torch.equal(caches[True][3][owned], before[3][owned])   # the step did run


@pytest.mark.parametrize("N,D", [(1, 2), (6, 4), (40, 3)])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_verify_slots_after_conv_matches_the_plain_launch(N, D, pool_dtype):
    """vLLM's spec step: gdn_verify_slots launched as conv_spec's programmatic dependent
    (decode.py after_conv: ids and source states loaded while the conv runs, q/k/v read after it)
    gives bit-for-bit what the plain launch gives, eagerly and over 3 replays of a captured graph
    with fresh inputs each; a padded sequence (first id -1) gets zero outputs, pool slots outside
    the batch's spec rows stay untouched. 40 sequences x 8 v-heads take verify_slots' other tile
    (decode.VERIFY_TILES)."""
    gen = torch.Generator().manual_seed(200 + N)
    hk, hv, W = 2, 8, 4
    dim = (2 * hk + hv) * HEAD
    S = 1 + N * D + 4
    w, bv = _weights(dim, W, torch.bfloat16, gen, True)
    A_log = (torch.rand(hv, generator=gen) - 1.0).cuda()
    dt_bias = (torch.randn(hv, generator=gen) * 0.1).to("cuda", torch.bfloat16)     # vLLM's dtypes
    slot_rows = (torch.randperm(S - 1, generator=gen)[:N * D] + 1).to(torch.int32).view(N, D)
    if N > 1:
        slot_rows[N // 2] = -1
    ids, ids0 = slot_rows.cuda(), slot_rows[:, 0].contiguous().cuda()
    acc = torch.randint(1, D + 1, (N,), generator=gen, dtype=torch.int32).cuda()
    cu, x, a, b, fresh_inputs = _draft_batch(N, D, dim, hv, gen)
    caches = {}
    for after in (False, True):
        cgen = torch.Generator().manual_seed(9)
        caches[after] = (_conv_cache(S, dim, W - 2 + D, torch.bfloat16, "seq_first", cgen),
                         (torch.randn(S, hv, HEAD, HEAD, generator=cgen) * 0.1).to("cuda", pool_dtype),
                         torch.empty(N * D, dim, dtype=torch.bfloat16, device="cuda"),
                         torch.empty(N * D, hv, HEAD, dtype=torch.bfloat16, device="cuda"))
    before = [c.clone() for c in caches[True][:2]]

    def layer(after):
        cs, pool, y, out = caches[after]
        layer_ops.causal_conv_spec(x, cs, ids0, acc, cu, conv_weight=w, conv_bias=bv, num_v_heads=hv,
                                   draft=D, out=y)
        heads = y.view(N * D, 2 * hk + hv, HEAD)
        layer_ops.gdn_verify_slots(heads[:, :hk], heads[:, hk:2 * hk], heads[:, 2 * hk:], pool, ids, acc, cu,
                                   a=a, b=b, A_log=A_log, dt_bias=dt_bias, out=out, _after_conv=after)

    _both_launch_forms(layer, fresh_inputs)
    for name, got, want in zip(("conv state", "pool", "y", "out"), caches[True], caches[False]):
        assert torch.equal(got, want), name
    out = caches[True][3]
    assert torch.isfinite(out.float()).all()
    for i in (ids0 < 0).nonzero().flatten().tolist():
        assert (out[i * D:(i + 1) * D] == 0).all(), "padded sequence"
    live = ids[ids0 >= 0].flatten()
    owned = torch.zeros(S, dtype=torch.bool, device="cuda")
    owned[live.long()] = True
    assert torch.equal(caches[True][1][~owned], before[1][~owned]), "pool slots outside the batch"
    assert not torch.equal(caches[True][1][owned], before[1][owned])   # the step did run


@pytest.mark.parametrize("D,dtype,bias", [(2, torch.bfloat16, False), (4, torch.bfloat16, True),
                                          (3, torch.float16, True)])
def test_conv_verify_matches_reference(D, dtype, bias):
    """SGLang's target-verify conv: a padded row (slot -1) in the middle, a row whose window id is
    -1, rows past N * D (their y rows keep their poison), SGLang's window scratch as a strided
    per-layer view; the window rows and conv slots the batch does not own stay bit-identical."""
    gen = torch.Generator().manual_seed(40 + D)
    hk, hv, W, N, S, Si = 2, 8, 4, 9, 24, 14
    dim = (2 * hk + hv) * HEAD
    slots = [3, 7, -1, 12, 1, 20, 5, 9, 16]
    wids = [0, 4, 2, -1, 13, 6, 7, 8, 1]
    x = torch.randn(N * D + 3, dim, generator=gen).to("cuda", dtype)
    w, bv = _weights(dim, W, dtype, gen, bias)
    cs = _conv_cache(S, dim, W - 1, dtype, "dim_first", gen)
    scratch = torch.randn(2, Si, D, dim, W - 1, generator=gen).to("cuda", dtype)   # [layers, ...]
    windows, other_layer = scratch[1], scratch[0].clone()
    ref_cs, ref_windows = cs.clone(), windows.clone()
    cs0, win0 = cs.clone(), windows.clone()
    ids = torch.tensor(slots, dtype=torch.int32, device="cuda")
    wid = torch.tensor(wids, dtype=torch.int32, device="cuda")
    y = torch.full(x.shape, 3.0, dtype=dtype, device="cuda")
    layer_ops.causal_conv_verify(x, cs, ids, windows, wid, conv_weight=w, conv_bias=bv, num_v_heads=hv,
                                 draft=D, out=y)
    want = y.clone().fill_(3.0)
    reference_conv.conv_verify(x, ref_cs, w, bv, ids, ref_windows, wid, num_v_heads=hv, draft=D,
                               activation="silu", out=want)
    torch.cuda.synchronize()
    assert _rel(y[:N * D], want[:N * D]) < 4e-3 and (y[N * D:] == 3.0).all()
    assert (y[2 * D:3 * D] == 0).all(), "padded row"
    assert torch.equal(cs, ref_cs) and torch.equal(windows, ref_windows)   # input rows, moved
    live = {s for s in slots if s >= 0}
    rows = {r for s, r in zip(slots, wids) if s >= 0 and r >= 0}
    for s in range(S):
        if s not in live:
            assert torch.equal(cs[s], cs0[s]), f"conv slot {s} touched"
    for r in range(Si):
        if r not in rows:
            assert torch.equal(windows[r], win0[r]), f"window row {r} touched"
    assert torch.equal(scratch[0], other_layer), "another layer's window scratch touched"
    assert not torch.equal(windows, win0)
