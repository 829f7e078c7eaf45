"""SGLang's own GDN test kit, driving the real backend and pool with flashqla selected.

The kit (``sglang/test/kits/attention_unittest/attention_methods/gdn_attention.py``, shipped in
the wheel) builds a mock model runner with SGLang's real ``HybridReqToTokenPool`` / mamba pool,
the real ``GDNAttnBackend`` + ``HybridLinearAttnBackend``, a ``RadixLinearAttention`` layer and
real ``ForwardBatch`` objects, runs the layer eagerly and compares outputs (and decode final
states) with its own pure-torch token-by-token reference. Here the mock runner's flags select
flashqla (so the plugin's hooks install FlashQLAGDNKernel), with head dims 128 (qla_serve's).

Replaced because they cannot run on a CPU machine (see conftest.py, ``gdn_kit``): SGLang's Triton
ops ``causal_conv1d_fn``, ``causal_conv1d_update`` and ``fused_gdn_gating`` in gdn_backend (torch
equivalents), the full-attention backend (``torch_native`` instead of ``triton``; the kit model
has no full-attention layer), ``torch.cuda.get/set_rng_state`` (CPU generator), and the parallel
ranks stamped as a single rank. Everything on the GDN path between the layer and the kernel is
SGLang's. On CPU, qla_serve's ops run their torch reference path.
"""

from __future__ import annotations

import unittest

import pytest
import torch

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (.venv-sglang: bash scripts/setup_sglang_env.sh)")

pytestmark = pytest.mark.engine

FLASHQLA = dict(linear_attn_backend="flashqla")


