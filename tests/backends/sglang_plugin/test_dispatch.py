"""Which kernel SGLang's GDN dispatcher runs per phase, for each flag combination, and the
start-up refusals — with the plugin loaded by SGLang's ``load_plugins()`` into the real classes.

Combinations go through SGLang's own path: flags published with its server-args context,
``resolve_linear_attn_backends()`` (what the attention registry calls), then the hooked
``GDNKernelDispatcher``. Refusals go through the hooked ``GDNAttnBackend.__init__`` as SGLang's
GDN test kit builds it (see test_sglang_kit.py for what the kit swaps on CPU).
"""

from __future__ import annotations

import unittest

import pytest
import torch

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (.venv-sglang: bash scripts/setup_sglang_env.sh)")

pytestmark = pytest.mark.engine

Q, T = "FlashQLAGDNKernel", "TritonGDNKernel"

# flags -> (decode, extend, verify) kernel class names
COMBOS = [
    (dict(linear_attn_backend="flashqla"), (Q, Q, Q)),
    (dict(linear_attn_backend="flashqla", linear_attn_verify_backend="triton"), (Q, Q, T)),
    (dict(linear_attn_backend="flashqla", linear_attn_prefill_backend="triton"), (Q, T, Q)),
    (dict(linear_attn_backend="flashqla", linear_attn_decode_backend="triton"), (T, Q, T)),
    (dict(linear_attn_prefill_backend="flashqla"), (T, Q, T)),
    (dict(linear_attn_decode_backend="flashqla"), (Q, T, Q)),
    (dict(linear_attn_decode_backend="flashqla", linear_attn_verify_backend="triton"), (Q, T, T)),
    (dict(linear_attn_verify_backend="flashqla"), (T, T, Q)),
    (dict(), (T, T, T)),
]


@pytest.mark.parametrize("flags,expected", COMBOS, ids=[",".join(f"{k[12:]}={v}" for k, v in f.items()) or "defaults"
                                                         for f, _ in COMBOS])
def test_flag_combination_installs_kernels(sglang_plugin, flags, expected):
    from sglang.srt.layers.attention.linear.gdn_backend import GDNKernelDispatcher
    from sglang.srt.layers.attention.linear.utils import resolve_linear_attn_backends
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(**flags):
        b = resolve_linear_attn_backends()
        d = GDNKernelDispatcher(b.decode, b.prefill, b.verify)
    got = tuple(type(x).__name__ for x in (d.decode_kernel, d.extend_kernel, d.verify_kernel))
    assert got == expected
    assert type(d.tree_verify_kernel).__name__ == T  # SGLang's tree-draft verify stays Triton
    if Q in expected:
        kernels = {id(x) for x in (d.decode_kernel, d.extend_kernel, d.verify_kernel) if type(x).__name__ == Q}
        assert kernels == {id(d.qla_kernel)}, "one flashqla kernel object per dispatcher"
        if expected[0] == Q:  # SGLang must not take its packed (Triton-only) decode route
            assert d.supports_packed_decode is False
    else:
        assert not hasattr(d, "qla_kernel")


def test_another_custom_backend_name_is_not_taken(sglang_plugin):
    """A CUSTOM name that is not flashqla stays SGLang's business (its dispatcher raises)."""
    from sglang.srt.layers.attention.linear.gdn_backend import GDNKernelDispatcher
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend
    from sglang.srt.runtime_context import get_context

    custom = LinearAttnKernelBackend("someone_elses")
    assert custom.is_custom()
    with get_context().override_server_args():
        with pytest.raises(ValueError, match="Unsupported GDN decode backend"):
            GDNKernelDispatcher(custom, LinearAttnKernelBackend.TRITON, None)


def _build(kit, **case_kw):
    import dataclasses
    case = next(c for c in kit.make_gdn_cases("triton") if c.name == "gdn_extend_page_size_1")
    case = dataclasses.replace(case, backend="torch_native", **case_kw)
    return kit.build_gdn_attention_fixture(unittest.TestCase(), case, head_k_dim=128, head_v_dim=128,
                                           device="cpu", dtype=torch.bfloat16)


def test_startup_accepts_a_good_configuration(gdn_kit):
    fixture = _build(gdn_kit(linear_attn_backend="flashqla"))
    assert type(fixture.backend.linear_attn_backend.kernel_dispatcher.extend_kernel).__name__ == Q


def test_startup_refuses_head_dim_other_than_128(gdn_kit):
    kit = gdn_kit(linear_attn_backend="flashqla")
    import dataclasses
    case = dataclasses.replace(kit.make_gdn_cases("triton")[0], backend="torch_native")
    with pytest.raises(ValueError, match="head dim 128"):
        kit.build_gdn_attention_fixture(unittest.TestCase(), case, head_k_dim=32, head_v_dim=32,
                                        device="cpu", dtype=torch.bfloat16)


