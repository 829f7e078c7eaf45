"""Deployment configs: one YAML file describes one served model.

A config names the model and its Gated DeltaNet geometry (as in the model's HF
``config.json``), the engine (vLLM or SGLang) with its tensor-parallel size and
maximum length, and qla_serve's own settings (state dtype, context-parallel mode,
GPU targets to precompile). Example: ``configs/deploy/qwen3.5-397b-a17b-tp8.yaml``.

Validation reports *every* bad field with its own message and location
(``engine.tensor_parallel_size: ...``), not the first one only:

* field checks are pydantic's (types, ranges, enums, unknown keys);
* cross-field checks (heads divisible by TP, the TP-local counts the file states,
  max length vs. the model's positions, flags that ``render`` owns) are run by
  :func:`cross_field_problems` on whatever fields did validate, so a config with a
  bad ``cp`` and heads that do not split over TP gets both messages at once.

Public: :class:`DeploymentConfig`, :class:`ConfigError`, :class:`Problem`,
:func:`load_config`, :func:`check_config`, :func:`read_yaml`.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from typing import Any, Literal, Optional, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qla_serve.plan import ENV_CP, cp_from_env  # noqa: F401  (re-exported by qla_serve.deploy)

# GPU targets qla_serve compiles TileLang kernels for. The "a" suffix matters:
# plain sm_90 cannot lower the warpgroup instructions the Hopper kernels use.
TARGETS = ("sm_90a", "sm_100a")
StateDType = Literal["float32", "bfloat16"]
CPMode = Literal["auto", "off", "exact"]
EngineName = Literal["vllm", "sglang"]
ENGINES = get_args(EngineName)

# Environment variable that carries the config's cp mode to the engine processes
# (API server and every TP worker inherit the environment; see render.py).

# Flags `render` writes from the config's own fields. Passing one of them again in
# engine.extra_args would leave two sources of truth (argparse keeps the last one),
# so it is an error. Aliases listed so `-tp 4` cannot sneak past.
MANAGED_FLAGS = {
    "vllm": {
        "--tensor-parallel-size": "engine.tensor_parallel_size",
        "-tp": "engine.tensor_parallel_size",
        "--max-model-len": "engine.max_model_len",
        "--linear-attn-backend": "qla.linear_attn_backend",
        "--mamba-ssm-cache-dtype": "qla.state_dtype",
        "--dtype": "model.dtype",
        "--host": "engine.host",
        "--port": "engine.port",
        "--model": "model.path",
    },
    "sglang": {
        "--model-path": "model.path",
        "--model": "model.path",
        "--tp-size": "engine.tensor_parallel_size",
        "--tp": "engine.tensor_parallel_size",
        "--tensor-parallel-size": "engine.tensor_parallel_size",
        "--context-length": "engine.max_model_len",
        "--linear-attn-backend": "qla.linear_attn_backend",
        "--mamba-ssm-dtype": "qla.state_dtype",
        "--dtype": "model.dtype",
        "--host": "engine.host",
        "--port": "engine.port",
    },
}
MANAGED_ENV = {ENV_CP: "qla.cp", "TILELANG_CACHE_DIR": "set by the image (docker/)"}


class _Strict(BaseModel):
    # Unknown keys are errors: a typo (`tensor_paralel_size`) must not silently
    # leave the default in place.
    model_config = ConfigDict(extra="forbid", frozen=True)


class TPLocalHeads(_Strict):
    """The per-GPU head counts the file claims; checked against the derived ones."""

    linear_num_key_heads: int = Field(gt=0)
    linear_num_value_heads: int = Field(gt=0)


class GDNGeometry(_Strict):
    """Gated DeltaNet geometry, named exactly as in the model's HF config.json
    (``text_config`` for the Qwen3.5 VLM checkpoints)."""

    linear_num_key_heads: int = Field(gt=0, description="Hk: q/k heads of each GDN layer")
    linear_num_value_heads: int = Field(gt=0, description="Hv: v heads (= state heads)")
    # qla_serve's kernels and its state pool are built for 128 x 128 states.
    linear_key_head_dim: Literal[128] = 128
    linear_value_head_dim: Literal[128] = 128
    num_gdn_layers: Optional[int] = Field(default=None, gt=0, description="informational")
    tp_local: Optional[TPLocalHeads] = Field(
        default=None, description="per-GPU counts; when given they must equal the derived ones"
    )


class ModelSpec(_Strict):
    path: str = Field(min_length=1, description="HF repo id or a local directory")
    max_position_embeddings: Optional[int] = Field(default=None, gt=0)
    # Activation dtype q/k/v reach the GDN kernels in (the engine's --dtype): precompile
    # builds only the variants of this dtype.
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    gdn: GDNGeometry


class EngineSpec(_Strict):
    name: EngineName
    tensor_parallel_size: int = Field(gt=0, le=64)
    max_model_len: int = Field(gt=0)
    host: str = "0.0.0.0"
    port: int = Field(default=8000, gt=0, lt=65536)
    extra_args: tuple[str, ...] = Field(
        default=(), description="more engine flags, passed through after the managed ones"
    )


class QLASpec(_Strict):
    linear_attn_backend: Literal["flashqla"] = "flashqla"
    state_dtype: StateDType = "float32"
    cp: CPMode = "auto"
    targets: tuple[Literal["sm_90a", "sm_100a"], ...] = Field(default=TARGETS, min_length=1)


class DeploymentConfig(_Strict):
    """One deployment. Construct with :func:`load_config` (YAML) or
    ``DeploymentConfig.model_validate(dict)``; an instance is always fully valid
    (cross-field checks included)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: ModelSpec
    engine: EngineSpec
    qla: QLASpec = QLASpec()
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the engine")

    @model_validator(mode="after")
    def _cross_fields(self, info):
        problems = cross_field_problems(_View.of_model(self))
        sink = (info.context or {}).get("problems") if info is not None else None
        if sink is not None:  # check_config collects them one by one
            sink.extend(problems)
        elif problems:
            raise ValueError("; ".join(str(p) for p in problems))
        return self

    # Derived, TP-local geometry: what one GPU's kernels see.
    @property
    def local_k_heads(self) -> int:
        return self.model.gdn.linear_num_key_heads // self.engine.tensor_parallel_size

    @property
    def local_v_heads(self) -> int:
        return self.model.gdn.linear_num_value_heads // self.engine.tensor_parallel_size

    @property
    def heads(self) -> str:
        """TP-local heads as ``"Hk/Hv"``, the form `qla-serve precompile --heads` takes."""
        return f"{self.local_k_heads}/{self.local_v_heads}"

    def summary(self) -> str:
        g = self.model.gdn
        return (
            f"{self.model.path} on {self.engine.name} TP{self.engine.tensor_parallel_size}, "
            f"max len {self.engine.max_model_len}: GDN heads {g.linear_num_key_heads}/"
            f"{g.linear_num_value_heads} -> {self.heads} per GPU, state {self.qla.state_dtype}, "
            f"cp {self.qla.cp}, targets {','.join(self.qla.targets)}"
        )


