"""Shared helpers for the SGLang backend tests (``.venv-sglang/bin/python -m pytest tests/backends/sglang_plugin``).

Every test module starts with ``pytest.importorskip("sglang")`` (except the GPU test, which
needs no SGLang), so a venv without SGLang skips them with that reason. Nothing here imports
SGLang at import time.

``sglang_plugin`` (session): runs SGLang's own ``load_plugins()`` in this process, which finds
qla_serve through its ``sglang.srt.plugins`` entry point and applies the HookRegistry hooks to
the real SGLang classes. Tests that need the plugin *absent* run in a subprocess.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import pytest

HERE = pathlib.Path(__file__).parent
REPO = HERE.parents[2]


@pytest.fixture(scope="session")
def sglang_plugin():
    warnings.filterwarnings("ignore", module="sglang")
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="sglang.srt.plugins") if e.value.startswith("qla_serve")]
    assert eps, ("qla_serve's sglang.srt.plugins entry point is not installed: pyproject needs "
                 '[project.entry-points."sglang.srt.plugins"] qla_serve = "qla_serve.backends.sglang:register" '
                 "and a reinstall (bash scripts/setup_sglang_env.sh)")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.plugins.hook_registry import HookRegistry

    from qla_serve.backends.sglang import plugin

    missing = {plugin.TARGET_BACKEND_INIT, plugin.TARGET_DISPATCHER_INIT, plugin.TARGET_METADATA,
               plugin.TARGET_FORWARD_DECODE} - HookRegistry._patched
    assert not missing, f"hooks not applied by SGLang's load_plugins: {sorted(missing)}"
    return plugin


@pytest.fixture
def run_python():
    """``run_python(code, env_extra=None)``: run ``code`` in a fresh interpreter of this venv
    (SGLang keeps process-global state); returns the CompletedProcess."""
    def run(code: str, *, env_extra=None, timeout=240) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env.update(env_extra or {})
        env.setdefault("PYTHONWARNINGS", "ignore")
        return subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=env, capture_output=True,
                              text=True, timeout=timeout)
    return run


# ---------------------------------------------------------------------------------------------
# SGLang's GDN test kit (sglang/test/kits/attention_unittest/attention_methods/gdn_attention.py)
# on CPU. Only what cannot run on a CPU machine is replaced, each by a plain torch equivalent:
#   * gdn_backend.causal_conv1d_fn / causal_conv1d_update / fused_gdn_gating: Triton kernels
#     (no Triton driver without a GPU) -> torch loops below, same signatures and state layout
#     (the update also in its target-verify form: D tokens per row, per-token windows kept);
#   * the kit's full-attention backend "triton" (Triton metadata kernels; no full-attention layer
#     exists in the kit) -> SGLang's own "torch_native" backend;
#   * torch.cuda.get/set_rng_state (CUDA-only; the kit saves and restores the RNG around its
#     prefix-state seeding) -> the CPU generator's;
#   * parallel ranks the full-attention backend reads (attn_dcp_rank/size: normally stamped when
#     process groups are built) -> stamped as a single rank.
# The flag values reach SGLang the way a server's do: through its server-args context, by adding
# them to the override the kit's mock runner installs.
# ---------------------------------------------------------------------------------------------

def _torch_conv_fn(x, weight, bias=None, activation=None, conv_states=None, has_initial_state=None,
                   cache_indices=None, query_start_loc=None, seq_lens_cpu=None, **_):
    """causal_conv1d_fn: x [dim, T] packed by query_start_loc; conv_states [slots, dim, W-1]."""
    import torch
    import torch.nn.functional as F

    out = torch.empty_like(x)
    W = weight.shape[1]
    cu = query_start_loc.tolist()
    for i, (s, e) in enumerate(zip(cu, cu[1:])):
        slot = int(cache_indices[i])
        hist = (conv_states[slot].to(x.dtype) if bool(has_initial_state[i])
                else x.new_zeros(x.shape[0], W - 1))
        full = torch.cat([hist, x[:, s:e]], 1).float()
        y = F.conv1d(full[None], weight.float()[:, None], None if bias is None else bias.float(),
                     groups=x.shape[0])[0]
        out[:, s:e] = (F.silu(y) if activation in ("silu", "swish") else y).to(x.dtype)
        if slot >= 0:
            conv_states[slot] = full[:, -(W - 1):].to(conv_states.dtype)
    return out


def _torch_conv_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                       intermediate_conv_window=None, intermediate_state_indices=None, **_):
    """causal_conv1d_update: x [B, dim] (one token per row) or [B, dim, D] (target verify: D draft
    tokens, the window after each into intermediate_conv_window[intermediate_state_indices[r], j]
    as SGLang's Triton kernel stores it, mamba/causal_conv1d_triton.py); conv_state [slots, dim,
    W-1] becomes the window after the last token."""
    import torch
    import torch.nn.functional as F

    W = weight.shape[1]
    tokens = x if x.dim() == 3 else x[:, :, None]
    out = torch.zeros_like(tokens)
    for r in range(tokens.shape[0]):
        slot = int(conv_state_indices[r])
        if slot < 0:
            continue
        full = torch.cat([conv_state[slot, :, -(W - 1):].to(x.dtype), tokens[r]], 1).float()
        for j in range(tokens.shape[2]):
            y = (full[:, j:j + W] * weight.float()).sum(-1) + (0 if bias is None else bias.float())
            out[r, :, j] = (F.silu(y) if activation in ("silu", "swish") else y).to(x.dtype)
            if intermediate_conv_window is not None:
                row = int(intermediate_state_indices[r])
                intermediate_conv_window[row, j] = full[:, j + 1:j + W].to(intermediate_conv_window.dtype)
        conv_state[slot] = full[:, -(W - 1):].to(conv_state.dtype)
    return out if x.dim() == 3 else out[:, :, 0]


def _torch_gdn_gating(A_log, a, b, dt_bias):
    """fused_gdn_gating: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), each [1, T, Hv] fp32."""
    import torch
    import torch.nn.functional as F

    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g[None], torch.sigmoid(b.float())[None]


@pytest.fixture
def gdn_kit(sglang_plugin, monkeypatch):
    """``gdn_kit(**flags)`` -> the kit module, with ``flags`` (e.g. linear_attn_backend="flashqla")
    applied to every mock runner the kit builds in this test."""
    import torch

    import sglang.srt.layers.attention.linear.gdn_backend as gb
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.test.kits.attention_unittest.attention_methods import gdn_attention as kit

    monkeypatch.setattr(gb, "causal_conv1d_fn", _torch_conv_fn)
    monkeypatch.setattr(gb, "causal_conv1d_update", _torch_conv_update)
    monkeypatch.setattr(gb, "fused_gdn_gating", _torch_gdn_gating)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.get_rng_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: None)
    get_parallel().override_permanently(attn_dcp_rank=0, attn_dcp_size=1)
    ctx_cls = type(get_context())
    original = ctx_cls.override_server_args

    def configure(**flags):
        def override(self, **fields):
            fields.update(flags)
            return original(self, **fields)
        monkeypatch.setattr(ctx_cls, "override_server_args", override)
        return kit

    return configure