def test_extra_buffer_with_flashqla_prefill(gdn_kit):
    """extra_buffer is served: the kernel fills SGLang's track snapshot (test_kernel_contract)."""
    kit = gdn_kit(linear_attn_prefill_backend="flashqla", mamba_radix_cache_strategy="extra_buffer")
    d = _build(kit).backend.linear_attn_backend.kernel_dispatcher
    assert type(d.extend_kernel).__name__ == Q and d.extend_kernel.supports_track_state_snapshot


def test_extra_buffer_is_fine_when_prefill_is_not_flashqla(gdn_kit):
    kit = gdn_kit(linear_attn_decode_backend="flashqla", linear_attn_verify_backend="triton",
                  mamba_radix_cache_strategy="extra_buffer")
    d = _build(kit).backend.linear_attn_backend.kernel_dispatcher
    assert (type(d.decode_kernel).__name__, type(d.extend_kernel).__name__) == (Q, T)


def test_startup_refuses_tree_drafts_with_flashqla_verify(gdn_kit):
    kit = gdn_kit(linear_attn_backend="flashqla", speculative_algorithm="EAGLE", speculative_eagle_topk=4)
    with pytest.raises(ValueError, match="tree drafts"):
        _build(kit)


def test_verify_is_not_checked_without_speculative_decoding(gdn_kit, sglang_plugin):
    """A flashqla decode implies a flashqla verify, which only matters under speculative decoding."""
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(linear_attn_backend="flashqla", speculative_eagle_topk=4):
        phases = sglang_plugin.requested_phases()
        assert phases["verify"]
        assert sglang_plugin.startup_problems(phases, ssm_shape=(1, 3, 2, 128, 128),
                                              ssm_dtype=torch.float32, device="cpu") == []


def test_startup_refuses_a_path_that_cannot_run(gdn_kit, monkeypatch):
    monkeypatch.setenv("QLA_SERVE_OP_PATH", "tilelang")   # TileLang kernels need a GPU
    with pytest.raises(ValueError, match="cannot start"):
        _build(gdn_kit(linear_attn_backend="flashqla"))


def test_startup_problems_pool_dtype(sglang_plugin):
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(linear_attn_backend="flashqla"):
        phases = sglang_plugin.requested_phases()
        assert phases == {"decode": True, "prefill": True, "verify": True}
        ok = sglang_plugin.startup_problems(phases, ssm_shape=(3, 9, 4, 128, 128), ssm_dtype=torch.float32,
                                            device="cpu")
        bad = sglang_plugin.startup_problems(phases, ssm_shape=(3, 9, 4, 128, 128), ssm_dtype=torch.float16,
                                             device="cpu")
    assert ok == [] and len(bad) == 1 and "float32 or bfloat16" in bad[0]


@pytest.mark.parametrize("graph", ["full", "breakable", "disabled"])
def test_startup_refuses_full_prefill_cuda_graphs(sglang_plugin, graph):
    """--cuda-graph-backend-prefill full would replay one batch's prefill plan for every batch;
    breakable (SGLang's CUDA default) and disabled run the GDN layers eagerly, planned per batch."""
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig
    from sglang.srt.runtime_context import get_context

    config = CudaGraphConfig(prefill=PhaseConfig(backend=graph))
    kw = dict(ssm_shape=(3, 9, 4, 128, 128), ssm_dtype=torch.float32, device="cpu")
    with get_context().override_server_args(linear_attn_backend="flashqla", cuda_graph_config=config):
        problems = sglang_plugin.startup_problems(sglang_plugin.requested_phases(), **kw)
    with get_context().override_server_args(linear_attn_backend="triton", linear_attn_decode_backend="flashqla",
                                             cuda_graph_config=config):
        decode_only = sglang_plugin.startup_problems(sglang_plugin.requested_phases(), **kw)
    if graph == "full":
        assert len(problems) == 1 and "--cuda-graph-backend-prefill full" in problems[0]
        assert "breakable" in problems[0] and "--linear-attn-prefill-backend triton" in problems[0]
    else:
        assert problems == []
    assert decode_only == []           # a triton prefill is SGLang's own business


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_conv_takeover_switch(sglang_plugin, monkeypatch, phase):
    """$QLA_SERVE_SGLANG_DECODE_CONV / $QLA_SERVE_SGLANG_EXTEND_CONV: 1 (default) takes SGLang's
    decode / extend conv over, 0 keeps it; any other value is named in the start-up problems of a
    flashqla decode / prefill (and only then)."""
    from sglang.srt.runtime_context import get_context

    env = sglang_plugin.ENV_DECODE_CONV if phase == "decode" else sglang_plugin.ENV_EXTEND_CONV
    assert sglang_plugin.conv_takeover_from_env(env, {}) is True
    assert sglang_plugin.conv_takeover_from_env(env, {env: "0"}) is False
    with pytest.raises(ValueError, match=f"^{env}: expected 1 .* got 'yes'"):
        sglang_plugin.conv_takeover_from_env(env, {env: "yes"})
    monkeypatch.setenv(env, "yes")
    kw = dict(ssm_shape=(3, 9, 4, 128, 128), ssm_dtype=torch.float32, device="cpu")
    with get_context().override_server_args(linear_attn_backend="flashqla"):
        both = sglang_plugin.startup_problems(sglang_plugin.requested_phases(), **kw)
    with get_context().override_server_args(linear_attn_backend="triton", linear_attn_prefill_backend="flashqla"):
        prefill_only = sglang_plugin.startup_problems(sglang_plugin.requested_phases(), **kw)
    with get_context().override_server_args(linear_attn_backend="triton", linear_attn_decode_backend="flashqla"):
        decode_only = sglang_plugin.startup_problems(sglang_plugin.requested_phases(), **kw)
    assert len(both) == 1 and both[0].startswith(f"{env}: expected 1")
    mine, other = (decode_only, prefill_only) if phase == "decode" else (prefill_only, decode_only)
    assert mine == both and other == []