@dataclass(frozen=True)
class Problem:
    """One bad field: where (dotted path into the YAML) and what is wrong."""

    loc: str
    message: str

    def __str__(self) -> str:
        return f"{self.loc}: {self.message}" if self.loc else self.message


class ConfigError(ValueError):
    """A config file that cannot be used; ``problems`` lists every bad field."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = list(problems)
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s)\n{lines}")


# --------------------------------------------------------------------------- cross-field checks


@dataclass(frozen=True)
class _View:
    """The values cross-field checks read; None where a value is missing or invalid
    (its own field error is reported already, so the check that needs it is skipped)."""

    tp: Optional[int] = None
    hk: Optional[int] = None
    hv: Optional[int] = None
    tp_local_hk: Optional[int] = None
    tp_local_hv: Optional[int] = None
    max_model_len: Optional[int] = None
    max_positions: Optional[int] = None
    engine: Optional[str] = None
    extra_args: Optional[tuple] = None
    env_keys: Optional[tuple] = None

    @classmethod
    def of_model(cls, c: DeploymentConfig) -> "_View":
        tl = c.model.gdn.tp_local
        return cls(
            tp=c.engine.tensor_parallel_size,
            hk=c.model.gdn.linear_num_key_heads,
            hv=c.model.gdn.linear_num_value_heads,
            tp_local_hk=tl.linear_num_key_heads if tl else None,
            tp_local_hv=tl.linear_num_value_heads if tl else None,
            max_model_len=c.engine.max_model_len,
            max_positions=c.model.max_position_embeddings,
            engine=c.engine.name,
            extra_args=tuple(c.engine.extra_args),
            env_keys=tuple(c.env),
        )

    @classmethod
    def of_raw(cls, raw: Any, bad: set[str]) -> "_View":
        """From a dict that failed validation: take only fields with no error of their own."""

        def get(path: str, kind: type):
            if any(b == path or b.startswith(path + ".") or b.startswith(path + "[") for b in bad):
                return None
            node = raw
            for part in path.split("."):
                if not isinstance(node, dict) or part not in node:
                    return None
                node = node[part]
            if kind is int and (isinstance(node, bool) or not isinstance(node, int) or node <= 0):
                return None
            if kind is not int and not isinstance(node, kind):
                return None
            return node

        args = get("engine.extra_args", list)
        env = get("env", dict)
        return cls(
            tp=get("engine.tensor_parallel_size", int),
            hk=get("model.gdn.linear_num_key_heads", int),
            hv=get("model.gdn.linear_num_value_heads", int),
            tp_local_hk=get("model.gdn.tp_local.linear_num_key_heads", int),
            tp_local_hv=get("model.gdn.tp_local.linear_num_value_heads", int),
            max_model_len=get("engine.max_model_len", int),
            max_positions=get("model.max_position_embeddings", int),
            engine=get("engine.name", str),
            extra_args=tuple(a for a in args if isinstance(a, str)) if args is not None else None,
            env_keys=tuple(env) if env is not None else None,
        )


def cross_field_problems(v: _View) -> list[Problem]:
    """Checks that need more than one field. Each returns its own Problem."""
    out: list[Problem] = []
    if v.hk and v.hv and v.hv % v.hk:
        out.append(Problem(
            "model.gdn.linear_num_value_heads",
            f"{v.hv} value heads are not a multiple of linear_num_key_heads={v.hk} "
            "(each q/k head serves Hv/Hk value heads)",
        ))
    if v.tp:
        for name, h in (("linear_num_key_heads", v.hk), ("linear_num_value_heads", v.hv)):
            if h and h % v.tp:
                out.append(Problem(
                    "engine.tensor_parallel_size",
                    f"{v.tp} does not divide model.gdn.{name}={h}: GDN heads are split evenly "
                    f"over TP ranks (divisors of {h}: {_divisors(h)})",
                ))
    if v.tp and v.hk and v.tp_local_hk and v.hk % v.tp == 0 and v.tp_local_hk != v.hk // v.tp:
        out.append(Problem(
            "model.gdn.tp_local.linear_num_key_heads",
            f"says {v.tp_local_hk}, but {v.hk} key heads over TP{v.tp} are {v.hk // v.tp} per GPU",
        ))
    if v.tp and v.hv and v.tp_local_hv and v.hv % v.tp == 0 and v.tp_local_hv != v.hv // v.tp:
        out.append(Problem(
            "model.gdn.tp_local.linear_num_value_heads",
            f"says {v.tp_local_hv}, but {v.hv} value heads over TP{v.tp} are {v.hv // v.tp} per GPU",
        ))
    if v.max_model_len and v.max_positions and v.max_model_len > v.max_positions:
        out.append(Problem(
            "engine.max_model_len",
            f"{v.max_model_len} exceeds model.max_position_embeddings={v.max_positions}",
        ))
    if v.engine in MANAGED_FLAGS and v.extra_args is not None:
        managed = MANAGED_FLAGS[v.engine]
        for i, arg in enumerate(v.extra_args):
            flag = arg.split("=", 1)[0]
            if flag in managed:
                out.append(Problem(
                    f"engine.extra_args[{i}]",
                    f"{flag} is written by `config render` from {managed[flag]}; set it there",
                ))
    if v.env_keys is not None:
        for key in v.env_keys:
            if key in MANAGED_ENV:
                out.append(Problem(f"env.{key}", f"{key} is managed ({MANAGED_ENV[key]}); set it there"))
    return out


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


# --------------------------------------------------------------------------- loading and checking


class _Loader(yaml.SafeLoader):
    """SafeLoader where only true/false are booleans: YAML 1.1 turns an unquoted
    ``cp: off`` into False, and ``off`` is one of our cp modes."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def shipped_configs_dir() -> Optional[str]:
    """configs/deploy/ as installed (``qla_serve.configs``) or in a source checkout."""
    try:
        from importlib.resources import files
        d = files("qla_serve.configs") / "deploy"
        if d.is_dir():
            return str(d)
    except ModuleNotFoundError:
        pass
    d = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "configs", "deploy")
    return d if os.path.isdir(d) else None


