"""Render a DeploymentConfig into the exact engine command, and into a compose service.

How qla_serve's settings reach the engine (one mechanism per setting, no duplicates):

* ``--linear-attn-backend flashqla``: a CLI flag in both engines (the qla_serve
  plugins add it: vLLM through ``vllm.general_plugins``, SGLang through
  ``add_linear_attn_kernel_backend_choices``).
* state dtype: the engine's own flag, so the engine allocates the pool in that
  dtype: vLLM ``--mamba-ssm-cache-dtype``, SGLang ``--mamba-ssm-dtype``.
* cp mode (auto/off/exact): the environment variable ``QLA_SERVE_CP``. Chosen over
  vLLM's ``--additional-config`` because it works the same for both engines and the
  API server, engine core and every TP worker inherit it (spawned or forked).
  The backends read it once at start-up with ``qla_serve.plan.cp_from_env()``.

* activation dtype: ``--dtype`` (both engines); precompile builds that dtype's variants.

vLLM:   ``vllm serve MODEL --tensor-parallel-size N --max-model-len L --dtype T
        --linear-attn-backend flashqla --mamba-ssm-cache-dtype D --host H --port P [extra_args]``
SGLang: ``python3 -m sglang.launch_server --model-path MODEL --tp-size N --context-length L
        --dtype T --linear-attn-backend flashqla --mamba-ssm-dtype D --host H --port P [extra_args]``
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

import yaml

from .config import ENV_CP, DeploymentConfig

LAUNCHERS = {
    "vllm": ("vllm", "serve"),
    "sglang": ("python3", "-m", "sglang.launch_server"),
}
# Where the images keep the precompiled TileLang cache (docker/Dockerfile.*).
IMAGE_CACHE_DIR = "/opt/qla_serve/tilelang-cache"


@dataclass(frozen=True)
class EngineCommand:
    """``launcher + args`` is the argv; ``env`` must be set for it (and its workers)."""

    launcher: tuple[str, ...]
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def argv(self) -> list[str]:
        return [*self.launcher, *self.args]

    def shell(self) -> str:
        """One copy-pasteable line: ``VAR=value ... launcher args``."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = shlex.join(self.argv)
        return f"{env} {cmd}" if env else cmd


def render_command(cfg: DeploymentConfig) -> EngineCommand:
    e, q = cfg.engine, cfg.qla
    if e.name == "vllm":
        args = [
            cfg.model.path,
            "--tensor-parallel-size", str(e.tensor_parallel_size),
            "--max-model-len", str(e.max_model_len),
            "--dtype", cfg.model.dtype,
            "--linear-attn-backend", q.linear_attn_backend,
            "--mamba-ssm-cache-dtype", q.state_dtype,
        ]
    elif e.name == "sglang":
        args = [
            "--model-path", cfg.model.path,
            "--tp-size", str(e.tensor_parallel_size),
            "--context-length", str(e.max_model_len),
            "--dtype", cfg.model.dtype,
            "--linear-attn-backend", q.linear_attn_backend,
            "--mamba-ssm-dtype", q.state_dtype,
        ]
    else:  # pydantic's Literal makes this unreachable; kept loud for future engines
        raise ValueError(f"engine.name: unsupported engine {e.name!r}")
    args += ["--host", e.host, "--port", str(e.port), *e.extra_args]
    env = {ENV_CP: q.cp, **cfg.env}
    return EngineCommand(LAUNCHERS[e.name], tuple(args), env)


def healthcheck(port: int) -> list[str]:
    """Compose healthcheck: GET /health (both engines serve it). Uses python3, which
    both base images have, rather than curl, which they may not."""
    probe = (
        "import urllib.request; "
        f"urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=5)"
    )
    return ["CMD", "python3", "-c", probe]


def render_compose_service(cfg: DeploymentConfig, *, image: str, dockerfile: str) -> dict:
    """One docker compose service for ``cfg`` on ``tensor_parallel_size`` GPUs."""
    cmd = render_command(cfg)
    port = cfg.engine.port
    return {
        "image": image,
        "build": {"context": "..", "dockerfile": dockerfile},
        "entrypoint": list(cmd.launcher),
        "command": list(cmd.args),
        "environment": {
            **cmd.env,
            # Kernels were compiled into this cache at image build time.
            "TILELANG_CACHE_DIR": IMAGE_CACHE_DIR,
            "HF_TOKEN": "${HF_TOKEN:-}",
        },
        "ports": [f"{port}:{port}"],
        # NCCL and the engines' worker processes share tensors through /dev/shm;
        # the container default (64 MB) is far too small: share the host's IPC.
        "ipc": "host",
        "ulimits": {"memlock": -1, "stack": 67108864},
        "volumes": ["${HF_HOME:-${HOME}/.cache/huggingface}:/root/.cache/huggingface"],
        "deploy": {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": cfg.engine.tensor_parallel_size, "capabilities": ["gpu"]}
        ]}}},
        "healthcheck": {
            "test": healthcheck(port),
            "interval": "30s",
            "timeout": "10s",
            "retries": 5,
            # Loading ~800 GB of weights over TP8 takes a while; no restarts meanwhile.
            "start_period": "1800s",
        },
        "restart": "unless-stopped",
    }


def render_compose(services: dict[str, tuple[DeploymentConfig, str, str, list[str]]], header: str) -> str:
    """A compose file: ``{name: (cfg, image, dockerfile, profiles)}`` -> YAML text."""
    out = {}
    for name, (cfg, image, dockerfile, profiles) in services.items():
        svc = render_compose_service(cfg, image=image, dockerfile=dockerfile)
        if profiles:
            svc = {"profiles": list(profiles), **svc}
        out[name] = svc
    body = yaml.safe_dump({"services": out}, sort_keys=False, width=1000)
    return header + body


def render_json(cfg: DeploymentConfig) -> str:
    cmd = render_command(cfg)
    return json.dumps({"argv": cmd.argv, "env": cmd.env, "heads": cfg.heads,
                       "targets": list(cfg.qla.targets)}, indent=2)


# Images built by docker/Dockerfile.<engine>, tagged with the engine version they pin.
IMAGES = {
    "vllm": ("qla-serve-vllm:0.33", "docker/Dockerfile.vllm"),
    "sglang": ("qla-serve-sglang:0.5.23", "docker/Dockerfile.sglang"),
}


def compose_for(configs: list[DeploymentConfig], sources: list[str]) -> str:
    """Compose file with one service per config (named after it). With several configs
    each service gets a profile named after its engine, so one is started at a time:
    ``docker compose -f docker/compose.tp8-long.yaml --profile vllm up -d``."""
    services = {}
    for cfg in configs:
        image, dockerfile = IMAGES[cfg.engine.name]
        profiles = [cfg.engine.name] if len(configs) > 1 else []
        if cfg.name in services:
            raise ValueError(f"config name {cfg.name!r} appears twice; service names must be unique")
        services[cfg.name] = (cfg, image, dockerfile, profiles)
    header = (
        "# Generated by: qla-serve config render " + " ".join(sources) + " --format compose\n"
        "# Do not edit by hand: edit the configs and regenerate (tests/deploy checks this file is current).\n"
    )
    return render_compose(services, header)
