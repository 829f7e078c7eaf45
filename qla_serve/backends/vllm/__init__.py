"""qla_serve as a vLLM plugin: ``vllm serve MODEL --linear-attn-backend flashqla``.

The ``vllm.general_plugins`` entry point (pyproject.toml) names :func:`register`; vLLM calls it
in every process it starts (API server, engine core, each worker) before parsing arguments.
It is idempotent and does three things:

1. adds ``--linear-attn-backend {vllm,flashqla}`` to vLLM's engine arguments; the value travels
   in ``additional_config["linear_attn_backend"]`` (also settable directly with
   ``--additional-config '{"linear_attn_backend": "flashqla"}'`` or
   ``LLM(..., additional_config={...})``), which reaches every worker;
2. registers an out-of-tree subclass of vLLM's ``QwenGatedDeltaNetAttention``
   (``PluggableLayer.register_oot``; Qwen3-Next, Qwen3.5 and Qwen3.6 build that layer) that, when
   flashqla is selected, runs the layer's core behind one custom op,
   ``torch.ops.vllm.qla_serve_gdn_core``, on qla_serve's ops;
3. with ``QLA_SERVE_VLLM_STATS_DIR`` set, counts per process which GDN paths ran (tests).

Importing this package imports no engine; :func:`register` does. Supported versions and what is
refused: docs/vllm.md.
"""

from __future__ import annotations

# Defined in plugin.py (which imports nothing of this package back: no import circle).
from qla_serve.backends.vllm.plugin import BACKENDS, CONFIG_KEY, DEFAULT_BACKEND

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    from qla_serve.backends.vllm import _stats, plugin

    plugin.patch_engine_args()
    try:
        from qla_serve.backends.vllm import layer
        layer.install()
    except Exception as exc:
        # A vLLM whose GDN internals moved: keep vLLM usable with its own backend, and make a
        # flashqla request fail at start-up with this reason (plugin.create_engine_config).
        plugin.INSTALL_ERROR = f"{type(exc).__name__}: {exc}"
        plugin.log.error("qla_serve: the flashqla GDN backend could not be installed into this "
                         "vLLM (%s); --linear-attn-backend flashqla will be refused", plugin.INSTALL_ERROR)
    if _stats.enabled() and plugin.INSTALL_ERROR is None:
        _stats.install_stock_counters()
    _registered = True


__all__ = ["BACKENDS", "CONFIG_KEY", "DEFAULT_BACKEND", "register"]
