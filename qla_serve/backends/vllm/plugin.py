"""The ``--linear-attn-backend`` flag and its journey into ``additional_config``.

vLLM builds ``vllm serve``'s parser with ``AsyncEngineArgs.add_cli_args``, which loads the
general plugins first and then calls ``EngineArgs.add_cli_args``: wrapping the latter adds the
flag. ``EngineArgs.from_cli_args`` keeps only dataclass fields, so the wrapped version moves the
value into ``additional_config`` (part of the config hash, and shipped to every worker).
``create_engine_config`` is wrapped to reject an unknown backend name early, in the front-end
process, whichever way it was given.
"""

from __future__ import annotations

import logging

BACKENDS = ("vllm", "flashqla")
DEFAULT_BACKEND = "vllm"
CONFIG_KEY = "linear_attn_backend"

log = logging.getLogger("vllm.qla_serve")  # under vLLM's logger: its handlers and format
INSTALL_ERROR: str | None = None  # why the layer hooks could not be installed, if they could not

FLAG = "--linear-attn-backend"
HELP = ("Linear-attention (Gated DeltaNet) backend: 'vllm' runs vLLM's own GDN kernels; "
        "'flashqla' runs qla_serve's (TileLang on Hopper/Blackwell, the torch reference on CPU). "
        "Same as --additional-config '{\"linear_attn_backend\": ...}'. "
        "flashqla fails at start-up, with the reason, when it cannot run.")


def resolve_backend(additional_config) -> str:
    """The backend named by ``additional_config`` (default 'vllm'); ValueError if unknown."""
    raw = additional_config.get(CONFIG_KEY, DEFAULT_BACKEND) if isinstance(additional_config, dict) \
        else DEFAULT_BACKEND
    name = str(raw).strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"linear_attn_backend: expected one of {list(BACKENDS)} "
                         f"(from {FLAG} or additional_config[{CONFIG_KEY!r}]), got {raw!r}")
    return name


def patch_engine_args() -> None:
    """Wrap EngineArgs' CLI hooks once per process (idempotent)."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, "_qla_serve_patched", False):
        return
    orig_add = EngineArgs.add_cli_args
    orig_from = EngineArgs.from_cli_args.__func__
    orig_create = EngineArgs.create_engine_config

    def add_cli_args(parser, *args, **kwargs):
        parser = orig_add(parser, *args, **kwargs)
        if not any(FLAG in getattr(a, "option_strings", ()) for a in parser._actions):
            parser.add_argument(FLAG, dest=CONFIG_KEY, choices=list(BACKENDS), default=None, help=HELP)
        return parser

    def from_cli_args(cls, args):
        engine_args = orig_from(cls, args)
        value = getattr(args, CONFIG_KEY, None)
        if value is not None:
            extra = dict(engine_args.additional_config or {})
            given = extra.get(CONFIG_KEY)
            if given is not None and str(given).strip().lower() != value:
                raise ValueError(f"{FLAG}={value} contradicts additional_config"
                                 f"[{CONFIG_KEY!r}]={given!r}: give one of them")
            extra[CONFIG_KEY] = value
            engine_args.additional_config = extra
        return engine_args

    def create_engine_config(self, *args, **kwargs):
        backend = resolve_backend(self.additional_config)
        if backend != DEFAULT_BACKEND:
            if INSTALL_ERROR is not None:
                raise RuntimeError(f"linear_attn_backend={backend} cannot run: qla_serve's vLLM "
                                   f"hooks failed to install ({INSTALL_ERROR}); see docs/vllm.md "
                                   "for the supported vLLM versions")
            log.info("qla_serve: linear_attn_backend=%s requested", backend)
        return orig_create(self, *args, **kwargs)

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config
    EngineArgs._qla_serve_patched = True
