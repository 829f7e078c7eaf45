"""``--linear-attn-*-backend flashqla`` through SGLang's real argument handling, in subprocesses.

With qla_serve's entry point loaded by SGLang's ``load_plugins()`` (as ``sglang serve`` and the
Engine do before parsing), ``prepare_server_args`` accepts flashqla for the default, decode,
prefill and verify flags; with the plugin filtered out (``SGLANG_PLUGINS`` names another
plugin), SGLang's own parser rejects the same command line. One interpreter per case: plugin
loading is process-global. ~20 s each (SGLang's import).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (.venv-sglang: bash scripts/setup_sglang_env.sh)")

pytestmark = pytest.mark.engine

ARGS = ["--model-path", "/nonexistent-model", "--linear-attn-backend", "flashqla",
        "--linear-attn-decode-backend", "flashqla", "--linear-attn-prefill-backend", "flashqla",
        "--linear-attn-verify-backend", "flashqla"]

CODE = f"""
import warnings; warnings.simplefilter("ignore")
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
sa = prepare_server_args({ARGS!r})
print("PARSED", sa.linear_attn_backend, sa.linear_attn_decode_backend,
      sa.linear_attn_prefill_backend, sa.linear_attn_verify_backend)
"""


def test_flag_accepted_with_plugin(run_python):
    r = run_python(CODE)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "PARSED flashqla flashqla flashqla flashqla" in r.stdout


def test_flag_rejected_without_plugin(run_python):
    r = run_python(CODE, env_extra={"SGLANG_PLUGINS": "some_other_plugin"})
    assert r.returncode != 0 and "PARSED" not in r.stdout
    assert "invalid choice: 'flashqla'" in r.stderr, r.stderr[-3000:]
