"""qla_serve.layer_ops on the CPU: the torch reference of the layer's conv ops against a naive
float64 per-sequence, per-token conv, and bad input refused with the argument named (host
metadata only). The whole layer against the float64 oracle: tests/backends/test_gdn_layer.py;
the TileLang kernels against this reference: tests/kernels/test_layer_ops_gpu.py (H200)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qla_serve import layer_ops, plan_prefill

HK, HV, W = 1, 2, 4
DIM = (2 * HK + HV) * 128


def _naive_conv(hist, xs, w, bias):
    """hist [dim, W-1] (oldest first), xs [L, dim] -> y [L, dim], new window [dim, W-1] (fp64)."""
    full = torch.cat([hist.double(), xs.double().t()], dim=1)
    y = torch.stack([(full[:, t:t + W] * w.double()).sum(-1) for t in range(xs.shape[0])]) \
        if xs.shape[0] else xs.double()
    return F.silu(y + bias.double()), full[:, -(W - 1):]


def _setup(seed=0, S=9, cols=W - 1, layout="dim_first"):
    gen = torch.Generator().manual_seed(seed)
    cs = torch.randn(S, DIM, cols, generator=gen) if layout == "dim_first" else \
        torch.randn(S, cols, DIM, generator=gen).transpose(1, 2)
    return gen, cs, torch.randn(DIM, W, generator=gen) * 0.5, torch.randn(DIM, generator=gen) * 0.1


@pytest.mark.parametrize("layout", ["dim_first", "seq_first"])
def test_prefill_conv_matches_naive(layout):
    gen, cs, w, bias = _setup(layout=layout)
    lens, slots, has = [5, 0, 1, 2, 9], [3, -1, 5, 7, 1], [True, False, False, True, True]
    cs[5].fill_(float("nan"))                        # a new request's recycled slot: never read
    cs0 = cs.clone()
    T = sum(lens)
    x = torch.randn(T, DIM, generator=gen)
    a, b = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    A_log, dt_bias = torch.rand(HV, generator=gen) - 1, torch.randn(HV, generator=gen) * 0.1
    plan = plan_prefill(lens, HV, HK, device="cpu")
    q, k, v, g, beta = layer_ops.gdn_layer_prefill_inputs(
        x, a, b, cs, torch.tensor(slots, dtype=torch.int32), plan, conv_weight=w, conv_bias=bias,
        has_initial_state=torch.tensor(has), A_log=A_log, dt_bias=dt_bias, num_k_heads=HK)
    t0 = 0
    for n, s, h in zip(lens, slots, has):
        hist = cs0[s, :, :W - 1] if (h and s >= 0) else torch.zeros(DIM, W - 1)
        y, window = _naive_conv(hist, x[t0:t0 + n], w, bias)
        qn = y[:, :128] / (y[:, :128].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        torch.testing.assert_close(q[t0:t0 + n, 0].double(), qn, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[t0:t0 + n].reshape(n, HV * 128).double(), y[:, 256:], atol=1e-5, rtol=1e-5)
        if s >= 0:
            torch.testing.assert_close(cs[s, :, :W - 1].double(), window, atol=1e-6, rtol=1e-6)
        t0 += n
    torch.testing.assert_close(g.double(), -A_log.exp().double() * F.softplus(a.double() + dt_bias.double()))
    for s in set(range(9)) - {x for x in slots if x >= 0}:
        assert torch.equal(cs[s].nan_to_num(), cs0[s].nan_to_num()), f"conv slot {s} touched"


def test_decode_conv_matches_naive():
    gen, cs, w, bias = _setup(seed=1)
    cs0 = cs.clone()
    slots = torch.tensor([4, -1, 2], dtype=torch.int32)
    x = torch.randn(3, DIM, generator=gen)
    y = layer_ops.causal_conv_decode(x, cs, slots, conv_weight=w, conv_bias=bias, num_v_heads=HV)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            assert (y[i] == 0).all()
            continue
        yn, window = _naive_conv(cs0[s], x[i:i + 1], w, bias)
        torch.testing.assert_close(y[i].double(), yn[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cs[s].double(), window)
    for s in (0, 1, 3, 5, 6, 7, 8):
        assert torch.equal(cs[s], cs0[s])


def test_spec_conv_window_and_padding():
    """vLLM's sliding window: read from column num_accepted - 1, write the last W-2 history inputs
    and the step's tokens from column 0; a padded row and tokens past cu[-1] untouched."""
    D = 3
    gen, cs, w, bias = _setup(seed=2, cols=W - 2 + D)
    cs0 = cs.clone()
    slots, lens, acc = [2, -1, 6], [3, 0, 2], [2, 1, 3]
    cu = [0, 3, 3, 5]
    x = torch.randn(7, DIM, generator=gen)                      # 2 padding tokens past cu[-1]
    out = torch.full((7, DIM), 9.0)
    layer_ops.causal_conv_spec(x, cs, torch.tensor(slots, dtype=torch.int32), torch.tensor(acc),
                               torch.tensor(cu), conv_weight=w, conv_bias=bias, num_v_heads=HV,
                               draft=D, out=out)
    for i, (s, n, a_) in enumerate(zip(slots, lens, acc)):
        if s < 0:
            continue
        hist = cs0[s, :, a_ - 1:a_ - 1 + W - 1]
        y, _ = _naive_conv(hist, x[cu[i]:cu[i] + n], w, bias)
        torch.testing.assert_close(out[cu[i]:cu[i] + n].double(), y, atol=1e-5, rtol=1e-5)
        full = torch.cat([hist, x[cu[i]:cu[i] + n].t()], dim=1)
        torch.testing.assert_close(cs[s, :, :W - 2 + n], full[:, 1:])
        assert torch.equal(cs[s, :, W - 2 + n:], cs0[s, :, W - 2 + n:])
    assert (out[5:] == 9.0).all()
    for s in set(range(9)) - {2, 6}:
        assert torch.equal(cs[s], cs0[s])


