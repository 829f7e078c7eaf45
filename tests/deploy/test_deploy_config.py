"""Deployment configs: the shipped files, and every bad field reported with its own message."""

from __future__ import annotations

import glob
import os

import pytest
import yaml
from pydantic import ValidationError

from qla_serve.deploy import ConfigError, DeploymentConfig, check_config, load_config
from qla_serve.deploy.config import read_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "configs", "deploy")
SHIPPED = sorted(glob.glob(os.path.join(DEPLOY, "*.yaml")))

# The GDN geometry of each model, from its HF config.json (sources in the YAML comments):
# (linear_num_key_heads, linear_num_value_heads). Head dims are 128 for all.
GEOMETRY = {
    "Qwen/Qwen3.5-397B-A17B": (16, 64),
    "Qwen/Qwen3.5-122B-A10B": (16, 64),
    "Qwen/Qwen3.5-27B": (16, 48),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": (16, 32),
    "Qwen/Qwen3-Next-80B-A3B-Instruct-FP8": (16, 32),
    "Qwen/Qwen3.6-35B-A3B": (16, 32),
}
# What the issue asks for: model, TP, and the TP-local heads "Hk/Hv" that follow.
EXPECTED = {
    "qwen3.5-397b-a17b-tp8": ("Qwen/Qwen3.5-397B-A17B", 8, "2/8", 262144),
    "qwen3.5-122b-a10b-tp4": ("Qwen/Qwen3.5-122B-A10B", 4, "4/16", None),
    "qwen3.5-27b-tp2": ("Qwen/Qwen3.5-27B", 2, "8/24", None),
    "qwen3-next-80b-a3b-tp1": ("Qwen/Qwen3-Next-80B-A3B-Instruct-FP8", 1, "16/32", None),
    "qwen3-next-80b-a3b-tp4": ("Qwen/Qwen3-Next-80B-A3B-Instruct", 4, "4/8", None),
    # The README's and docs/vllm.md's example deployment.
    "qwen3-next-80b-a3b-tp8": ("Qwen/Qwen3-Next-80B-A3B-Instruct", 8, "2/4", 262144),
    # the same with MTP speculative decoding (2 drafts a step)
    "qwen3-next-80b-a3b-tp8-mtp": ("Qwen/Qwen3-Next-80B-A3B-Instruct", 8, "2/4", 262144),
    "qwen3.6-35b-a3b-tp1": ("Qwen/Qwen3.6-35B-A3B", 1, "16/32", 262144),
}


def _good() -> dict:
    return read_yaml(os.path.join(DEPLOY, "qwen3.5-397b-a17b-tp8.yaml"))


def _set(d: dict, path: str, value):
    keys = path.split(".")
    for k in keys[:-1]:
        d = d[k]
    if value is _DELETE:
        del d[keys[-1]]
    else:
        d[keys[-1]] = value


_DELETE = object()


def test_every_shipped_config_is_valid_and_states_its_source():
    assert len(SHIPPED) >= 5
    for path in SHIPPED:
        cfg = load_config(path)
        g = cfg.model.gdn
        assert (g.linear_num_key_heads, g.linear_num_value_heads) == GEOMETRY[cfg.model.path], path
        assert g.linear_key_head_dim == g.linear_value_head_dim == 128
        # The stated per-GPU counts are what TP implies (validated, but pin it here too).
        assert (g.tp_local.linear_num_key_heads, g.tp_local.linear_num_value_heads) == (
            cfg.local_k_heads, cfg.local_v_heads)
        text = open(path, encoding="utf-8").read()
        # The geometry's source: the HF config.json, or another shipped config that states it.
        cites = [os.path.basename(o) for o in SHIPPED if o != path and os.path.basename(o) in text]
        assert ("config.json" in text and "Source:" in text) or cites, f"{path}: no source comment"
        assert os.path.basename(path) == f"{cfg.name}.yaml"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_required_deployments(name):
    model, tp, heads, max_len = EXPECTED[name]
    cfg = load_config(os.path.join(DEPLOY, f"{name}.yaml"))
    assert cfg.model.path == model
    assert cfg.engine.tensor_parallel_size == tp
    assert cfg.heads == heads
    if max_len is not None:
        assert cfg.engine.max_model_len == max_len