def resolve_config(name: str) -> str:
    """A path as given if it exists, else a shipped config by name
    (``qwen3.5-397b-a17b-tp8`` -> .../configs/deploy/qwen3.5-397b-a17b-tp8.yaml)."""
    if os.path.exists(name) or os.sep in name:
        return name
    d = shipped_configs_dir()
    if d:
        for cand in (name, f"{name}.yaml"):
            if os.path.isfile(os.path.join(d, cand)):
                return os.path.join(d, cand)
    return name


def read_yaml(path: str | os.PathLike) -> Any:
    """Parse a YAML file; a file that cannot be read as YAML (missing, a directory, unreadable,
    not UTF-8 text, bad YAML) is a ConfigError with one problem, never a bare OSError or
    UnicodeDecodeError: the CLI prints it beside the file's name and goes on to the next file."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigError(path, [Problem("", "file not found")]) from None
    except IsADirectoryError:
        raise ConfigError(path, [Problem("", "a directory, not a YAML file")]) from None
    except OSError as e:
        raise ConfigError(path, [Problem("", f"cannot read the file: {e.strerror or e}")]) from None
    except UnicodeDecodeError as e:
        raise ConfigError(path, [Problem("", f"not a UTF-8 text file (byte 0x{e.object[e.start]:02x} at "
                                             f"offset {e.start}): expected a YAML config")]) from None
    except yaml.YAMLError as e:
        raise ConfigError(path, [Problem("", f"not valid YAML: {e}")]) from None


def _loc(parts: tuple) -> str:
    s = ""
    for p in parts:
        s += f"[{p}]" if isinstance(p, int) else (f".{p}" if s else str(p))
    return s


def _pydantic_problems(err: ValidationError, raw: Any) -> list[Problem]:
    out = []
    errors = err.errors(include_url=False)
    locs = [_loc(tuple(e["loc"])) for e in errors]
    for e, loc in zip(errors, locs):
        # A list whose items failed also fails its length check: one message is enough.
        if e["type"] == "too_short" and any(other.startswith(loc + "[") for other in locs):
            continue
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + _did_you_mean(raw, tuple(e["loc"]))
        elif "input" in e and not isinstance(e["input"], (dict, list)):
            msg = f"{msg} (got {e['input']!r})"
        out.append(Problem(loc, msg))
    return out


def _did_you_mean(raw: Any, loc: tuple) -> str:
    """Suggest the known key closest to a misspelt one."""
    models = {(): DeploymentConfig, ("model",): ModelSpec, ("model", "gdn"): GDNGeometry,
              ("model", "gdn", "tp_local"): TPLocalHeads, ("engine",): EngineSpec, ("qla",): QLASpec}
    cls = models.get(tuple(loc[:-1]))
    if cls is None:
        return ""
    near = difflib.get_close_matches(str(loc[-1]), list(cls.model_fields), n=1)
    return f"; did you mean {near[0]!r}?" if near else ""


def check_config(raw: Any, source: str = "<config>") -> tuple[Optional[DeploymentConfig], list[Problem]]:
    """Validate a parsed YAML document. Returns (config or None, every problem found)."""
    if not isinstance(raw, dict):
        return None, [Problem("", f"expected a mapping at the top level, got {type(raw).__name__}")]
    sink: list[Problem] = []
    try:
        cfg = DeploymentConfig.model_validate(raw, context={"problems": sink})
    except ValidationError as e:
        problems = _pydantic_problems(e, raw)
        bad = {p.loc for p in problems}
        problems += cross_field_problems(_View.of_raw(raw, bad))
        return None, problems
    if sink:
        return None, sink
    return cfg, []


def load_config(path: str | os.PathLike) -> DeploymentConfig:
    """Read and validate one deployment YAML; raises ConfigError listing every problem."""
    cfg, problems = check_config(read_yaml(path), os.fspath(path))
    if problems:
        raise ConfigError(os.fspath(path), problems)
    return cfg
