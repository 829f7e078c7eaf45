"""Tripwire: the SGLang 0.5.23 internals the plugin relies on, so an SGLang upgrade fails here.

Checked against the installed wheel: the version; the plugin group, loader and HookRegistry
API; the flag fields and the choice-list hook; the backend enum's CUSTOM fallback; the
dispatcher's constructor and attributes; the kernel interface (methods, keyword arguments,
class flags); what GDNAttnBackend passes to its kernels (call sites, by source); the metadata
fields the plan hook reads; the pool and padding conventions.
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (.venv-sglang: bash scripts/setup_sglang_env.sh)")

pytestmark = pytest.mark.engine


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_version():
    import sglang
    from qla_serve.backends.sglang.plugin import SUPPORTED_SGLANG

    assert sglang.__version__ == SUPPORTED_SGLANG == "0.5.23"


def test_plugin_loader_and_hook_registry():
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    assert plugins.GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"
    assert callable(plugins.load_plugins)
    assert _params(HookRegistry.register)[:3] == ["target", "hook", "hook_type"]
    assert HookType.AROUND.value == "around"
    assert hasattr(HookRegistry, "_patched")  # the tests read which targets were applied


def test_entry_point_registered():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}
    assert eps.get("qla_serve") == "qla_serve.backends.sglang:register", eps


def test_flag_fields_and_choices():
    import typing

    from sglang.srt.arg_groups import choices
    from sglang.srt.arg_groups.fields.exec_ import ExecMamba
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

    # add_linear_attn_kernel_backend_choices is the shared list's extend (decode/prefill/base).
    assert choices.add_linear_attn_kernel_backend_choices.__self__ is choices.LINEAR_ATTN_KERNEL_BACKEND_CHOICES
    fields = set(ExecMamba.__struct_fields__)
    for f in ("linear_attn_backend", "linear_attn_decode_backend", "linear_attn_prefill_backend",
              "linear_attn_verify_backend", "mamba_radix_cache_strategy"):
        assert f in fields, f
    assert hasattr(ExecMamba, "enable_mamba_extra_buffer")  # derived; the extra_buffer check reads it
    hint = typing.get_type_hints(ExecMamba, include_extras=True)["linear_attn_verify_backend"]
    assert any(isinstance(getattr(m, "choices", None), list) for m in hint.__metadata__)
    assert LinearAttnKernelBackend("flashqla") is LinearAttnKernelBackend.CUSTOM


def test_resolve_backends_rule():
    """Unset verify follows decode only for flashinfer, else triton (the plugin adds flashqla)."""
    from sglang.srt.layers.attention.linear.utils import resolve_linear_attn_backends
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(linear_attn_backend="triton", linear_attn_decode_backend="flashinfer"):
        assert resolve_linear_attn_backends().verify.value == "flashinfer"
    with get_context().override_server_args(linear_attn_backend="cutedsl"):
        assert resolve_linear_attn_backends().verify.value == "triton"


def test_dispatcher_constructor_and_attributes():
    from sglang.srt.layers.attention.linear.gdn_backend import GDNKernelDispatcher
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend as B
    from sglang.srt.runtime_context import get_context

    sig = inspect.signature(GDNKernelDispatcher.__init__)
    assert list(sig.parameters) == ["self", "decode_backend", "prefill_backend", "verify_backend"]
    assert sig.parameters["verify_backend"].default is None
    with get_context().override_server_args():
        d = GDNKernelDispatcher(B.TRITON, B.TRITON, B.TRITON)
    for attr in ("decode_kernel", "extend_kernel", "verify_kernel", "tree_verify_kernel",
                 "verify_kernel_is_flashinfer", "supports_packed_decode"):
        assert hasattr(d, attr), attr
    # The dispatcher forwards to these kernel methods with these names.
    src = inspect.getsource(GDNKernelDispatcher)
    for call in ("self.decode_kernel.decode(", "self.extend_kernel.extend(", "verify_kernel.target_verify(",
                 "self.decode_kernel.packed_decode("):
        assert call in src, call
    with pytest.raises(ValueError, match="Unsupported GDN decode backend"):
        with get_context().override_server_args():
            GDNKernelDispatcher(B("not_a_backend"), B.TRITON)


def test_kernel_interface():
    from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase

    assert LinearAttnKernelBase.__abstractmethods__ == frozenset({"decode", "extend"})
    assert _params(LinearAttnKernelBase.decode) == ["self", "q", "k", "v", "a", "b", "A_log", "dt_bias",
                                                    "ssm_states", "cache_indices", "query_start_loc", "kwargs"]
    assert _params(LinearAttnKernelBase.extend) == ["self", "q", "k", "v", "g", "beta", "ssm_states",
                                                    "cache_indices", "query_start_loc", "kwargs"]
    assert _params(LinearAttnKernelBase.target_verify) == ["self", "A_log", "dt_bias", "q", "k", "v", "a", "b",
                                                           "ssm_states", "cache_indices", "query_start_loc",
                                                           "kwargs"]
    for flag in ("uses_state_checkpoints", "supports_strided_target_verify_qkv",
                 "supports_track_state_snapshot", "supports_fused_chain_verify"):
        assert getattr(LinearAttnKernelBase, flag) is False, flag


def test_backend_call_sites():
    """What GDNAttnBackend hands the kernels: the keyword names the kernel class reads."""
    from sglang.srt.layers.attention.linear import gdn_backend

    src = inspect.getsource(gdn_backend.GDNAttnBackend)
    # extend: fp32 gates from fused_gdn_gating, output buffer, extra_buffer snapshot args
    for kw in ("g=g,", "beta=beta,", "cache_indices=state_cache_indices,", "query_start_loc=query_start_loc,",
               'output=kwargs.get("linear_attn_output")', "track_state=h_track_buf,"):
        assert kw in src, kw
    # verify: per-draft state buffer and its indices, tree parent pointers
    for kw in ("intermediate_states_buffer=intermediate_state_cache,",
               "intermediate_state_indices=intermediate_state_indices,",
               "cache_steps=forward_batch.spec_info.draft_token_num,",
               "retrieve_parent_token=retrieve_parent_token,"):
        assert kw in src, kw
    # decode: [1, bs, H, D] views of the split conv output
    assert "query = query.view(1, bs, layer.num_q_heads, layer.head_q_dim)" in src
    assert _params(gdn_backend.GDNAttnBackend.__init__) == ["self", "model_runner"]
    assert _params(gdn_backend.GDNAttnBackend.init_forward_metadata) == ["self", "forward_batch"]
    # extra_buffer snapshot: allocated only for kernels that declare support, cut points per row
    assert "extend_kernel.supports_track_state_snapshot" in src
    assert "track_chunk_idx=(" in src
    # MIS (inplace_update=False) is refused for non-triton prefill by SGLang itself
    assert "requires the Triton linear-attention prefill" in inspect.getsource(gdn_backend.validate_gdn_mis_backend)


def test_forward_decode_hook_points():
    """What the forward_decode hook (plugin.py, decode_layer.py) relies on: the method's parameters,
    its conv call (the one the hook replaces) and the Qwen3.5 tuple route it leaves, the track-save
    it calls after the layer, and a new ForwardMetadata object per forward batch (the decode step
    plan is kept on it)."""
    from sglang.srt.layers.attention import hybrid_linear_attn_backend as h
    from sglang.srt.layers.attention.linear import gdn_backend
    from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

    fd = gdn_backend.GDNAttnBackend.forward_decode
    assert _params(fd) == ["self", "layer", "forward_batch", "mixed_qkv", "a", "b", "kwargs"]
    src = inspect.getsource(fd)
    for line in ("conv_states = layer_cache.conv[0]", "ssm_states = layer_cache.temporal",
                 "cache_indices = self.forward_metadata.mamba_cache_indices",
                 "replayssm_write_pos = self.forward_metadata.replayssm_write_pos",
                 "if isinstance(mixed_qkv, tuple):", "mixed_qkv = causal_conv1d_update(",
                 "conv_state_indices=cache_indices,", "cache_indices=cache_indices,",
                 "return (core_attn_out, z) if return_z else core_attn_out"):
        assert line in src, line
    assert _params(h.MambaAttnBackendBase._track_mamba_state_decode) == [
        "self", "forward_batch", "conv_states", "ssm_states", "cache_indices", "layer_id"]
    base = inspect.getsource(h.MambaAttnBackendBase)
    assert "self.forward_metadata = self._forward_metadata(forward_batch)" in base
    assert base.count("self.forward_metadata = ") >= 3      # eager, capture and replay: a new object each
    for name in ("layer_id", "conv_weights", "bias", "activation", "A_log", "dt_bias", "num_k_heads", "head_k_dim"):
        assert name in _params(RadixLinearAttention.__init__), name


def test_forward_extend_hook_points():
    """What the forward_extend hook (plugin.py, extend_layer.py) relies on: the method's parameters
    and the SGLang output buffer it may write into (radix_linear_attention.py), the conv, split and
    gating it replaces, the steps it leaves (verify, MIS, extra_buffer tracking, the page-major
    gather), where the conv reads its history (extend_prefix_lens > 0) and its conv cache."""
    from sglang.srt.layers import radix_linear_attention as rla
    from sglang.srt.layers.attention.linear import gdn_backend

    fe = gdn_backend.GDNAttnBackend.forward_extend
    assert _params(fe) == ["self", "layer", "forward_batch", "mixed_qkv", "a", "b", "kwargs"]
    src = inspect.getsource(fe)
    for line in ("conv_states = mamba_cache_params.conv[0]", "ssm_states = mamba_cache_params.temporal",
                 "cache_indices = forward_metadata.mamba_cache_indices",
                 "query_start_loc = forward_metadata.query_start_loc",
                 "if self.mis_metadata is not None:", "if is_target_verify:",
                 "if forward_metadata.has_mamba_track_mask:", "needs_state_gather = (",
                 "mixed_qkv = self._convolve_prefill(", "query, key, value = fused_qkv_split_gdn_prefill(",
                 "g, beta = self._prefill_gates(layer, a, b)", 'output=kwargs.get("linear_attn_output"),',
                 "return core_attn_out"):
        assert line in src, line
    conv = inspect.getsource(gdn_backend.GDNAttnBackend._convolve_prefill)
    assert "has_initial_state=forward_batch.extend_prefix_lens > 0," in conv
    assert "activation=layer.activation," in conv
    assert "fused_gdn_gating(layer.A_log, a, b, layer.dt_bias)" in inspect.getsource(
        gdn_backend.GDNAttnBackend._prefill_gates)
    impl = inspect.getsource(rla._linear_attention_with_output_impl)
    assert "logical_output = output[:, :real_num_tokens]" in impl
    assert "linear_attn_output=logical_output," in impl
    # the target-verify branch verify_layer.py replaces: its conv over D draft tokens per request
    # with the per-draft windows into the intermediate conv cache, the rows it picks for them,
    # then the kernel's target_verify (retrieve_parent_token: trees, left to SGLang)
    for line in ("intermediate_state_cache = mamba_cache_params.intermediate_ssm",
                 "mamba_cache_params.intermediate_conv_window[0]",
                 "intermediate_state_indices = select_verify_intermediate_state_indices(",
                 "self.verify_intermediate_state_indices,", "forward_batch.req_pool_indices,",
                 "cache_indices[: query_start_loc.shape[0] - 1] >= 0,", "self.req_to_token_pool.size,",
                 "batch_size = seq_len // forward_batch.spec_info.draft_token_num",
                 "conv_state_indices=cache_indices[:batch_size],",
                 "intermediate_conv_window=intermediate_conv_window_cache,",
                 "intermediate_state_indices=intermediate_state_indices[:batch_size],",
                 "retrieve_parent_token=retrieve_parent_token,", "intermediate_states_buffer=intermediate_state_cache,"):
        assert line in src, line
    from sglang.kernels.ops.mamba import causal_conv1d_triton as conv
    upd = inspect.getsource(conv)
    assert "# Save the window state after consuming this token" in upd
    assert "# Layout: [seq(cache line), step, dim, win(K-1)]" in upd


def test_prefill_cuda_graph_contract():
    """SGLang's default prefill graph on CUDA is breakable; it breaks out at every GDN layer
    (GDNAttnBackend does not declare in-graph extend) and, for backends without captured
    metadata, replays through init_forward_metadata, which the plan hook wraps. The full
    backend replays through init_forward_metadata_out_graph instead: the plugin refuses it."""
    from sglang.srt.layers.attention import hybrid_linear_attn_backend as h
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
    from sglang.srt.model_executor import cuda_graph_config as cg
    from sglang.srt.model_executor.runner import prefill_cuda_graph_runner as runner

    assert "Backend.BREAKABLE if is_cuda() else Backend.DISABLED" in inspect.getsource(cg.default_prefill_backend)
    assert GDNAttnBackend.supports_prefill_graph_extend is h.MambaAttnBackendBase.supports_prefill_graph_extend
    assert "return False" in inspect.getsource(h.MambaAttnBackendBase.supports_prefill_graph_extend)
    replay = inspect.getsource(runner.PrefillCudaGraphRunner._prepare_forward_metadata_for_replay)
    assert "attn_backend.init_forward_metadata_out_graph(padded_view)" in replay      # full
    assert "elif not self.use_captured_attn_metadata:" in replay                       # breakable, generic
    assert "init_forward_metadata(forward_batch)" in replay
    assert _params(cg.check_cuda_graph_backend) == ["phase", "backend"]


def test_forward_metadata_fields():
    import dataclasses

    from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata

    names = {f.name for f in dataclasses.fields(ForwardMetadata)}
    assert {"query_start_loc", "mamba_cache_indices", "has_mamba_track_mask"} <= names
    assert not hasattr(ForwardMetadata, "__slots__")  # the plan hook attaches qla_extend to it
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    assert "extend_seq_lens_cpu" in {f.name for f in dataclasses.fields(ForwardBatch)}


def test_pool_and_padding_conventions():
    from sglang.srt.layers.attention import hybrid_linear_attn_backend as h
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

    assert "torch.arange(\n            1, self.size + 1" in inspect.getsource(MambaSlotAllocator.clear)
    src = inspect.getsource(h.MambaAttnBackendBase)
    assert "mamba_indices[bs - num_padding :] = -1" in src       # CUDA-graph padding rows
    assert "padding slot 0" in src                              # eager padding rows


def test_extra_buffer_track_plan():
    """The host track plan the metadata hook reuses, and SGLang's own extra_buffer gate."""
    from sglang.srt.arg_groups import overrides
    from sglang.srt.layers.attention.mamba.prefill_track_metadata import build_prefill_track_plan

    tp = build_prefill_track_plan([True, True, False], [100, 128, 30], [100, 128, 30], [0, 0, 0], 64,
                                  mamba2=False)
    assert tp.chunk_indices == [1, -1, -1]             # 100 -> after 1 chunk; 128 aligned -> final state
    assert tp.unaligned_rows == [0] and tp.final_rows == [1]
    # docs/sglang.md: SGLang allows extra_buffer only with --linear-attn-backend triton
    assert 'view.linear_attn_backend == "triton"' in inspect.getsource(overrides.supports_mamba_cache_extra_buffer)
