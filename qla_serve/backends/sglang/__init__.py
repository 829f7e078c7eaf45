"""qla_serve's SGLang backend (SGLang 0.5.23): ``--linear-attn-backend flashqla``.

Entry point (pyproject): ``[project.entry-points."sglang.srt.plugins"]``
``qla_serve = "qla_serve.backends.sglang:register"``. Importing this package imports no engine;
:func:`register` (run by SGLang's ``load_plugins``) imports SGLang and installs the hooks.

* :mod:`.plugin`  flag choices, HookRegistry hooks, start-up checks, per-batch planning
* :mod:`.kernel`  ``FlashQLAGDNKernel``: SGLang's ``LinearAttnKernelBase`` on qla_serve's ops
"""


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (see :func:`.plugin.register`)."""
    from .plugin import register as _register

    _register()


__all__ = ["register"]
