"""Deployment: validated configs, engine command rendering, ahead-of-time kernel compilation.

* :mod:`.config`     pydantic models for configs/deploy/*.yaml; every bad field its own message
* :mod:`.render`     config -> exact ``vllm serve`` / SGLang command (+ env), compose service
* :mod:`.precompile` kernel variants a deployment needs -> TileLang's cache, without a GPU
* :mod:`.startup`    the same set built once per engine process before serving (adapters call it)
* :mod:`.cli`        ``qla-serve config check|render`` and ``qla-serve precompile``

Importing this package does not import tilelang (torch comes with the qla_serve package
itself); precompile imports the kernel modules only when it runs.
"""

from .cli import add_cli_commands
from .config import (ENV_CP, TARGETS, ConfigError, DeploymentConfig, Problem, check_config, cp_from_env,
                     load_config)
from .render import EngineCommand, render_command

__all__ = [
    "add_cli_commands", "ConfigError", "DeploymentConfig", "Problem", "check_config", "load_config",
    "EngineCommand", "render_command", "ENV_CP", "TARGETS", "cp_from_env",
]