def _verify_inputs(seed, D, S=9, Si=6):
    gen, cs, w, bias = _setup(seed=seed, S=S)
    windows = torch.randn(Si, D, DIM, W - 1, generator=gen)
    return gen, cs, w, bias, windows


def test_verify_conv_windows_and_padding():
    """SGLang's target verify: D tokens per sequence from the slot's W-1 columns; the window after
    each token to windows[window_ids[s], j], after the last to the slot; a padded row (slot -1)
    and a row without window id write nothing of theirs; rows past N*D untouched."""
    D = 3
    gen, cs, w, bias, windows = _verify_inputs(4, D)
    cs0, win0 = cs.clone(), windows.clone()
    slots, wids = [2, -1, 6, 4], [3, 0, 1, -1]
    x = torch.randn(4 * D + 2, DIM, generator=gen)
    out = torch.full(x.shape, 9.0)
    layer_ops.causal_conv_verify(x, cs, torch.tensor(slots, dtype=torch.int32), windows, torch.tensor(wids),
                                 conv_weight=w, conv_bias=bias, num_v_heads=HV, draft=D, out=out)
    written = set()
    for i, (s, wid) in enumerate(zip(slots, wids)):
        rows = slice(i * D, i * D + D)
        if s < 0:
            assert (out[rows] == 0).all()
            continue
        y, window = _naive_conv(cs0[s], x[rows], w, bias)
        torch.testing.assert_close(out[rows].double(), y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cs[s].double(), window)
        full = torch.cat([cs0[s].double(), x[rows].double().t()], dim=1)
        if wid >= 0:
            written.add(wid)
            for j in range(D):
                torch.testing.assert_close(windows[wid, j].double(), full[:, j + 1:j + W])
    assert (out[4 * D:] == 9.0).all()
    for s in set(range(9)) - {2, 6, 4}:
        assert torch.equal(cs[s], cs0[s]), f"conv slot {s}"
    for r in set(range(6)) - written:
        assert torch.equal(windows[r], win0[r]), f"window row {r}"