# (path, bad value, location reported, words the message must contain)
BAD_FIELDS = [
    ("name", "has space", "name", "pattern"),
    ("model.path", "", "model.path", "at least 1"),
    ("model.dtype", "float8", "model.dtype", "bfloat16"),
    ("model.gdn.linear_key_head_dim", 64, "model.gdn.linear_key_head_dim", "128"),
    ("model.gdn.linear_num_key_heads", 0, "model.gdn.linear_num_key_heads", "greater than 0"),
    ("engine.name", "trtllm", "engine.name", "'vllm' or 'sglang'"),
    ("engine.tensor_parallel_size", 0, "engine.tensor_parallel_size", "greater than 0"),
    ("engine.tensor_parallel_size", 3, "engine.tensor_parallel_size", "does not divide"),
    ("engine.port", 70000, "engine.port", "less than 65536"),
    ("engine.max_model_len", 300000, "engine.max_model_len", "exceeds model.max_position_embeddings"),
    ("engine.extra_args", ["--max-model-len=4096"], "engine.extra_args[0]", "engine.max_model_len"),
    ("engine.tensor_paralel_size", 8, "engine.tensor_paralel_size", "did you mean 'tensor_parallel_size'"),
    ("qla.state_dtype", "fp8", "qla.state_dtype", "'float32' or 'bfloat16'"),
    ("qla.cp", "sometimes", "qla.cp", "'auto', 'off' or 'exact'"),
    ("qla.targets", ["sm_90"], "qla.targets[0]", "'sm_90a' or 'sm_100a'"),
    ("qla.linear_attn_backend", "triton", "qla.linear_attn_backend", "flashqla"),
    ("model.gdn.tp_local", {"linear_num_key_heads": 2, "linear_num_value_heads": 16},
     "model.gdn.tp_local.linear_num_value_heads", "8 per GPU"),
    ("env", {"QLA_SERVE_CP": "off"}, "env.QLA_SERVE_CP", "qla.cp"),
    ("engine", _DELETE, "engine", "Field required"),
]


@pytest.mark.parametrize("path,value,loc,words", BAD_FIELDS, ids=[f"{b[0]}={b[1]!r}"[:40] for b in BAD_FIELDS])
def test_each_bad_field_alone(path, value, loc, words):
    raw = _good()
    _set(raw, path, value)
    cfg, problems = check_config(raw)
    assert cfg is None
    # One location per bad field (TP3 gets two messages there: it splits neither head count).
    assert {p.loc for p in problems} == {loc}, problems
    assert all(words in p.message for p in problems), problems


def test_many_bad_fields_each_get_their_own_message():
    """Field errors and cross-field errors at once: one message per bad field, none hidden."""
    raw = _good()
    # engine.name stays valid: which flags are managed depends on the engine.
    picks = [b for b in BAD_FIELDS if b[0] not in ("engine", "engine.name", "engine.tensor_parallel_size",
                                                      "engine.max_model_len", "model.gdn.tp_local",
                                                      "engine.extra_args")]
    for path, value, _, _ in picks:
        _set(raw, path, value)
    # cross-field ones whose inputs are valid themselves
    raw["engine"]["tensor_parallel_size"] = 3
    raw["engine"]["extra_args"] = ["-tp", "2"]
    cfg, problems = check_config(raw)
    assert cfg is None
    locs = [p.loc for p in problems]
    expected = {b[2] for b in picks} | {"engine.tensor_parallel_size", "engine.extra_args[0]"}
    assert set(locs) == expected, sorted(locs)
    # linear_num_key_heads=0 has its own error, so TP3 is checked against the value heads only.
    tp_msgs = [p.message for p in problems if p.loc == "engine.tensor_parallel_size"]
    assert len(tp_msgs) == 1 and "linear_num_value_heads=64" in tp_msgs[0]
    assert len(locs) == len(expected)


