"""Helpers for the vLLM backend tests: engine subprocess environment and the job runner.

A module with a unique name (not conftest) so `import` is unambiguous next to other conftests.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys


HERE = pathlib.Path(__file__).parent
REPO = HERE.parents[2]


def engine_env(stats_dir=None, **extra) -> dict:
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    if stats_dir is not None:
        env["QLA_SERVE_VLLM_STATS_DIR"] = str(stats_dir)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_jobs(jobs, tmp_dir, *, env, timeout=480) -> dict:
    """Run `python tests/backends/vllm_plugin/_offline.py JOBS.json` (one process for all jobs);
    returns {"pid", "results": [...]} from its last stdout line."""
    path = pathlib.Path(tmp_dir) / "jobs.json"
    path.write_text(json.dumps([{k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in j.items()}
                                for j in jobs]))
    proc = subprocess.run([sys.executable, str(HERE / "_offline.py"), str(path)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"_offline.py failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


