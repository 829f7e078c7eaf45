"""Per-process counters of which GDN path ran, for tests (off unless the env var is set).

``QLA_SERVE_VLLM_STATS_DIR=DIR``: every vLLM process that runs a GDN layer writes
``DIR/<pid>.json`` = {"pid", "counts": {kind: n}} after each call (atomic rename), so a test can
read what the *worker* process did. Kinds: ``qla:decode``, ``qla:prefill``,
``qla:resumed_prefill``, ``qla:spec`` (sequences, summed over layer calls), ``qla:calls``, and
``stock:<name>`` for each call of vLLM's own GDN entry points and kernels (wrapped only when the
env var is set, so production processes run vLLM's functions untouched).
"""

from __future__ import annotations

import collections
import functools
import json
import os

ENV = "QLA_SERVE_VLLM_STATS_DIR"
_counts: collections.Counter = collections.Counter()


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def hit(kind: str, n: int = 1) -> None:
    _counts[kind] += n


def flush() -> None:
    d = os.environ.get(ENV)
    if not d:
        return
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "counts": dict(_counts)}, f)
    os.replace(path + ".tmp", path)


def read_all(d) -> dict:
    """Sum of every process's counts under ``d`` plus the per-pid dicts (test helper)."""
    total, per = collections.Counter(), {}
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else ():
        if name.endswith(".json"):
            with open(os.path.join(d, name)) as f:
                rec = json.load(f)
            per[rec["pid"]] = rec["counts"]
            total.update(rec["counts"])
    return {"total": dict(total), "per_pid": per}


# vLLM's own GDN entry points and kernels (module, attribute); missing ones are skipped.
_STOCK = (
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention.forward_cpu"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention.forward_cuda"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention.forward_xpu"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention.forward_hip"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention._forward_core"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "fla_chunk_gated_delta_rule"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "fused_sigmoid_gating_delta_rule_update"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "fused_recurrent_gated_delta_rule_packed_decode"),
    ("vllm._custom_ops", "chunk_gated_delta_rule_cpu"),
    ("vllm._custom_ops", "fused_sigmoid_gating_delta_rule_update_cpu"),
    ("vllm._custom_ops", "fused_sigmoid_gating_delta_rule_update_spec_cpu"),
)


def install_stock_counters() -> None:
    """Wrap vLLM's GDN functions with counters (idempotent). Must run before the model is built:
    the layer binds ``_forward_method`` and registers the CPU op at construction."""
    import importlib

    for mod_name, attr in _STOCK:
        mod = importlib.import_module(mod_name)
        owner, name = mod, attr
        if "." in attr:
            cls_name, name = attr.split(".")
            owner = getattr(mod, cls_name)
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None or getattr(fn, "_qla_counted", False):
            continue

        def make(fn, key):
            @functools.wraps(fn)
            def counted(*args, **kwargs):
                hit(key)
                flush()
                return fn(*args, **kwargs)
            counted._qla_counted = True
            return counted

        setattr(owner, name, make(fn, f"stock:{attr}"))
