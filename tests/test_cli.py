"""The `qla-serve` CLI: info, plan (table and JSON), demo, and usage errors (exit code 2)."""

import json
import subprocess
import sys

import pytest

from qla_serve.cli import main


def test_plan_json(capsys):
    assert main(["plan", "--heads", "2/8", "--seqlens", "32768,8192", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["num_v_heads"] == 8 and d["total_tokens"] == 40960
    assert sum(s[2] for s in d["segments"]) == (32768 + 8192) // 64


def test_plan_table(capsys):
    assert main(["plan", "--heads", "16/64", "--seqlens", "100,0,1", "--cp", "off"]) == 0
    out = capsys.readouterr().out
    assert "strategy plain" in out and "carried (pool)" in out


@pytest.mark.parametrize("argv", [["plan", "--heads", "2/7", "--seqlens", "3"],
                                  ["plan", "--heads", "2/8", "--seqlens", "3,-1"],
                                  ["plan", "--heads", "2/8", "--seqlens", "3", "--cp", "maybe"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "--" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["bench", "prefill", "--impls", "qla,flashinfr"], "--impls: unknown ['flashinfr']"),
    (["bench", "decode", "--impls", "qla,flash-infer"], "--impls: unknown ['flash-infer']")])
def test_bench_refuses_unknown_impls_before_touching_a_gpu(argv, message, capsys):
    """An --impls name that no implementation has is an error naming it (exit 2), on any machine,
    not a row of per-impl errors after the GPU work."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    captured = capsys.readouterr()
    assert message in captured.out + captured.err


def test_info_and_demo_as_console_commands():
    """Runs the installed entry point when present, else the module (same code)."""
    info = subprocess.run([sys.executable, "-m", "qla_serve.cli", "info"], capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    assert "prefill path" in info.stdout
    assert "TMA descriptor memo" in info.stdout
    assert "start-up kernel build" in info.stdout
    demo = subprocess.run([sys.executable, "-m", "qla_serve.cli", "demo", "--seqlens", "70,1,0", "--decode-steps", "2"],
                          capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "demo passed" in demo.stdout
