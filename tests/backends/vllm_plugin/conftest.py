"""Fixtures for the vLLM backend tests (run with `.venv-vllm/bin/python -m pytest tests/backends/vllm_plugin`).

Every test module starts with ``pytest.importorskip("vllm.engine.arg_utils")`` (not bare "vllm":
this very folder is importable as a namespace package named vllm), so the core venv skips them
with that reason. Tiny models are built once per session; engines run in subprocesses (vLLM keeps
process-global state) with per-test stats directories for the per-process path counters.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{kind: dir} for every tiny_model.KINDS (Qwen3-Next, dense Qwen3.5, Qwen3.5 MoE as the
    released multimodal class): random bf16 checkpoints built offline."""
    pytest.importorskip("transformers")
    from qla_serve.backends.vllm.tiny_model import KINDS, build_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: build_tiny_model(root / kind, kind) for kind in KINDS}