def test_value_heads_must_be_a_multiple_of_key_heads():
    raw = _good()
    raw["model"]["gdn"]["linear_num_key_heads"] = 12
    raw["model"]["gdn"].pop("tp_local")
    raw["engine"]["tensor_parallel_size"] = 4
    _, problems = check_config(raw)
    assert [p.loc for p in problems] == ["model.gdn.linear_num_value_heads"]
    assert "not a multiple of linear_num_key_heads=12" in problems[0].message


def test_unquoted_off_is_the_cp_mode_not_false(tmp_path):
    """YAML 1.1 reads `off` as false; the loader keeps it a string so `cp: off` works."""
    raw = _good()
    raw["qla"]["cp"] = "off"
    text = yaml.safe_dump(raw).replace("cp: 'off'", "cp: off")
    assert "cp: off\n" in text
    f = tmp_path / "x.yaml"
    f.write_text(text)
    assert load_config(f).qla.cp == "off"


def test_load_config_raises_with_every_problem(tmp_path):
    raw = _good()
    raw["qla"]["cp"] = "never"
    raw["engine"]["port"] = 0
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert {p.loc for p in e.value.problems} == {"qla.cp", "engine.port"}
    assert str(f) in str(e.value)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_an_instance_is_always_fully_valid():
    """Constructing the model directly also runs the cross-field checks."""
    raw = _good()
    raw["engine"]["tensor_parallel_size"] = 32
    raw["model"]["gdn"].pop("tp_local")
    with pytest.raises(ValidationError, match="32 does not divide model.gdn.linear_num_key_heads=16"):
        DeploymentConfig.model_validate(raw)
    cfg = DeploymentConfig.model_validate(_good())
    with pytest.raises(ValidationError):  # frozen: no way to make it inconsistent afterwards
        cfg.engine.tensor_parallel_size = 3


def test_cli_config_check_exit_codes(tmp_path, capsys):
    from qla_serve.cli import main  # the real `qla-serve`: proves the commands are wired

    assert main(["config", "check", DEPLOY]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == len(SHIPPED) and "-> 2/8 per GPU" in out

    raw = _good()
    raw["qla"]["cp"] = "sometimes"
    raw["engine"]["tensor_parallel_size"] = 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    assert main(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert sum("qla.cp:" in line for line in err) == 1
    assert sum("engine.tensor_parallel_size:" in line for line in err) == 2
    assert err[-1].endswith("3 problem(s)")

    (tmp_path / "broken.yaml").write_text("a: [\n")
    assert main(["config", "check", str(tmp_path / "broken.yaml")]) == 2


def test_shipped_configs_by_name(tmp_path, monkeypatch, capsys):
    """`qla-serve config render qwen3.5-397b-a17b-tp8` works from any directory (an installed
    wheel has no checkout); a path that exists always wins over a name."""
    from qla_serve.cli import main
    from qla_serve.deploy.config import resolve_config

    monkeypatch.chdir(tmp_path)
    assert os.path.samefile(resolve_config("qwen3.5-397b-a17b-tp8"), os.path.join(DEPLOY, "qwen3.5-397b-a17b-tp8.yaml"))
    assert main(["config", "check", "qwen3.5-27b-tp2"]) == 0
    (tmp_path / "qwen3.5-27b-tp2").write_text("name: local\n")
    assert resolve_config("qwen3.5-27b-tp2") == "qwen3.5-27b-tp2"
    assert main(["config", "check", "no-such-deployment"]) == 2
    assert "no-such-deployment: file not found" in capsys.readouterr().err
