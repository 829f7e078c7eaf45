"""Ready markers: a file in TileLang's cache that says one start-up kernel set is complete there.

An engine's start-up (startup.ensure_kernels) needs every kernel variant for its TP-local heads,
target, activation dtype and state dtype. Checking that set against the cache means building
each variant's program to find its cache key, ~0.3 s per variant on a 2-core host (111 variants
at 2/8, bf16, fp32 states: 36 s). A marker, ``<cache>/qla_serve_ready/<digest>``, keyed by the
kernel sources and the set's job keys, lets a process skip that: start-up writes one after it
built a set, and ``qla-serve precompile`` writes one for every set it built completely, so the
first start-up from a precompiled cache (the Docker images, a ``--pack``) skips it too.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .precompile import HeadRequest, Job, KernelModule, Outcome, enumerate_jobs

READY_DIR = "qla_serve_ready"
# The activation and SSM state dtypes an engine's start-up can ask for (float32 models are
# refused on a GPU; the SSM state is float32 or bfloat16).
IO_DTYPES = ("bfloat16", "float16")
STATE_DTYPES = ("float32", "bfloat16")
_KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"


def sources_digest() -> str:
    """A hash of the kernel sources: a marker written for other sources does not count."""
    h = hashlib.sha256()
    for path in sorted(_KERNELS_DIR.rglob("*.py")):
        h.update(str(path.relative_to(_KERNELS_DIR)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def start_up_request(num_k_heads: int, num_v_heads: int, target: str, io_dtype: str,
                     state_dtype: str) -> HeadRequest:
    """The kernel set an engine's start-up builds for these heads, target and dtypes."""
    return HeadRequest(num_k_heads, num_v_heads, (target,), state_dtype, io_dtype, source="start-up")


def marker_path(root: str, jobs: list[Job], digest: str | None = None) -> str:
    """The marker of this job set under the cache ``root``."""
    key = "\n".join([digest or sources_digest(), *sorted(j.key for j in jobs)])
    return os.path.join(root, READY_DIR, hashlib.sha256(key.encode()).hexdigest()[:32])


def write_marker(path: str, what: str, count: int) -> None:
    """Write a marker atomically (several processes may write the same one)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    Path(tmp).write_text(f"{what}\n{count} kernels\n")
    os.replace(tmp, path)


def mark_built_sets(requests: list[HeadRequest], modules: list[KernelModule], outcomes: list[Outcome],
                    root: str) -> list[str]:
    """For every start-up set of these requests (their heads and targets, their dtypes or every
    dtype pair start-up can ask for) whose jobs all built here without a failure, write its
    marker; return the markers' paths."""
    built = {o.job.key for o in outcomes if o.status != "failed"}
    digest = sources_digest()
    written = []
    for r in requests:
        for target in r.targets:
            for io in (r.io_dtype,) if r.io_dtype else IO_DTYPES:
                for state in (r.state_dtype,) if r.state_dtype else STATE_DTYPES:
                    jobs, problems = enumerate_jobs(
                        [start_up_request(r.num_k_heads, r.num_v_heads, target, io, state)], modules)
                    if problems or not jobs or not {j.key for j in jobs} <= built:
                        continue
                    path = marker_path(root, jobs, digest)
                    write_marker(path, f"heads {r.heads}, io {io}, state {state}, {target} "
                                       f"(qla-serve precompile)", len(jobs))
                    written.append(path)
    return sorted(set(written))