@pytest.fixture
def counted(monkeypatch):
    """Counts calls into qla_serve's ops (as the kernel class reaches them)."""
    import qla_serve
    from qla_serve.backends.sglang import kernel as K

    calls = {"gdn_prefill": 0, "gdn_decode": 0}
    for name in calls:
        real = getattr(qla_serve, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(K.qla_serve, name, wrapped)
    return calls


def _cases(kit):
    return [dataclass_replace(c, backend="torch_native") for c in kit.make_gdn_cases("triton")]


def dataclass_replace(case, **kw):
    import dataclasses
    return dataclasses.replace(case, **kw)


def test_kit_cases_with_flashqla(gdn_kit, counted):
    from qla_serve.backends.sglang.kernel import FlashQLAGDNKernel

    kit = gdn_kit(**FLASHQLA)
    tc = unittest.TestCase()
    cases = _cases(kit)
    assert {c.forward_mode.is_decode() for c in cases} == {True, False}
    for case in cases:
        fixture = kit.build_gdn_attention_fixture(tc, case, head_k_dim=128, head_v_dim=128,
                                                  device="cpu", dtype=torch.bfloat16)
        disp = fixture.backend.linear_attn_backend.kernel_dispatcher
        for kern in (disp.decode_kernel, disp.extend_kernel, disp.verify_kernel):
            assert isinstance(kern, FlashQLAGDNKernel), case.name
        before = dict(counted)
        kit.run_gdn_attention_case(tc, case, head_k_dim=128, head_v_dim=128, device="cpu",
                                   dtype=torch.bfloat16)
        op = "gdn_decode" if case.forward_mode.is_decode() else "gdn_prefill"
        assert counted[op] > before[op], f"{case.name}: flashqla kernel did not run"
    assert counted["gdn_decode"] and counted["gdn_prefill"]


def _sglang_calls(monkeypatch, *names):
    """Counts calls of SGLang's ops ``names`` in gdn_backend (the conftest's torch stand-ins, wrapped)."""
    import sglang.srt.layers.attention.linear.gdn_backend as gb

    calls = []
    for name in names:
        def counted(*a, _real=getattr(gb, name), _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)
        monkeypatch.setattr(gb, name, counted)
    return calls


def _decode_conv_calls(monkeypatch):
    return _sglang_calls(monkeypatch, "causal_conv1d_update")


def _run_cases_then_metadata(kit, cases):
    """Every case through the kit's reference check, then the first case's fixture once more
    eagerly; returns that forward batch's metadata (where the hooks keep the step's ids)."""
    tc = unittest.TestCase()
    for case in cases:
        kit.run_gdn_attention_case(tc, case, head_k_dim=128, head_v_dim=128, device="cpu", dtype=torch.bfloat16)
    fixture = kit.build_gdn_attention_fixture(tc, cases[0], head_k_dim=128, head_v_dim=128, device="cpu",
                                              dtype=torch.bfloat16)
    kit.run_gdn_fixture_eager(fixture)
    return fixture.backend.linear_attn_backend.forward_metadata


def test_kit_decode_takes_sglangs_conv_over(gdn_kit, monkeypatch):
    """flashqla's decode runs the conv too (decode_layer.forward_decode): SGLang's conv update is
    not called, the kit's reference still holds (outputs and final states), and the step's slot
    ids are derived once per forward batch, kept on SGLang's metadata object."""
    from qla_serve.backends.gdn_layer import StepPlan

    kit = gdn_kit(**FLASHQLA)
    conv_calls = _decode_conv_calls(monkeypatch)
    decodes = [c for c in _cases(kit) if c.forward_mode.is_decode()]
    assert decodes
    meta = _run_cases_then_metadata(kit, decodes)
    assert conv_calls == []
    assert isinstance(meta.qla_decode, StepPlan) and meta.qla_decode.decode_slots is meta.mamba_cache_indices


def test_kit_extend_takes_sglangs_conv_over(gdn_kit, monkeypatch):
    """flashqla's extend runs the conv, split and gating too (extend_layer.forward_extend): SGLang's
    causal_conv1d_fn and fused_gdn_gating are not called, the kit's reference holds on every extend
    case (outputs and final states), and the step's plan is made once per forward batch on the
    metadata hook's ExtendBatch (its PrefillPlan, SGLang's slot ids)."""
    from qla_serve.backends.gdn_layer import StepPlan

    kit = gdn_kit(**FLASHQLA)
    calls = _sglang_calls(monkeypatch, "causal_conv1d_fn", "fused_gdn_gating")
    extends = [c for c in _cases(kit) if not c.forward_mode.is_decode()]
    assert len(extends) >= 5
    meta = _run_cases_then_metadata(kit, extends)
    assert calls == []
    step = meta.qla_extend.step
    assert isinstance(step, StepPlan) and step.prefill_plan is meta.qla_extend.plan
    assert step.num_actual_tokens == sum(extends[0].extend_lens)
    assert torch.equal(step.prefill_slots, meta.mamba_cache_indices[:len(extends[0].extend_lens)])


def _verify_case(kit, draft=3, prefix_lens=(5, 9, 12)):
    """A target-verify case of the kit's shape (linear drafts: topk 1), one draft_token_num per request."""
    import dataclasses

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return dataclasses.replace(_cases(kit)[0], name="qla_verify", forward_mode=ForwardMode.TARGET_VERIFY,
                               prefix_lens=prefix_lens, extend_lens=(draft,) * len(prefix_lens))


@pytest.mark.parametrize("take_over", [True, False])
def test_kit_target_verify(gdn_kit, monkeypatch, take_over):
    """SGLang's own EAGLE verify runner (its spec_info, intermediate caches and scratch rows) with
    flashqla's verify, the conv taken over (verify_layer.forward_verify; SGLang's conv update not
    called) or not (QLA_SERVE_SGLANG_VERIFY_CONV=0: the conftest's stand-in of SGLang's update):
    the kit's reference holds on the outputs; each request's per-draft conv windows in SGLang's
    intermediate conv cache (at the row SGLang's select_verify_intermediate_state_indices picks)
    and per-draft states in its intermediate SSM cache against the float64 oracle; the main SSM
    slots untouched."""
    import _sglang_cases as C
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as R

    from qla_serve.backends.sglang import plugin

    kit = gdn_kit(**FLASHQLA)
    monkeypatch.setitem(plugin.TAKE_OVER_CONV, "verify", take_over)
    conv_calls = _sglang_calls(monkeypatch, "causal_conv1d_update")
    D, case = 3, _verify_case(kit)
    tc = unittest.TestCase()
    # run_gdn_eagle_verify_case's steps, keeping the fixture to read its caches afterwards
    fixture = kit.build_gdn_attention_fixture(tc, case, head_k_dim=128, head_v_dim=128, device="cpu",
                                              dtype=torch.bfloat16)
    R._prepare_gdn_verify_batch(case, fixture.forward_batch, topk=1, device="cpu")
    inputs = kit.gdn_fixture_inputs(fixture)
    before = kit._clone_gdn_cache(fixture)
    expected = kit.expected_gdn_verify_output_from_inputs(fixture, case, inputs, before, topk=1)
    cache = fixture.runner.req_to_token_pool.mamba2_layer_cache(0)
    conv0, ssm0 = cache.conv[0].clone(), cache.temporal.clone()
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fixture.backend)):
        fixture.backend.init_forward_metadata(fixture.forward_batch)
        actual = kit.run_gdn_forward(fixture, fixture.forward_batch, inputs)
    torch.testing.assert_close(actual, expected, atol=kit.GDN_ATOL, rtol=kit.GDN_RTOL)
    assert bool(conv_calls) != take_over
    from sglang.srt.layers.attention.linear.utils import select_verify_intermediate_state_indices

    linear = fixture.backend.linear_attn_backend
    slots = kit._cache_indices(fixture).tolist()
    rows = select_verify_intermediate_state_indices(
        linear.verify_intermediate_state_indices, fixture.forward_batch.req_pool_indices,
        torch.tensor(slots) >= 0, linear.req_to_token_pool.size)[:len(slots)].tolist()
    if take_over:
        assert linear.forward_metadata.qla_verify.window_ids.tolist() == rows
    attn = fixture.reference_module
    q, k, v = attn.split_qkv(inputs["mixed_qkv"])          # the kit's conv: the identity
    g64, beta64 = C.gating64(inputs["a"], inputs["b"], attn.A_log.detach(), attn.dt_bias.detach())
    _, states = C.verify_oracle(q, k, v, g64, beta64, [D] * len(slots), slots, ssm0)
    x = inputs["mixed_qkv"]
    for i, (s, r) in enumerate(zip(slots, rows)):
        full = torch.cat([conv0[s].float(), x[i * D:(i + 1) * D].float().T], 1)
        for j in range(D):
            assert torch.equal(cache.intermediate_conv_window[0][r, j].float(), full[:, j + 1:j + 1 + full.shape[1] - D]), (i, j)
        assert C.rel(cache.intermediate_ssm[r], states[s]) < 1e-2, f"request {i}"
    assert torch.equal(cache.temporal, ssm0)


