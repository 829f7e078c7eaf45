"""Kernels ready before the first request: what an engine adapter runs once per process when
flashqla takes a GPU's GDN layers (vLLM: the first layer built; SGLang: the backend's init).

:func:`ensure_kernels` builds every TileLang variant a deployment with these TP-local heads,
dtypes and target can hit -- the set ``qla-serve precompile --heads`` compiles -- through
TileLang's disk cache, so that no request waits on a compile:

* every variant a disk hit (the images, or ``qla-serve precompile`` beforehand): loaded, a few
  seconds; the log line says so;
* misses compile here, at start-up, with a WARNING that names the count, the time and the
  command that does it ahead of time; in ``QLA_SERVE_STARTUP_JOBS`` processes at once (default
  ``auto``: half the CPUs this process may run on, at most 8). The engines' workers are daemon
  processes (vLLM's TP workers: ``multiproc_executor.py``, ``daemon=True``), which may not start
  processes of their own, so the processes are started by a child interpreter (``python -m
  qla_serve.deploy.startup``). A first start counts against the engine's own start-up
  limit (vLLM: ``VLLM_ENGINE_READY_TIMEOUT_S``, 600 s, weight loading included);
* a variant that fails to build stops the start-up with its error (never a silent fallback).

The ranks of one host share the cache: a file lock in it lets one process build while the
others wait, and a ready marker (ready.py: keyed by the jobs and a hash of the kernel sources)
tells the later ones that the set is complete, so they skip it; ``qla-serve precompile`` writes
the same markers, so a start-up from a precompiled cache skips the check too (~0.3 s per
variant on a 2-core host). ``QLA_SERVE_STARTUP_COMPILE=0`` turns it off (kernels then build on
first use, each logged by TileLang).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time

from .precompile import Job, Summary, auto_jobs, cache_dir, discover_modules, enumerate_jobs, run_jobs
from .ready import marker_path, start_up_request, write_marker

log = logging.getLogger("qla_serve")

_DONE: dict[tuple, str] = {}


def enabled() -> bool:
    """QLA_SERVE_STARTUP_COMPILE: 1 (default) or 0."""
    value = os.environ.get("QLA_SERVE_STARTUP_COMPILE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"QLA_SERVE_STARTUP_COMPILE: expected 0 or 1, got {value!r}")
    return value == "1"


def build_processes() -> int:
    """QLA_SERVE_STARTUP_JOBS: a positive process count, or "auto" (the default, precompile's
    auto_jobs: one rank of a host builds while the others wait on the lock)."""
    value = os.environ.get("QLA_SERVE_STARTUP_JOBS", "auto")
    if value == "auto":
        return auto_jobs()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"QLA_SERVE_STARTUP_JOBS: expected a positive process count or 'auto', got {value!r}")
    return int(value)


def _build(jobs, modules, workers: int) -> Summary:
    """Build ``jobs`` here, or in ``workers`` processes started by a child interpreter
    (_child_main, handed the jobs on its stdin), never by this process: an engine's worker is a
    daemon process, which multiprocessing forbids children, and spawning from an engine process
    would re-import its ``__main__`` (a user's script) in every compiling process."""
    if workers > 1:
        spec = {"workers": workers, "jobs": [dataclasses.asdict(j) for j in jobs]}
        run = subprocess.run([sys.executable, "-m", "qla_serve.deploy.startup"], input=json.dumps(spec),
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"qla_serve: the start-up kernel build's child process failed "
                               f"({run.returncode}): {run.stderr[-3000:]}")
        return Summary(**json.loads(run.stdout.strip().splitlines()[-1]))
    return run_jobs(jobs, modules, progress=False, workers=workers)[1]


def _child_main() -> int:
    """``python -m qla_serve.deploy.startup`` with {"workers": N, "jobs": [...]} (JSON) on stdin:
    build those jobs in N processes and print the summary as JSON on the last line."""
    spec = json.load(sys.stdin)
    modules, _ = discover_modules()     # the jobs name their modules; the workers import them
    summary = run_jobs([Job(**j) for j in spec["jobs"]], modules, progress=False, workers=spec["workers"])[1]
    print(json.dumps(dataclasses.asdict(summary)))
    return 0


@contextlib.contextmanager
def _host_lock(root: str):
    """An exclusive lock on ``<cache>/qla_serve_startup.lock`` (one builder per host)."""
    import fcntl
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "qla_serve_startup.lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_kernels(num_v_heads: int, num_k_heads: int, *, target: str, io_dtype: str, state_dtype: str,
                   match: str | None = None) -> str:
    """Build (load or compile) every kernel variant for these TP-local heads, dtypes ("bfloat16",
    "float32", ...) and target ("sm_90a" / "sm_100a") into TileLang's cache; once per process and
    arguments. Returns the line it logged; raises RuntimeError naming the variants that failed.
    ``match``: only variant names matching this regex (tests)."""
    key = (num_v_heads, num_k_heads, target, io_dtype, state_dtype, match)
    if key in _DONE:
        return _DONE[key]
    what = f"heads {num_k_heads}/{num_v_heads}, io {io_dtype}, state {state_dtype}, {target}"
    if not enabled():
        line = f"qla_serve: start-up kernel build off (QLA_SERVE_STARTUP_COMPILE=0) for {what}"
        log.info(line)
        _DONE[key] = line
        return line
    modules, problems = discover_modules()
    jobs, more = enumerate_jobs([start_up_request(num_k_heads, num_v_heads, target, io_dtype, state_dtype)],
                                modules, match)
    problems += more
    if problems:
        raise RuntimeError("qla_serve: cannot list the kernels to build at start-up: " + "; ".join(problems))
    root = cache_dir()
    marker = marker_path(root, jobs)
    t0 = time.perf_counter()
    with _host_lock(root):
        if os.path.exists(marker):   # another process of this host, or `qla-serve precompile`, built the set
            line = (f"qla_serve: {len(jobs)} TileLang kernels for {what} in the cache ({root}; marked "
                    f"complete by another process or qla-serve precompile, {time.perf_counter() - t0:.1f} s waiting)")
            log.info(line)
            _DONE[key] = line
            return line
        workers = build_processes()
        summary = _build(jobs, modules, workers)
        if not summary.ok:
            raise RuntimeError(f"qla_serve: {summary.failed} of {len(jobs)} kernels for {what} failed to build "
                               f"at start-up: " + "; ".join(summary.problems + summary.failures[:3]))
        write_marker(marker, what, len(jobs))
    line = (f"qla_serve: {len(jobs)} TileLang kernels for {what} ready in {summary.seconds:.1f} s: "
            f"{summary.cached} from the cache, {summary.compiled} compiled"
            + (f" in {workers} processes" if summary.compiled and workers > 1 else "") + f" ({root})")
    if summary.compiled:
        line += (f"; compile them ahead of time: `qla-serve precompile --heads {num_k_heads}/{num_v_heads} "
                 f"--arch {target} -j N` with this TILELANG_CACHE_DIR, or use the images")
    log.log(logging.WARNING if summary.compiled else logging.INFO, line)
    _DONE[key] = line
    return line


if __name__ == "__main__":
    raise SystemExit(_child_main())
