"""Every public op and the engines' GDN layer steps on the TileLang path, down to the kernel
launch, on the CPU: each launch matched against the program its variant builds (launch_check.py).

The ops are dispatched to kernels/hopper (and Blackwell's module) as on an H200; the compiled
kernels are the one stand-in (launch_check.record_launches: a launch records and checks its
arguments instead of running). Everything above the launch is real: the step plan, validation,
the variant's name and program, the tile pick, the launch code's argument lists and defaults
(``scale=None``: what an engine never passes, so the layer tests never reach it).

The tensors live on torch's meta device, CUDA's stand-in here: it has shapes, dtypes and strides
but no values, so any host read of a device tensor's value on these paths (``.item()``,
``.tolist()``, ``bool()``, a copy to the CPU: a GPU sync on a real device) raises. A step
therefore passing here syncs nothing between its step plan and its last launch.

What the kernels compute is checked by the ``gpu`` tests against the float64 reference; here,
that a call reaches them with what they take.
"""

from types import SimpleNamespace

import pytest
import torch

import qla_serve
from qla_serve import layer_ops
from qla_serve.backends import gdn_layer as GL

from launch_check import ARCHS, check_arguments, record_arch_launches
from launch_check import conv as conv_module

HK, HV, D = 2, 8, 128
DIM = (2 * HK + HV) * D
BF16 = torch.bfloat16
DEV = torch.device("meta")   # CUDA's stand-in (module docstring)


def _on_dev(factory):
    return lambda *args, **kw: factory(*args, device=DEV, **kw)


randn, rand, zeros, tensor, arange = map(_on_dev, (torch.randn, torch.rand, torch.zeros, torch.tensor, torch.arange))


@pytest.fixture(params=sorted(ARCHS))
def arch(request):
    return request.param


@pytest.fixture
def launches(monkeypatch, arch):
    return record_arch_launches(monkeypatch, arch)


def _names(calls):
    return [c.name for c in calls]


_PRECOMPILED: dict = {}


def _assert_precompiled(calls, arch, hk=HK, hv=HV):
    """Every kernel a layer step launched is one `qla-serve precompile` builds for these heads
    and this arch (the arch module's kernel_variants): none compiles on first use while serving."""
    from qla_serve.paths import kernel_module

    if (arch, hk, hv) not in _PRECOMPILED:
        _PRECOMPILED[arch, hk, hv] = {v["name"] for v in kernel_module(arch).kernel_variants(hv, hk)}
    assert calls, "no launch recorded"
    missing = [c.name for c in calls if c.name not in _PRECOMPILED[arch, hk, hv]]
    assert not missing, f"launched but not precompiled: {missing}"


def _qkv(T, dtype=BF16):
    return (randn(T, HK, D, dtype=dtype), randn(T, HK, D, dtype=dtype),
            randn(T, HV, D, dtype=dtype))


def _raw_gates(T, param_dtype=torch.float32, bias_dtype=None):
    return dict(a=randn(T, HV, dtype=BF16), b=randn(T, HV, dtype=BF16),
                A_log=zeros(HV, dtype=param_dtype), dt_bias=zeros(HV, dtype=bias_dtype or param_dtype))