def _random_conv(fixture, seed):
    """The kit's conv is the identity without activation: give its layer random width-2 weights
    and SiLU, and its conv states random history, so a conv that reads the wrong column, skips
    the history or drops the activation shows."""
    gen = torch.Generator().manual_seed(seed)
    attn = fixture.actual_module.attn
    attn.conv_weights = (torch.randn(attn.conv_weights.shape, generator=gen) * 0.5).to(attn.conv_weights.dtype)
    attn.activation = "silu"
    conv = fixture.runner.req_to_token_pool.mamba2_layer_cache(0).conv[0]
    conv.copy_(torch.randn(conv.shape, generator=gen).to(conv.dtype))


def _layer_oracle(kit, fixture, case, conv0, ssm0):
    """float64 of the kit layer's step from the caches before it: per request, the conv over its
    history (read only when it has a prefix) and its tokens, SiLU, the gates, the recurrence from
    its SSM slot. Returns (o [T, Hv, 128], {slot: final state})."""
    import torch.nn.functional as F

    import _sglang_cases as C

    attn = fixture.actual_module.attn
    slots = kit._cache_indices(fixture).tolist()
    lens = case.extend_lens or (1,) * len(slots)
    x, w = fixture.mixed_qkv.double(), attn.conv_weights.double()
    ys, start = [], 0
    for n, s, prefix in zip(lens, slots, case.prefix_lens):
        hist = conv0[s].double() if prefix > 0 else x.new_zeros(x.shape[1], w.shape[1] - 1)
        full = torch.cat([hist, x[start:start + n].T], 1)
        ys.append(F.silu(F.conv1d(full[None], w[:, None], groups=x.shape[1])[0]).T)
        start += n
    y = torch.cat(ys)
    kd = case.num_k_heads * 128
    q, k = (y[:, j:j + kd].view(1, -1, case.num_k_heads, 128) for j in (0, kd))
    v = y[:, 2 * kd:].view(1, -1, case.num_v_heads, 128)
    g, beta = C.gating64(fixture.a, fixture.b, attn.A_log.detach(), attn.dt_bias.detach())
    return C.oracle(q, k, v, g, beta, list(lens), slots, ssm0)


@pytest.mark.parametrize("case_name", ["gdn_decode_page_boundary", "gdn_decode_bsz1_nonzero_prefix",
                                       "gdn_extend_ragged_page_boundary", "gdn_extend_page_size_1",
                                       "gdn_extend_cross_page_boundary"])