@pytest.mark.parametrize("over,match", [
    (dict(conv_state="cols4"), "conv_state: expected SGLang's"),
    (dict(windows="dtype"), "windows: expected dtype"),
    (dict(windows="draft"), "windows: expected shape"),
    (dict(window_ids=torch.tensor([0, 6])), "window_ids: expected ids < 6"),
    (dict(slot_ids=torch.tensor([3, 3], dtype=torch.int32)), "slot_ids: expected distinct live ids"),
    (dict(x_rows=3), "mixed_qkv: expected at least 2 x 2 draft rows"),
    (dict(draft=0), "draft: expected 1..16"),
])
def test_verify_conv_bad_input(over, match):
    D = 2
    gen, cs, w, bias, windows = _verify_inputs(5, D)
    if over.pop("conv_state", None):
        cs = torch.randn(9, DIM, W, generator=gen)
    kind = over.pop("windows", None)
    if kind == "dtype":
        windows = windows.to(torch.bfloat16)
    elif kind == "draft":
        windows = torch.randn(6, D + 1, DIM, W - 1)
    x = torch.randn(over.pop("x_rows", 2 * D), DIM, generator=gen)
    kw = dict(slot_ids=torch.tensor([1, 3], dtype=torch.int32), window_ids=torch.tensor([0, 1]), draft=D)
    kw.update(over)
    cs0, win0 = cs.clone(), windows.clone()
    with pytest.raises((ValueError, TypeError), match=match):
        layer_ops.causal_conv_verify(x, cs, kw["slot_ids"], windows, kw["window_ids"], conv_weight=w,
                                     conv_bias=bias, num_v_heads=HV, draft=kw["draft"])
    assert torch.equal(cs, cs0) and torch.equal(windows, win0)


def _prefill_kw(**over):
    gen, cs, w, bias = _setup(seed=3)
    T = 6
    kw = dict(mixed_qkv=torch.randn(T, DIM, generator=gen), a=torch.randn(T, HV), b=torch.randn(T, HV),
              conv_state=cs, slot_ids=torch.tensor([1, 2], dtype=torch.int32),
              plan=plan_prefill([4, 2], HV, HK, device="cpu"), conv_weight=w, conv_bias=bias,
              A_log=torch.zeros(HV), dt_bias=torch.zeros(HV), num_k_heads=HK)
    kw.update(over)
    return kw


@pytest.mark.parametrize("over,exc,match", [
    (dict(conv_weight=torch.randn(DIM, 9)), ValueError, "conv_weight: expected"),
    (dict(conv_weight=torch.randn(DIM - 128, W)), ValueError, "conv_weight: expected"),
    (dict(conv_bias=torch.randn(DIM + 1)), ValueError, "conv_bias: expected shape"),
    (dict(mixed_qkv=torch.randn(6, DIM + 128)), ValueError, "mixed_qkv: expected shape"),
    (dict(mixed_qkv=torch.randn(5, DIM)), ValueError, "mixed_qkv: expected the plan's 6 tokens"),
    (dict(mixed_qkv=torch.randn(6, DIM + 4)[:, 2:2 + DIM]), ValueError, "mixed_qkv: the prefill conv kernel"),
    (dict(mixed_qkv=torch.randn(6, DIM).to(torch.int8)), TypeError, "mixed_qkv: expected dtype"),
    (dict(conv_state=torch.randn(9, DIM, 2)), ValueError, "conv_state: expected at least 3 columns"),
    (dict(slot_ids=torch.tensor([1, 9], dtype=torch.int32)), ValueError, "slot_ids: expected ids < 9"),
    (dict(num_k_heads=2), ValueError, "num_k_heads: expected the plan's 1"),
    (dict(activation="gelu"), ValueError, "activation: expected"),
    (dict(has_initial_state=torch.tensor([1, 0])), TypeError, "has_initial_state: expected dtype"),
])
def test_prefill_inputs_bad_input(over, exc, match):
    kw = _prefill_kw(**over)
    cs0 = kw["conv_state"].clone()
    with pytest.raises(exc, match=match):
        layer_ops.gdn_layer_prefill_inputs(kw.pop("mixed_qkv"), kw.pop("a"), kw.pop("b"), kw.pop("conv_state"),
                                           kw.pop("slot_ids"), kw.pop("plan"), **kw)
    assert torch.equal(_prefill_kw(**over)["conv_state"], cs0)


