"""End to end on CPU through the real server: `vllm serve DIR --linear-attn-backend flashqla`.

The server binds 127.0.0.1 on a free port, must become healthy within a bounded wait, and
answers /v1/completions with a prompt longer than --max-num-batched-tokens (so its prefill is
chunked and resumes from the saved state) and a few decode steps. The per-process counters show
qla_serve's prefill, decode and resumed-prefill paths ran in a process other than the API server
(the engine's worker) and vLLM's own GDN path ran nowhere. The server is stopped by its PID
(SIGTERM, then SIGKILL of its process group after a bounded wait).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm.engine.arg_utils", reason="vllm is not installed (run scripts/setup_vllm_env.sh; tests use .venv-vllm)")

from vllm_helpers import engine_env  # noqa: E402

from qla_serve.backends.vllm._stats import read_all  # noqa: E402

pytestmark = pytest.mark.engine
HEALTHY_WITHIN_S = 240
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6   # > 32 tokens: chunked prefill


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def _post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session: the server and its engine
            proc.wait(timeout=10)


def test_vllm_serve_flashqla(tiny_models, tmp_path):
    model = str(tiny_models["qwen3_next"])
    stats, log = tmp_path / "stats", tmp_path / "server.log"
    port = _free_port()
    vllm_bin = os.path.join(os.path.dirname(sys.executable), "vllm")
    cmd = [vllm_bin, "serve", model, "--linear-attn-backend", "flashqla", "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "512", "--enforce-eager",
           "--max-num-batched-tokens", "32", "--dtype", "float32"]
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, env=engine_env(stats), stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.time() + HEALTHY_WITHIN_S
        while True:
            assert proc.poll() is None, f"server exited ({proc.returncode}):\n{log.read_text()[-5000:]}"
            try:
                if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline, f"not healthy in {HEALTHY_WITHIN_S}s:\n{log.read_text()[-5000:]}"
            time.sleep(1)
        status, body = _post(f"http://127.0.0.1:{port}/v1/completions",
                             {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        assert status == 200
        assert body["usage"]["completion_tokens"] == 6 and body["usage"]["prompt_tokens"] > 32, body
        assert isinstance(body["choices"][0]["text"], str)
    finally:
        _stop(proc)
    assert proc.returncode is not None
    per = read_all(stats)["per_pid"]
    workers = {pid: c for pid, c in per.items() if c.get("qla:calls")}
    assert workers and proc.pid not in workers, f"qla_serve ran in no worker process: {per}"
    c = next(iter(workers.values()))
    assert c.get("qla:prefill", 0) > 0 and c.get("qla:decode", 0) > 0, c
    assert c.get("qla:resumed_prefill", 0) > 0, c
    assert not any(k.startswith("stock:") for cc in per.values() for k in cc), per
    assert "flashqla GDN backend active" in log.read_text()