def test_kit_conv_taken_over_matches_sglangs(gdn_kit, monkeypatch, case_name):
    """The same decode or extend step with SGLang's conv (plugin.TAKE_OVER_CONV["decode" /
    "extend"] False, as $QLA_SERVE_SGLANG_*_CONV=0 sets them: its conv, split and gating,
    then flashqla's kernel class) and with qla_serve's (the default), from the same caches, random
    conv weights and history: the same conv states bit for bit (the windows are input rows), slots
    outside the batch untouched, and outputs and SSM states against a float64 oracle of the layer
    within 1e-2, no further from it than SGLang's route (which rounds its conv output to bf16)."""
    import _sglang_cases as C
    from qla_serve.backends.sglang import plugin

    kit = gdn_kit(**FLASHQLA)
    tc = unittest.TestCase()
    case = next(c for c in _cases(kit) if c.name == case_name)
    decode = case.forward_mode.is_decode()
    switch = "decode" if decode else "extend"
    results = []
    for take_over in (False, True):
        monkeypatch.setitem(plugin.TAKE_OVER_CONV, switch, take_over)
        conv_calls = _sglang_calls(monkeypatch, "causal_conv1d_update" if decode else "causal_conv1d_fn")
        fixture = kit.build_gdn_attention_fixture(tc, case, head_k_dim=128, head_v_dim=128, device="cpu",
                                                  dtype=torch.bfloat16)
        _random_conv(fixture, seed=3)
        cache = fixture.runner.req_to_token_pool.mamba2_layer_cache(0)
        conv0, ssm0 = cache.conv[0].clone(), cache.temporal.clone()
        out = kit.run_gdn_fixture_eager(fixture)
        assert bool(conv_calls) != take_over
        live = set(kit._cache_indices(fixture).tolist())
        o64, finals = _layer_oracle(kit, fixture, case, conv0, ssm0)
        errors = [C.rel(out[0], o64)] + [C.rel(cache.temporal[s], finals[s]) for s in sorted(finals)]
        results.append((errors, cache.conv[0].clone(), cache.temporal.clone(), conv0, ssm0, live))
    (err_s, conv_s, ssm_s, conv0, ssm0, live), (err_q, conv_q, ssm_q, conv0_q, ssm0_q, live_q) = results
    assert torch.equal(conv0, conv0_q) and torch.equal(ssm0, ssm0_q) and live == live_q
    assert len(err_q) > 1 and max(err_q) < 1e-2, err_q
    assert all(q <= 1.25 * s + 1e-4 for q, s in zip(err_q, err_s)), (err_q, err_s)
    assert torch.equal(conv_q, conv_s)
    for slot in range(conv0.shape[0]):
        if slot not in live:
            assert torch.equal(conv_q[slot], conv0[slot]) and torch.equal(ssm_q[slot], ssm0[slot]), slot