def test_decode_spec_verify_bad_input():
    gen, cs, w, bias = _setup(seed=4, cols=W - 1)
    x = torch.randn(2, DIM)
    ids = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="num_v_heads"):
        layer_ops.causal_conv_decode(x, cs, ids, conv_weight=w, num_v_heads=3)
    with pytest.raises(ValueError, match="out: expected unit stride"):
        layer_ops.causal_conv_decode(x, cs, ids, conv_weight=w, num_v_heads=HV,
                                     out=torch.empty(DIM, 2).t())
    with pytest.raises(ValueError, match="conv_state: expected at least 4 columns"):
        layer_ops.causal_conv_spec(x, cs, ids, torch.ones(2, dtype=torch.int32),
                                   torch.tensor([0, 1, 2], dtype=torch.int32), conv_weight=w,
                                   num_v_heads=HV, draft=2)
    with pytest.raises(ValueError, match="draft: expected"):
        layer_ops.causal_conv_spec(x, cs, ids, torch.ones(2, dtype=torch.int32),
                                   torch.tensor([0, 1, 2], dtype=torch.int32), conv_weight=w,
                                   num_v_heads=HV, draft=0)
    q = k = torch.randn(2, HK, 128)
    v = torch.randn(2, HV, 128)
    pool = torch.zeros(5, HV, 128, 128)
    common = dict(a=torch.randn(2, HV), b=torch.randn(2, HV), A_log=torch.zeros(HV), dt_bias=torch.zeros(HV))
    acc, cu = torch.ones(1, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(TypeError, match="spec_slot_ids: expected dtype"):
        layer_ops.gdn_verify_slots(q, k, v, pool, torch.tensor([[1, 2]]), acc, cu, **common)
    with pytest.raises(ValueError, match="spec_slot_ids: expected \\[N, D\\]"):
        layer_ops.gdn_verify_slots(q, k, v, pool, torch.tensor([1, 2], dtype=torch.int32), acc, cu, **common)
    with pytest.raises(ValueError, match="spec_slot_ids: expected ids < the pool's 5"):
        layer_ops.gdn_verify_slots(q, k, v, pool, torch.tensor([[1, 5]], dtype=torch.int32), acc, cu, **common)
    with pytest.raises(ValueError, match="spec_slot_ids: expected each live slot id once"):
        layer_ops.gdn_verify_slots(q, k, v, pool, torch.tensor([[1, 1]], dtype=torch.int32), acc, cu, **common)
    ok_ids = torch.tensor([[1, 2]], dtype=torch.int32)
    with pytest.raises(TypeError, match="^scale: "):
        layer_ops.gdn_verify_slots(q, k, v, pool, ok_ids, acc, cu, scale="0.1", **common)
    with pytest.raises(TypeError, match="^use_qk_l2norm: "):
        layer_ops.gdn_verify_slots(q, k, v, pool, ok_ids, acc, cu, use_qk_l2norm="yes", **common)
    assert (pool == 0).all()


def test_plan_and_int64_ids():
    """plan must be a PrefillPlan; an int64 padding id below -2**31 stays padding (never wraps
    around to a live slot when narrowed to int32)."""
    kw = _prefill_kw()
    with pytest.raises(TypeError, match="plan: expected a PrefillPlan"):
        layer_ops.gdn_layer_prefill_inputs(kw.pop("mixed_qkv"), kw.pop("a"), kw.pop("b"), kw.pop("conv_state"),
                                           kw.pop("slot_ids"), None, **{k: v for k, v in kw.items() if k != "plan"})
    gen, cs, w, bias = _setup(seed=6)
    cs0 = cs.clone()
    with pytest.raises(ValueError, match="slot_ids"):
        layer_ops.causal_conv_decode(torch.randn(2, DIM), cs, torch.tensor([1, -2**32]), conv_weight=w,
                                     num_v_heads=HV)
    assert torch.equal(cs, cs0)