def test_verify_conv_switch(sglang_plugin):
    """$QLA_SERVE_SGLANG_VERIFY_CONV: 1 (default) or 0, another value named (it is a start-up
    problem of a flashqla verify under speculative decoding, as the other two switches are of
    their phases)."""
    env = sglang_plugin.ENV_VERIFY_CONV
    assert sglang_plugin.conv_takeover_from_env(env, {}) is True
    assert sglang_plugin.conv_takeover_from_env(env, {env: "0"}) is False
    with pytest.raises(ValueError, match=f"^{env}: expected 1 \\(flashqla's verify runs SGLang's verify conv"):
        sglang_plugin.conv_takeover_from_env(env, {env: "2"})


def _verify_hook_call(sglang_plugin, monkeypatch, *, take_over=True, parent=None, kernel_is_verify=True,
                      replay=False, tuple_input=False):
    """plugin._forward_extend_hook on a target-verify step: which route it takes. Stand-ins
    (SimpleNamespace) for SGLang's backend and batch: a target-verify ForwardBatch needs SGLang's
    speculative verify input objects, which its CPU test kit does not build for GDN."""
    from types import SimpleNamespace

    from qla_serve.backends.sglang import verify_layer

    kernel = object()
    cache = SimpleNamespace(intermediate_ssm=object(), replayssm_rawv=object() if replay else None, replayssm_d=None)
    backend = SimpleNamespace(
        kernel_dispatcher=SimpleNamespace(qla_kernel=kernel, verify_kernel=kernel if kernel_is_verify else object()),
        forward_metadata=SimpleNamespace(retrieve_parent_token=parent), mis_metadata=None,
        req_to_token_pool=SimpleNamespace(mamba2_layer_cache=lambda layer_id: cache))
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True))
    monkeypatch.setitem(sglang_plugin.TAKE_OVER_CONV, "verify", take_over)
    monkeypatch.setattr(verify_layer, "forward_verify", lambda *a, **kw: "qla")
    x = (torch.zeros(2), torch.zeros(2)) if tuple_input else torch.zeros(2, 2)
    return sglang_plugin._forward_extend_hook(lambda *a, **kw: "sglang", backend, SimpleNamespace(layer_id=0),
                                              fb, x, None, None)


def test_verify_hook_routes(sglang_plugin, monkeypatch):
    """A plain linear-chain verify with flashqla's verify kernel runs on verify_layer; a tree
    (retrieve_parent_token), the switch at 0, another verify kernel, ReplaySSM's ring or a tuple
    input stay on SGLang's forward_extend."""
    assert _verify_hook_call(sglang_plugin, monkeypatch) == "qla"
    assert _verify_hook_call(sglang_plugin, monkeypatch, parent=torch.zeros(1)) == "sglang"
    assert _verify_hook_call(sglang_plugin, monkeypatch, take_over=False) == "sglang"
    assert _verify_hook_call(sglang_plugin, monkeypatch, kernel_is_verify=False) == "sglang"
    assert _verify_hook_call(sglang_plugin, monkeypatch, replay=True) == "sglang"
    assert _verify_hook_call(sglang_plugin, monkeypatch, tuple_input=True) == "sglang"