def _split_contiguous(qkvz, ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Torch stand-in for SGLang's Triton fused_qkvzba_split_reshape_cat_contiguous (GPU-only: SGLang
    imports it only on CUDA): [q|k|v|z], [b|a] -> mixed_qkv, z [T, Hv, 128], b, a."""
    dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    return (qkvz[:, :dim].contiguous(), qkvz[:, dim:].reshape(-1, num_heads_v, head_v).contiguous(),
            ba[:, :num_heads_v].contiguous(), ba[:, num_heads_v:].contiguous())


def test_kit_qwen35_projection_decode_keeps_sglangs_conv(gdn_kit, monkeypatch):
    """Qwen3.5's decode hands forward_decode the projections' (qkvz, ba) tuple: the hook leaves it to
    SGLang's forward_decode (on a GPU its fused split + conv; on this CPU machine its fallback, the
    split then the conv update: both stand in as torch here, as the conftest's conv), whose
    flashqla ``decode`` takes the batch's slot ids derived once (no per-layer mapping). The result
    and the caches equal those of the same step handed over as one mixed_qkv tensor with
    TAKE_OVER_CONV["decode"] off (SGLang's conv, flashqla's decode, the same bound ids), bit for bit."""
    import sglang.srt.layers.attention.linear.gdn_backend as gb

    from qla_serve.backends.sglang import kernel as K
    from qla_serve.backends.sglang import plugin

    monkeypatch.setattr(gb, "can_use_fused_qkvzba_causal_conv1d_update_contiguous",
                        lambda *a, **kw: (False, "CPU stand-in"), raising=False)
    monkeypatch.setattr(gb, "fused_qkvzba_split_reshape_cat_contiguous", _split_contiguous, raising=False)
    per_layer_maps = []
    real_slots = K._slots
    monkeypatch.setattr(K, "_slots", lambda ids: per_layer_maps.append(1) or real_slots(ids))
    kit = gdn_kit(**FLASHQLA)
    tc = unittest.TestCase()
    case = next(c for c in _cases(kit) if c.name == "gdn_decode_page_boundary")
    results = []
    for route in ("tuple", "tensor"):
        monkeypatch.setitem(plugin.TAKE_OVER_CONV, "decode", route == "tuple")
        fixture = kit.build_gdn_attention_fixture(tc, case, head_k_dim=128, head_v_dim=128, device="cpu",
                                                  dtype=torch.bfloat16)
        _random_conv(fixture, seed=4)
        linear, attn = fixture.backend.linear_attn_backend, fixture.actual_module.attn
        z = torch.randn(fixture.mixed_qkv.shape[0], attn.num_v_heads * 128,
                        generator=torch.Generator().manual_seed(5)).to(fixture.mixed_qkv.dtype)
        linear.init_forward_metadata(fixture.forward_batch)
        with torch.no_grad():
            if route == "tuple":
                out, z_out = linear.forward_decode(
                    layer=attn, forward_batch=fixture.forward_batch,
                    mixed_qkv=(torch.cat([fixture.mixed_qkv, z], 1), torch.cat([fixture.b, fixture.a], 1)),
                    a=None, b=None)
                assert torch.equal(z_out.reshape(z.shape), z)
            else:
                out = linear.forward_decode(layer=attn, forward_batch=fixture.forward_batch,
                                            mixed_qkv=fixture.mixed_qkv, a=fixture.a, b=fixture.b)
        cache = fixture.runner.req_to_token_pool.mamba2_layer_cache(0)
        results.append((out, cache.conv[0].clone(), cache.temporal.clone()))
        if route == "tuple":
            assert per_layer_maps == [], "the tuple route mapped the slot ids in the layer"
            assert linear.kernel_dispatcher.decode_kernel._decode_ids[0] is linear.forward_metadata.mamba_cache_indices
    assert per_layer_maps == [], "SGLang's conv route (TAKE_OVER_CONV['decode'] off) takes the bound ids too"
    (o_t, conv_t, ssm_t), (o_m, conv_m, ssm_m) = results
    assert o_t.abs().max() > 0.01
    assert torch.equal(o_t, o_m) and torch.equal(conv_t, conv_m) and torch.equal(ssm_t, ssm_m)


def test_kit_extend_plans_once_per_batch(gdn_kit):
    """init_forward_metadata (hooked) plans the batch; the kernel reuses that plan."""
    kit = gdn_kit(**FLASHQLA)
    tc = unittest.TestCase()
    case = next(c for c in _cases(kit) if c.name == "gdn_extend_ragged_page_boundary")
    fixture = kit.build_gdn_attention_fixture(tc, case, head_k_dim=128, head_v_dim=128, device="cpu",
                                              dtype=torch.bfloat16)
    kit.run_gdn_fixture_eager(fixture)
    linear = fixture.backend.linear_attn_backend
    batch = linear.forward_metadata.qla_extend
    assert batch is not None and batch.seq_lens == case.extend_lens
    assert batch.query_start_loc is linear.forward_metadata.query_start_loc
    assert batch.plan is not None and batch.plan.seq_lens == case.extend_lens
    assert linear.kernel_dispatcher.extend_kernel._warned_unplanned is False


@pytest.mark.parametrize("take_over", [False, True])
def test_kit_catches_a_wrong_kernel(gdn_kit, monkeypatch, take_over):
    """Control: the kit's reference does fail an extend that is wrong (q not L2-normalised), on
    either route: SGLang's conv, then the kernel class (its q/k normalisation made a no-op), or
    qla_serve's layer (its prefill inputs' q doubled after the norm)."""
    from qla_serve import layer_ops
    from qla_serve.backends.sglang import kernel as K
    from qla_serve.backends.sglang import plugin

    kit = gdn_kit(**FLASHQLA)
    monkeypatch.setitem(plugin.TAKE_OVER_CONV, "extend", take_over)
    if take_over:
        real = layer_ops.gdn_layer_prefill_inputs

        def q_doubled(*a, **kw):
            real(*a, **kw)
            kw["_outputs"][0].mul_(2)
        monkeypatch.setattr(layer_ops, "gdn_layer_prefill_inputs", q_doubled)
    else:
        # the kernel class normalises q/k through qla_serve.gdn_prefill_inputs: make that a no-op
        monkeypatch.setattr(K.qla_serve, "gdn_prefill_inputs",
                            lambda q, k, *gates, **kw: (q.contiguous(), k.contiguous(), None, None))
    case = next(c for c in _cases(kit) if c.name == "gdn_extend_zero_prefix_input_page_edges")
    with pytest.raises(AssertionError):
        kit.run_gdn_attention_case(unittest.TestCase(), case, head_k_dim=128, head_v_dim=128,
                                   device="cpu", dtype=torch.bfloat16)


def test_kit_pool_layout_is_what_the_kernel_assumes(gdn_kit):
    """SGLang's pool: [layers, size+1, Hv, V, K] per layer [size+1, Hv, 128, 128]; slot 0 never
    handed to a request (MambaSlotAllocator's free list starts at 1), which is why the kernel
    treats 0 as padding."""
    kit = gdn_kit(**FLASHQLA)
    case = _cases(kit)[0]
    fixture = kit.build_gdn_attention_fixture(unittest.TestCase(), case, head_k_dim=128, head_v_dim=128,
                                              device="cpu", dtype=torch.bfloat16)
    r2t = fixture.runner.req_to_token_pool
    temporal = r2t.mamba_pool.mamba_cache.temporal
    assert temporal.shape[1:] == (r2t.mamba_pool.size + 1, case.num_v_heads, 128, 128)
    assert r2t.mamba2_layer_cache(0).temporal.shape == temporal.shape[1:]
    alloc = r2t.mamba_allocator
    alloc.clear()
    assert int(alloc.free_slots.min()) == 1 and alloc.available_size() == r2t.mamba_pool.size


def test_kit_extra_buffer_track_snapshot(gdn_kit):
    """extra_buffer prefix tracking end to end on SGLang's side: the hooked metadata step plans
    the cut from SGLang's host track plan, the kernel fills the fp32 snapshot, and SGLang's own
    ``_track_mamba_state_extend`` copies it into the track slots. Checked against the float64
    oracle for the state after the last whole 64-token chunk of each tracked request."""
    import dataclasses

    import _sglang_cases as C
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    kit = gdn_kit(linear_attn_backend="flashqla")
    lens, track_dst = (100, 70, 30), [4, 5, 6]
    case = dataclasses.replace(_cases(kit)[0], name="qla_track", forward_mode=ForwardMode.EXTEND,
                               page_size=1, prefix_lens=(0, 0, 0), extend_lens=lens)
    fixture = kit.build_gdn_attention_fixture(unittest.TestCase(), case, head_k_dim=128, head_v_dim=128,
                                              max_context_len=128, device="cpu", dtype=torch.bfloat16,
                                              runner_batch_size=6)
    fb = fixture.forward_batch
    track = [True, True, False]
    fb.mamba_track_mask = torch.tensor(track)
    fb.mamba_track_indices = torch.tensor(track_dst, dtype=torch.int64)
    fb.mamba_track_seqlens = torch.tensor(lens, dtype=torch.int64)
    fb.mamba_prefill_track_mask_cpu = list(track)
    fb.mamba_track_seqlens_cpu = list(lens)
    temporal = fixture.runner.req_to_token_pool.mamba2_layer_cache(0).temporal
    temporal[4:7] = 9.0                                     # track slots: poisoned
    pool0 = temporal.clone()
    kit.run_gdn_fixture_eager(fixture)
    linear = fixture.backend.linear_attn_backend
    assert linear.forward_metadata.qla_extend.track_chunks == (1, 1, -1)

    ref = fixture.reference_module
    q, k, v = ref.split_qkv(fixture.mixed_qkv)              # conv is the identity in the kit
    g64, beta64 = C.gating64(fixture.a, fixture.b, ref.A_log.detach(), ref.dt_bias.detach())
    slots = kit._cache_indices(fixture).tolist()
    start = 0
    for i, n in enumerate(lens):
        if track[i]:
            cut = (n // 64) * 64
            sl = slice(start, start + cut)
            _, fin = C.oracle(q[:, sl], k[:, sl], v[:, sl], g64[sl], beta64[sl], [cut], [slots[i]], pool0)
            assert C.rel(temporal[track_dst[i]], fin[slots[i]]) < 1e-2, f"request {i} snapshot"
        start += n
    assert torch.all(temporal[6] == 9.0), "an untracked request's track slot was written"