@pytest.mark.parametrize("pool_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("gates", ["g_beta", "raw_fp32", "raw_bf16", "raw_mixed"])
@pytest.mark.parametrize("scale", [None, 0.05])
def test_decode(launches, pool_dtype, gates, scale):
    """gdn_decode in each gate form and pool dtype, with and without a scale: one decode launch,
    its scale the default 128 ** -0.5 where none is given."""
    B = 3
    q, k, v = _qkv(B)
    pool = zeros(5, HV, D, D, dtype=pool_dtype)
    if gates == "g_beta":
        kw = dict(g=-rand(B, HV), beta=rand(B, HV))
    else:
        param, bias = {"raw_fp32": (torch.float32, None), "raw_bf16": (BF16, None),
                       "raw_mixed": (torch.float32, BF16)}[gates]
        kw = _raw_gates(B, param, bias)
    qla_serve.gdn_decode(q, k, v, pool, tensor([1, -1, 3], dtype=torch.int32), use_qk_l2norm=True,
                         scale=scale, **kw)
    assert [n.split("_hv")[0] for n in _names(launches)] == ["gdn_decode"]
    assert launches[0].args["scale"] == pytest.approx(D ** -0.5 if scale is None else scale)


def test_kernel_module_default_scale(launches):
    """The kernel modules' own default scale (the contract of qla_serve/kernels/__init__.py, which
    the GPU tests call directly; the public ops pass a float): decode, verify and verify_slots
    with scale=None launch with 128 ** -0.5."""
    from qla_serve.kernels import hopper

    N, Dd = 2, 2
    q, k, v = _qkv(N * Dd)
    pool = zeros(8, HV, D, D)
    out = torch.empty_like(v)
    slots, cu = tensor([1, 2], dtype=torch.int32), tensor([0, Dd, 2 * Dd], dtype=torch.int32)
    gates = _raw_gates(N * Dd)
    hopper.decode(q, k, v, pool, arange(N * Dd, dtype=torch.int32), g=None, beta=None, **gates,
                  use_qk_l2norm=True, scale=None, out=out)
    hopper.verify(q, k, v, pool, slots, cu, zeros(2, Dd, HV, D, D), slots - 1, g=None, beta=None,
                  **gates, use_qk_l2norm=True, scale=None, out=out)
    hopper.verify_slots(q, k, v, pool, tensor([[1, 2], [3, 4]], dtype=torch.int32), slots, cu, **gates,
                        use_qk_l2norm=True, scale=None, out=out)
    assert [c.args["scale"] for c in launches] == [pytest.approx(D ** -0.5)] * 3


@pytest.mark.parametrize("acc_dtype", [torch.int32, torch.int64])
def test_verify_then_commit(launches, acc_dtype):
    """gdn_verify into an intermediate buffer, then commit_verified: two launches."""
    N, Dd = 2, 3
    q, k, v = _qkv(N * Dd)
    pool = zeros(4, HV, D, D)
    inter = zeros(3, Dd, HV, D, D)
    cu = tensor([0, Dd, 2 * Dd], dtype=torch.int32)
    slots, inter_ids = tensor([1, 2], dtype=torch.int32), tensor([0, 2], dtype=torch.int32)
    qla_serve.gdn_verify(q, k, v, pool, slots, cu, inter, inter_ids, use_qk_l2norm=True, **_raw_gates(N * Dd))
    qla_serve.commit_verified(pool, slots, inter, inter_ids, tensor([1, 3], dtype=acc_dtype))
    assert [n.split("_hv")[0] for n in _names(launches)] == ["gdn_verify", "commit_verified"]
    assert launches[0].args["scale"] == pytest.approx(D ** -0.5)


def test_verify_slots(launches):
    """vLLM's spec verify straight into per-token pool slots."""
    N, Dd = 2, 3
    q, k, v = _qkv(N * Dd)
    pool = zeros(8, HV, D, D)
    spec = tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    layer_ops.gdn_verify_slots(q, k, v, pool, spec, tensor([1, 2], dtype=torch.int32),
                               tensor([0, 3, 6], dtype=torch.int32), **_raw_gates(N * Dd))
    assert [n.split("_hv")[0] for n in _names(launches)] == ["gdn_verify_slots"]


@pytest.mark.parametrize("qk_dtype", [None, torch.float16])
def test_prefill_inputs_then_prefill(launches, arch, qk_dtype):
    """gdn_prefill_inputs (one launch) feeding gdn_prefill (stage 1, stage 2) on a plain plan."""
    lens = [100, 30]
    T = sum(lens)
    q, k, v = _qkv(T)
    q2, k2, g, beta = qla_serve.gdn_prefill_inputs(q, k, qk_dtype=qk_dtype, **_raw_gates(T))
    pool = zeros(4, HV, D, D)
    plan = qla_serve.plan_prefill(lens, HV, HK, device=DEV, cp="off", arch=arch)
    qla_serve.gdn_prefill(q2, k2, v, g, beta, pool, tensor([1, 2], dtype=torch.int32), plan)
    names = _names(launches)
    assert names[0].startswith("gdn_prefill_inputs") or names[0].startswith("gdn_inputs"), names
    assert any("prep" in n for n in names[1:]) and any("main" in n for n in names[1:]), names


def test_layer_conv_ops(launches):
    """The layer ops' conv launches outside a layer call: decode, spec window, SGLang's verify
    window, the prefill checkpoints' windows."""
    w, bias = randn(DIM, 4, dtype=BF16), randn(DIM, dtype=BF16)
    conv_state = zeros(6, DIM, 3 + 2, dtype=BF16)
    x = randn(3, DIM, dtype=BF16)
    ids = tensor([1, 2, 3], dtype=torch.int32)
    layer_ops.causal_conv_decode(x, conv_state, ids, conv_weight=w, conv_bias=bias, num_v_heads=HV)
    layer_ops.causal_conv_spec(x, conv_state, ids[:1], tensor([1], dtype=torch.int32),
                               tensor([0, 3], dtype=torch.int32), conv_weight=w, conv_bias=None,
                               num_v_heads=HV, draft=3)
    sg_state = zeros(6, DIM, 3, dtype=BF16)
    windows = zeros(2, 3, DIM, 3, dtype=BF16)
    layer_ops.causal_conv_verify(x, sg_state, ids[:1], windows, tensor([1], dtype=torch.int32),
                                 conv_weight=w, conv_bias=bias, num_v_heads=HV, draft=3)
    xp = randn(130, DIM, dtype=BF16)
    layer_ops.causal_conv_checkpoints(xp, sg_state, tensor([4, 5], dtype=torch.int32),
                                      tensor([2, 0], dtype=torch.int32),
                                      tensor([0, 129, 130], dtype=torch.int32), width=4, num_v_heads=HV)
    kinds = [n.split("_hv")[0] for n in _names(launches)]
    assert kinds[:3] == ["gdn_conv_decode", "gdn_conv_spec", "gdn_conv_verify"], kinds
    assert "gdn_conv_prefill_state" in kinds[3:], kinds


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_slot_ids(launches, dtype):
    """The step's slot ids, one launch per kind: decode rows, prefill sequences (with
    cu_seqlens), spec rows [Ns, D]."""
    layer_ops.slot_ids(tensor([3, 0, 5], dtype=dtype), 0)
    layer_ops.slot_ids(tensor([3, 0], dtype=dtype), 0, cu_seqlens=tensor([0, 4, 4], dtype=torch.int32))
    layer_ops.slot_ids(tensor([[1, 2, 3], [0, 0, 0]], dtype=dtype), 0)
    assert [n.split("_hv")[0] for n in _names(launches)] == [
        f"gdn_slot_ids_{kind}_{str(dtype).split('.')[1]}" for kind in ("rows", "seqs", "spec")]


def _cache(slots, dtype=torch.float32, spec_cols=0, hk=HK, hv=HV):
    """vLLM's layer cache shape per slot: a conv window [dim, W - 1 + spec] and a state."""
    dim = (2 * hk + hv) * D
    return zeros(slots, dim, 3 + spec_cols, dtype=BF16), zeros(slots, hv, D, D, dtype=dtype)


def _layer(step, T, conv, ssm, hk=HK, bias=True):
    """One layer call of ``step`` on random bf16 activations and weights (A_log fp32, dt_bias bf16:
    vLLM's Qwen GDN layer), the heads taken from the caches."""
    hv = ssm.shape[1]
    dim = (2 * hk + hv) * D
    x, a, b = randn(T, dim, dtype=BF16), randn(T, hv, dtype=BF16), randn(T, hv, dtype=BF16)
    GL.gdn_layer_forward(step, x, a, b, conv_weight=randn(dim, 4, dtype=BF16),
                         conv_bias=randn(dim, dtype=BF16) if bias else None, activation="silu", conv_state=conv,
                         ssm_state=ssm, A_log=zeros(hv), dt_bias=zeros(hv, dtype=BF16), num_k_heads=hk,
                         out=zeros(T, hv, D, dtype=BF16))


# (gdn_layer.MIXED_CONV, conv.WINDOW_CTAS): the defaults, then each module switch's other form
@pytest.mark.parametrize("mixed_conv,window_ctas", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("pool_dtype", [torch.float32, BF16])
def test_layer_mixed_step(launches, arch, monkeypatch, pool_dtype, mixed_conv, window_ctas):
    """vLLM's non-spec step, decodes then prefills (one with a checkpoint): the conv (the decodes'
    in the prefill conv's launch, or conv_decode apart; the conv-state write-back by the window
    CTAs, or conv_window after the conv), the prefill core, the decode."""
    monkeypatch.setattr(GL, "MIXED_CONV", mixed_conv)
    monkeypatch.setattr(conv_module, "WINDOW_CTAS", window_ctas)
    conv, ssm = _cache(12, pool_dtype)
    lens = [70, 150]
    T = 2 + sum(lens)
    step = GL.make_step_plan(
        num_actual_tokens=T, num_v_heads=HV, num_k_heads=HK, conv_width=4, device=DEV,
        decode_slots=tensor([3, 7], dtype=torch.int32), prefill_lens=lens,
        prefill_slots=tensor([5, 9], dtype=torch.int32),
        prefill_has_initial_state=tensor([False, True]),
        prefill_checkpoint_chunks=[1, 2], prefill_checkpoint_slots=tensor([10, 11], dtype=torch.int32))
    _layer(step, T, conv, ssm)
    kinds = [n.split("_hv")[0] for n in _names(launches)]
    assert kinds[:2] == ["gdn_slot_ids_rows_int32", "gdn_slot_ids_seqs_int32"], kinds   # decodes, prefills
    assert "gdn_conv_prefill" in kinds and "gdn_decode" in kinds, kinds
    assert ("gdn_conv_decode" in kinds) == (not (mixed_conv and window_ctas)), kinds
    assert "gdn_conv_prefill_state" in kinds, kinds   # the checkpoints' windows (and without window CTAs the write-back)
    assert any("prep" in n for n in kinds) and any("main" in n for n in kinds), kinds
    if mixed_conv and window_ctas:   # the defaults; a switch's other form is a tuning form, built on first use
        _assert_precompiled(launches, arch)


# bench layer's long rows: the planner cuts them into segments (context parallelism)
@pytest.mark.parametrize("lens", [[32768], [8192] * 4, [2048, 1024, 4096, 512, 512]], ids=["1x32768", "4x8192", "mixed"])
def test_layer_long_prefill_step(launches, arch, lens):
    """A prefill step the planner runs with context parallelism: the conv, stage 1, the warmup
    finder, the maps pass, the scan and the output pass."""
    conv, ssm = _cache(len(lens) + 1)
    T = sum(lens)
    step = GL.make_step_plan(num_actual_tokens=T, num_v_heads=HV, num_k_heads=HK, conv_width=4, device=DEV,
                             prefill_lens=lens, prefill_slots=arange(1, len(lens) + 1, dtype=torch.int32),
                             prefill_has_initial_state=tensor([True] * len(lens)))
    assert step.prefill_plan.strategy == "cp"
    _layer(step, T, conv, ssm)
    kinds = [n.split("_hv")[0] for n in _names(launches)]
    assert kinds[:3] == ["gdn_slot_ids_seqs_int32", "gdn_conv_prefill", "gdn_prefill_prep"], kinds
    assert "gdn_prefill_cp_scan" in kinds and kinds.count("gdn_prefill_main") == 2, kinds
    _assert_precompiled(launches, arch)


@pytest.mark.parametrize("decodes", [1, 64, 256])
def test_layer_decode_step(launches, arch, decodes):
    """A decode-only step: the conv, then the decode (its dependent form while decodes x v-heads
    <= 256, gdn_layer's rule)."""
    conv, ssm = _cache(decodes + 1)
    step = GL.make_step_plan(num_actual_tokens=decodes, num_v_heads=HV, num_k_heads=HK, conv_width=4,
                             device=DEV, decode_slots=arange(1, decodes + 1, dtype=torch.int32))
    _layer(step, decodes, conv, ssm)
    names = _names(launches)
    assert [n.split("_hv")[0] for n in names] == ["gdn_slot_ids_rows_int32", "gdn_conv_decode", "gdn_decode"], names
    assert names[-1].endswith("_pdl") == (decodes * HV <= 256), names[-1]
    _assert_precompiled(launches, arch)


@pytest.mark.parametrize("leading", [False, True])
def test_layer_spec_step_with_prefill(launches, arch, leading):
    """vLLM's spec step beside a prefill: conv_spec then verify_slots, and the prefill's chain;
    the rows gathered by vLLM's token indices, or (``leading``) views of the spec tokens first."""
    Dd = 3
    conv, ssm = _cache(20, spec_cols=Dd - 1)
    spec_lens, pre_lens = [3, 2], [9]
    Ts, T = sum(spec_lens), sum(spec_lens) + sum(pre_lens)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(0))
    indices = {} if leading else dict(spec_token_idx=perm[:Ts].sort().values.int().to(DEV),
                                      non_spec_token_idx=perm[Ts:].sort().values.int().to(DEV))
    step = GL.make_step_plan(
        num_actual_tokens=T, num_v_heads=HV, num_k_heads=HK, conv_width=4, device=DEV,
        prefill_lens=pre_lens, prefill_slots=tensor([2], dtype=torch.int32),
        prefill_has_initial_state=tensor([True]),
        spec_slots=tensor([[4, 5, 6], [10, 11, 12]], dtype=torch.int32),
        spec_cu_seqlens=tensor([0, 3, 5], dtype=torch.int32),
        num_accepted=tensor([2, 1], dtype=torch.int32), num_spec_tokens=Ts, **indices)
    _layer(step, T, conv, ssm)
    kinds = [n.split("_hv")[0] for n in _names(launches)]
    assert "gdn_conv_spec" in kinds and "gdn_verify_slots" in kinds and "gdn_conv_prefill" in kinds, kinds
    _assert_precompiled(launches, arch)


# TP-local heads of other deployments (Qwen3-Next at TP1: 16/32; 16/64-head models at TP4 and TP1):
# the host picks tiles, stage-1 heads per CTA, V splits and CP by heads and rows
@pytest.mark.parametrize("hk,hv", [(4, 16), (16, 32), (16, 64)])
@pytest.mark.parametrize("kind", ["decode 64", "mixed", "prefill 4 x 8192"])
def test_layer_steps_at_other_heads(launches, arch, hk, hv, kind):
    """A decode step, a mixed step and a long prefill step at other head counts (no conv bias):
    every launch checked against its program and in the precompile list of those heads."""
    decodes, lens = {"decode 64": (64, []), "mixed": (32, [512] * 4), "prefill 4 x 8192": (0, [8192] * 4)}[kind]
    T, n = decodes + sum(lens), decodes + len(lens)
    kw = dict(decode_slots=arange(1, decodes + 1, dtype=torch.int32)) if decodes else {}
    if lens:
        kw.update(prefill_lens=lens, prefill_slots=arange(decodes + 1, n + 1, dtype=torch.int32),
                  prefill_has_initial_state=tensor([True] * len(lens)))
    step = GL.make_step_plan(num_actual_tokens=T, num_v_heads=hv, num_k_heads=hk, conv_width=4, device=DEV, **kw)
    _layer(step, T, *_cache(n + 1, hk=hk, hv=hv), hk=hk, bias=False)
    kinds = [c.name.split("_hv")[0] for c in launches]
    assert ("gdn_decode" in kinds) == bool(decodes) and ("gdn_prefill_main" in kinds) == bool(lens), kinds
    assert all(f"_hv{hv}_" in c.name or c.name.startswith("gdn_slot_ids") for c in launches), _names(launches)
    _assert_precompiled(launches, arch, hk, hv)


@pytest.mark.parametrize("requests", [2, 16])
def test_sglang_verify_step(launches, arch, requests):
    """SGLang's target-verify step through the plugin's backends/sglang/verify_layer.forward_verify:
    the step's ids (slot ids: one launch), conv_verify, then gdn_verify on strided q | k | v views
    of the conv output, as the conv's dependent launch up to AFTER_CONV_MAX_ROWS rows (requests x
    v-heads; 16 x 8 is past it). ``select_rows`` stands in for SGLang's
    select_verify_intermediate_state_indices without pp_spec_stable_rows (its default rows), as in
    tests/backends/sglang_plugin/test_verify_layer.py."""
    from qla_serve.backends.sglang.verify_layer import AFTER_CONV_MAX_ROWS, forward_verify

    Dd, N = 3, requests
    cache = SimpleNamespace(conv=[zeros(N + 1, DIM, 3, dtype=BF16)], temporal=zeros(N + 1, HV, D, D),
                            intermediate_ssm=zeros(N + 1, Dd, HV, D, D),
                            intermediate_conv_window=[zeros(N + 1, Dd, DIM, 3, dtype=BF16)])
    layer = _sglang_layer()
    meta = SimpleNamespace(mamba_cache_indices=arange(1, N + 1, dtype=torch.int32),
                           query_start_loc=arange(0, (N + 1) * Dd, Dd, dtype=torch.int32))
    backend = SimpleNamespace(forward_metadata=meta, verify_intermediate_state_indices=arange(N + 1, dtype=torch.int32),
                              req_to_token_pool=SimpleNamespace(size=N + 1))
    fb = SimpleNamespace(spec_info=SimpleNamespace(draft_token_num=Dd), req_pool_indices=arange(N))
    forward_verify(backend, layer, fb, randn(N * Dd, DIM, dtype=BF16), randn(N * Dd, HV, dtype=BF16),
                   randn(N * Dd, HV, dtype=BF16), cache, select_rows=lambda rows, req, valid, size: rows)
    names = _names(launches)
    assert [n.split("_hv")[0] for n in names] == ["gdn_slot_ids_rows_int32", "gdn_conv_verify", "gdn_verify"], names
    assert names[-1].endswith("_pdl") == (N * HV <= AFTER_CONV_MAX_ROWS), names
    _assert_precompiled(launches, arch)


def _sglang_layer():
    """The attributes backends/sglang reads from SGLang 0.5.23's RadixLinearAttention (the
    stand-ins of tests/backends/sglang_plugin/test_{decode,extend}_layer.py)."""
    return SimpleNamespace(layer_id=3, conv_weights=randn(DIM, 4, dtype=BF16), bias=None, activation="silu",
                           num_k_heads=HK, num_v_heads=HV, head_k_dim=D, A_log=zeros(HV),
                           dt_bias=zeros(HV, dtype=BF16))


@pytest.mark.parametrize("pool_dtype", [torch.float32, BF16])
def test_sglang_decode_and_extend_steps(launches, arch, pool_dtype):
    """SGLang's decode and extend steps as the plugin runs them (backends/sglang/decode_layer.py,
    extend_layer.py), on SGLang's conv cache [size + 1, dim, W - 1] and temporal pool."""
    from qla_serve.backends.sglang import decode_layer, extend_layer
    from qla_serve.backends.sglang.kernel import ExtendBatch

    conv, ssm = zeros(24, DIM, 3, dtype=BF16), zeros(24, HV, D, D, dtype=pool_dtype)
    cache, layer = SimpleNamespace(conv=[conv], temporal=ssm), _sglang_layer()
    ids = tensor([5, 0, 17, -1], dtype=torch.int32)
    backend = SimpleNamespace(
        forward_metadata=SimpleNamespace(mamba_cache_indices=ids, replayssm_write_pos=None),
        req_to_token_pool=SimpleNamespace(mamba2_layer_cache=lambda layer_id: cache),
        _track_mamba_state_decode=lambda *args: None)
    x, a, b = randn(4, DIM, dtype=BF16), randn(4, HV, dtype=BF16), randn(4, HV, dtype=BF16)
    decode_layer.forward_decode(backend, layer, None, x, a, b)
    decoded = len(launches)
    assert [n.split("_hv")[0] for n in _names(launches)] == ["gdn_slot_ids_rows_int32", "gdn_conv_decode",
                                                            "gdn_decode"]

    lens = [37, 130]
    qsl = tensor([0, 37, 167], dtype=torch.int32)
    backend = SimpleNamespace(forward_metadata=SimpleNamespace(mamba_cache_indices=ids[:2] + 1, query_start_loc=qsl))
    fb = SimpleNamespace(extend_prefix_lens=tensor([0, 12], dtype=torch.int32))
    T = sum(lens) + 3
    x, a, b = randn(T, DIM, dtype=BF16), randn(T, HV, dtype=BF16), randn(T, HV, dtype=BF16)
    extend_layer.forward_extend(backend, layer, fb, x, a, b, ExtendBatch(query_start_loc=qsl, seq_lens=lens,
                                                                           num_tokens=sum(lens)), cache)
    kinds = [n.split("_hv")[0] for n in _names(launches[decoded:])]
    assert kinds[:2] == ["gdn_slot_ids_seqs_int32", "gdn_conv_prefill"] and "gdn_prefill_main" in kinds, kinds
    _assert_precompiled(launches, arch)


def test_the_check_fails_on_a_wrong_launch(launches):
    """The checker itself: a launch with two arguments swapped, one dropped, a wrong dtype or a
    shape that disagrees with another argument's is refused, naming the parameter."""
    q, k, v = _qkv(2)
    pool = zeros(3, HV, D, D)
    qla_serve.gdn_decode(q, k, v, pool, tensor([0, 1], dtype=torch.int32), **_raw_gates(2))
    (call,) = launches
    args = list(call.args.values())
    check_arguments(call.program, tuple(args), "as launched")
    bad = {
        "k and v swapped": args[:1] + [args[2], args[1]] + args[3:],
        "out dropped": args[:-2] + args[-1:],
        "a bf16 pool": args[:7] + [args[7].to(BF16)] + args[8:],
        "out of one row": args[:9] + [args[9][:1]] + args[10:],
        "an int scale": args[:-1] + [1],
    }
    for what, wrong in bad.items():
        with pytest.raises(AssertionError):
            check_arguments(call.program, tuple(wrong), what)
