"""Ahead-of-time compilation of every TileLang kernel variant a deployment needs.

FlashQLA-style JIT spends tens of seconds per head configuration on the first call;
at serve time that is a stalled request on every rank. ``qla-serve precompile``
compiles the variants up front, without a GPU, into TileLang's on-disk cache
(``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``): the kernels use explicit
targets (``{"kind": "cuda", "arch": "sm_90a"}``), and a cache filled on a GPU-less
machine was seen to be a hit on the H200.

Kernel modules are discovered, never imported eagerly: every module under
``qla_serve.kernels.hopper`` and ``qla_serve.kernels.blackwell`` (package and
submodules) that defines both ``kernel_variants(num_v_heads, num_k_heads) -> list[dict]``
and ``build(variant, target)`` is one; a package that defines them itself speaks for
its submodules (hopper/__init__.py aggregates prefill and decode), which are then not
scanned. The targets a module builds come from its
``TARGETS`` (or ``_TARGETS``) tuple, else hopper modules build both sm_90a and
sm_100a and blackwell modules sm_100a. An arch that no module serves is an error
("no kernels registered for arch X"), as is a module that fails to import.

A variant dict is opaque here except for: ``name`` (shown, matched by ``--match``),
``pool_dtype``/``state_dtype`` and ``io_dtype`` (a config keeps only the variants of
its state dtype and activation dtype; variants without these keys are all kept).

Whether a build compiled or hit the cache: the process that builds it counts TileLang's cache
writes (KernelCache saves an entry only after a fresh compile). With ``--jobs N`` builds run in
N spawned processes at once, each counting its own. (Not a diff of the cache directory: another
process writing to the same cache at the same time -- another precompile, a rank of another
host on a shared volume -- would make hits look compiled.)

``--pack OUT.tar.xz`` also writes the cache entries the builds used, hits included (each
process records the key of every kernel TileLang's cache looks up), as one tar relative to
the cache directory: unpacked into an empty TILELANG_CACHE_DIR elsewhere, the same builds
are all hits there. A deployment's kernels as one artifact, or exactly the kernels a lent
GPU's run needs.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import pkgutil
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional

from .config import TARGETS

KERNEL_PACKAGES = ("qla_serve.kernels.hopper", "qla_serve.kernels.blackwell")
_DEFAULT_TARGETS = {"qla_serve.kernels.hopper": TARGETS, "qla_serve.kernels.blackwell": ("sm_100a",)}
_STATE_KEYS = ("pool_dtype", "state_dtype")
_IO_KEYS = ("io_dtype",)


@dataclass(frozen=True)
class HeadRequest:
    """TP-local heads to compile for, and the dtypes that narrow the variants (None = all)."""

    num_k_heads: int
    num_v_heads: int
    targets: tuple[str, ...] = TARGETS
    state_dtype: Optional[str] = None
    io_dtype: Optional[str] = None
    source: str = "--heads"

    @property
    def heads(self) -> str:
        return f"{self.num_k_heads}/{self.num_v_heads}"


@dataclass
class KernelModule:
    name: str
    kernel_variants: Callable[[int, int], list]
    build: Callable[[dict, str], Any]
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Job:
    module: str
    target: str
    variant: dict = field(compare=False, hash=False)
    key: str = ""          # module + canonical JSON of the variant + target: dedup key

    @property
    def name(self) -> str:
        return str(self.variant.get("name") or self.key)


@dataclass
class Outcome:
    job: Job
    status: str            # "compiled" | "cached" | "failed"
    seconds: float
    new_entries: int = 0            # kernels TileLang compiled and saved to the cache for this build
    error: str = ""
    entries: tuple[str, ...] = ()   # the cache entry directories the build used (hit or compiled)


@dataclass
class Summary:
    compiled: int = 0
    cached: int = 0
    failed: int = 0
    seconds: float = 0.0
    cache_dir: str = ""
    problems: list[str] = field(default_factory=list)   # discovery/enumeration errors
    failures: list[str] = field(default_factory=list)   # one line per failed build

    @property
    def ok(self) -> bool:
        return not self.failed and not self.problems

    def text(self) -> str:
        total = self.compiled + self.cached + self.failed
        lines = [f"precompile: {total} kernel variant builds: {self.compiled} compiled, "
                 f"{self.cached} cached hits, {self.failed} failed in {self.seconds:.1f} s; "
                 f"cache {self.cache_dir}"]
        lines += [f"  error: {p}" for p in self.problems]
        lines += [f"  failed: {f}" for f in self.failures]
        return "\n".join(lines)


# --------------------------------------------------------------------------- discovery


def discover_modules(packages: Iterable[str] = KERNEL_PACKAGES) -> tuple[list[KernelModule], list[str]]:
    """Import the kernel packages and their submodules; return (kernel modules, problems)."""
    found: list[KernelModule] = []
    problems: list[str] = []
    seen: set[int] = set()
    for pkg_name in packages:
        names = [pkg_name]
        try:
            pkg = importlib.import_module(pkg_name)
        except ModuleNotFoundError as e:
            if e.name != pkg_name:    # the package exists but needs something missing: loud
                problems.append(f"module {pkg_name} failed to import: {type(e).__name__}: {e}")
            # An absent package is no error by itself: an arch nobody serves is reported
            # by enumerate_jobs ("no kernels registered for arch ...").
            continue
        except Exception as e:  # a broken package is a loud error, not a skipped arch
            problems.append(f"module {pkg_name} failed to import: {type(e).__name__}: {e}")
            continue
        # A package that defines kernel_variants/build speaks for its submodules (it
        # aggregates them); otherwise each submodule that defines them is a kernel module.
        if hasattr(pkg, "__path__") and not callable(getattr(pkg, "kernel_variants", None)):
            names += [f"{pkg_name}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
        for name in names:
            try:
                mod = importlib.import_module(name)
            except Exception as e:
                problems.append(f"module {name} failed to import: {type(e).__name__}: {e}")
                continue
            kv, build = getattr(mod, "kernel_variants", None), getattr(mod, "build", None)
            if not (callable(kv) and callable(build)):
                continue
            if id(kv) in seen:  # a package re-exporting a submodule's functions
                continue
            seen.add(id(kv))
            targets = getattr(mod, "TARGETS", None) or getattr(mod, "_TARGETS", None) \
                or _DEFAULT_TARGETS.get(pkg_name, TARGETS)
            found.append(KernelModule(name, kv, build, tuple(targets)))
    return found, problems


# --------------------------------------------------------------------------- enumeration


def _keep(variant: dict, keys: tuple[str, ...], want: Optional[str]) -> bool:
    if want is None:
        return True
    for k in keys:
        if k in variant:
            return str(variant[k]).removeprefix("torch.") == want
    return True


def enumerate_jobs(requests: list[HeadRequest], modules: list[KernelModule],
                   match: Optional[str] = None) -> tuple[list[Job], list[str]]:
    """Every (module, variant, target) the requests need, deduplicated, in a stable order.

    Returns (jobs, problems). Problems: an arch no module serves, a module rejecting the
    heads, a config's dtype filter leaving nothing for a module that has variants.
    """
    pattern = re.compile(match) if match else None
    jobs: dict[str, Job] = {}
    problems: list[str] = []
    wanted = sorted({t for r in requests for t in r.targets}, key=TARGETS.index)
    for target in wanted:
        if not any(target in m.targets for m in modules):
            problems.append(f"no kernels registered for arch {target} (looked in "
                            f"{', '.join(KERNEL_PACKAGES)}; found "
                            f"{', '.join(m.name for m in modules) or 'no kernel modules'})")
    for req in requests:
        for mod in modules:
            targets = [t for t in req.targets if t in mod.targets]
            if not targets:
                continue
            try:
                variants = list(mod.kernel_variants(req.num_v_heads, req.num_k_heads))
            except Exception as e:
                problems.append(f"{mod.name}.kernel_variants(num_v_heads={req.num_v_heads}, "
                                f"num_k_heads={req.num_k_heads}) for {req.source} failed: "
                                f"{type(e).__name__}: {e}")
                continue
            kept = [v for v in variants
                    if _keep(v, _STATE_KEYS, req.state_dtype) and _keep(v, _IO_KEYS, req.io_dtype)]
            if variants and not kept:
                problems.append(f"{mod.name}: none of its {len(variants)} variants for heads "
                                f"{req.heads} has state dtype {req.state_dtype} and io dtype "
                                f"{req.io_dtype} ({req.source})")
            for v in kept:
                if pattern and not pattern.search(str(v.get("name", ""))):
                    continue
                canon = json.dumps(v, sort_keys=True, default=str)
                for t in targets:
                    key = f"{mod.name}|{canon}|{t}"
                    jobs.setdefault(key, Job(mod.name, t, v, key))
    order = sorted(jobs.values(), key=lambda j: (TARGETS.index(j.target), j.module, j.name))
    return order, problems


def requests_from_configs(configs, arch: Optional[tuple[str, ...]] = None) -> list[HeadRequest]:
    """One request per config: its TP-local heads, dtypes and targets (``arch`` overrides)."""
    return [HeadRequest(c.local_k_heads, c.local_v_heads, arch or tuple(c.qla.targets),
                        c.qla.state_dtype, c.model.dtype, source=c.name) for c in configs]


# --------------------------------------------------------------------------- compiling


MAX_AUTO_JOBS = 8   # ~1 GB of memory per compiling process


def auto_jobs() -> int:
    """Processes for a build when none is asked for: half the CPUs this process may run on, at
    least 1, at most MAX_AUTO_JOBS."""
    return max(1, min(MAX_AUTO_JOBS, len(os.sched_getaffinity(0)) // 2))


def cache_dir() -> str:
    """The directory TileLang's kernel cache writes to (TILELANG_CACHE_DIR or its default)."""
    from tilelang import env
    return os.path.abspath(os.path.expanduser(str(env.TILELANG_CACHE_DIR)))


def _cache_entries(root: str) -> set[str]:
    """Kernel cache entries: <root>/<version>/<platform>/kernels/<key>."""
    out = set()
    if not os.path.isdir(root):
        return out
    for version in os.scandir(root):
        if not version.is_dir():
            continue
        for plat in os.scandir(version.path):
            kdir = os.path.join(plat.path, "kernels")
            if plat.is_dir() and os.path.isdir(kdir):
                out.update(os.path.join(kdir, e) for e in os.listdir(kdir))
    return out


def _error_text(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _quiet_tilelang() -> None:
    # TileLang logs two INFO lines per compile: they would tear the progress bar apart, and
    # the per-build lines (or the bar) already say what is compiling.
    if not quiet_logs_off():
        tl_log = logging.getLogger("tilelang")
        tl_log.setLevel(max(tl_log.level, logging.WARNING))


def _save_counter() -> list[int]:
    """Count TileLang's writes of freshly compiled kernels to its cache, in this process.

    KernelCache saves an entry only after compiling (a disk hit just loads it), so the count
    tells compiled from cached for builds run in this process, whatever other processes write
    to the same cache at the same time (a diff of the directory cannot)."""
    from tilelang.cache.kernel_cache import KernelCache

    counter = getattr(KernelCache, "_qla_serve_saves", None)
    if counter is None:
        counter = [0]
        original = KernelCache._save_kernel_to_disk

        def counted(self, *args, **kwargs):
            counter[0] += 1
            return original(self, *args, **kwargs)

        KernelCache._save_kernel_to_disk = counted
        KernelCache._qla_serve_saves = counter
    return counter


def _entry_recorder() -> list[str]:
    """The cache entries (directories) TileLang's KernelCache looks up in this process, in order:
    one per cache key it generates, whether the kernel then comes from memory, from disk or from
    a compile (what --pack packs)."""
    from tilelang.cache.kernel_cache import KernelCache

    paths = getattr(KernelCache, "_qla_serve_entries", None)
    if paths is None:
        paths = []
        original = KernelCache._generate_key

        def recorded(self, *args, **kwargs):
            key = original(self, *args, **kwargs)
            paths.append(self._get_cache_path(key))
            return key

        KernelCache._generate_key = recorded
        KernelCache._qla_serve_entries = paths
    return paths


def _counted_build(build: Callable[[dict, str], Any], variant: dict,
                   target: str) -> tuple[str, float, int, str, tuple[str, ...]]:
    """One build in this process: (status, seconds, kernels compiled and saved, error, the cache
    entries it used). Compiled or cached is this process's count of TileLang's cache saves."""
    saves = _save_counter()   # imports tilelang, which sets up its logger: quiet it after
    _quiet_tilelang()
    used = _entry_recorder()
    n0, u0 = saves[0], len(used)
    t0 = time.perf_counter()
    try:
        build(variant, target)
    except Exception as e:
        return "failed", time.perf_counter() - t0, 0, _error_text(e), ()
    new = saves[0] - n0
    return ("compiled" if new else "cached"), time.perf_counter() - t0, new, "", tuple(used[u0:])


def _build_in_worker(module: str, variant: dict, target: str) -> tuple[str, float, int, str, tuple[str, ...]]:
    """One build in a worker process (--jobs > 1): _counted_build of the module's build."""
    return _counted_build(importlib.import_module(module).build, variant, target)


def run_jobs(jobs: list[Job], modules: list[KernelModule], *, progress: bool = True, workers: int = 1,
             on_outcome: Optional[Callable[[Outcome], None]] = None) -> tuple[list[Outcome], Summary]:
    """Build every job through its module's ``build``; never stops at a failure.

    ``workers`` > 1 builds in that many fresh (spawned) processes at once; TileLang's cache
    writes are atomic (staging directory + rename), so concurrent builds are safe.
    """
    from tilelang import env

    summary = Summary(cache_dir=cache_dir())
    if not env.is_cache_enabled():
        summary.problems.append("TileLang's kernel cache is disabled (TILELANG_DISABLE_CACHE?): "
                                "precompiling would not persist anything")
        return [], summary
    _quiet_tilelang()
    from tqdm import tqdm

    by_name = {m.name: m for m in modules}
    outcomes: list[Outcome] = []
    bar = tqdm(total=len(jobs), desc="precompile", unit="kernel", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)

    def done(out: Outcome) -> None:
        outcomes.append(out)
        bar.set_postfix_str(f"{out.job.target} {out.job.name}"[-60:], refresh=False)
        bar.update(1)
        if on_outcome:
            on_outcome(out)

    t_start = time.perf_counter()
    if workers <= 1:
        for job in jobs:
            done(Outcome(job, *_counted_build(by_name[job.module].build, job.variant, job.target)))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # spawn, not fork: the parent has imported torch/TVM, whose threads do not survive fork.
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            futures = {ex.submit(_build_in_worker, j.module, j.variant, j.target): j for j in jobs}
            for fut in as_completed(futures):
                job = futures[fut]
                try:
                    status, secs, new, err, entries = fut.result()
                except Exception as e:  # the worker died (e.g. out of memory)
                    status, secs, new, err, entries = "failed", 0.0, 0, _error_text(e), ()
                done(Outcome(job, status, secs, new, err, entries))
        order = {j.key: i for i, j in enumerate(jobs)}
        outcomes.sort(key=lambda o: order[o.job.key])
    bar.close()
    summary.seconds = time.perf_counter() - t_start
    for o in outcomes:
        if o.status == "compiled":
            summary.compiled += 1
        elif o.status == "cached":
            summary.cached += 1
        else:
            summary.failed += 1
            summary.failures.append(f"{o.job.target} {o.job.module} {o.job.name}: {o.error}")
    return outcomes, summary


PACK_MODES = {".tar.xz": "w:xz", ".tar.gz": "w:gz", ".tgz": "w:gz", ".tar": "w"}


def pack_mode(path: str) -> str:
    """tarfile's write mode for --pack's file name, by its suffix; ValueError for another."""
    for suffix, mode in PACK_MODES.items():
        if path.endswith(suffix):
            return mode
    raise ValueError(f"--pack: expected a file name ending in {', '.join(PACK_MODES)}, got {path!r}")


def pack_entries(outcomes: list[Outcome], out_path: str, root: str, extra: list[str] = ()) -> tuple[int, int]:
    """Write the cache entries the successful builds used to a tar at out_path, named relative
    to the cache root, so that `tar -xf out_path -C DIR` gives a TileLang cache (TILELANG_CACHE_DIR
    = DIR) in which the same builds are hits: a deployment's compiled kernels as one artifact, or
    the kernels a device run needs and nothing else. ``extra``: more files under the cache root
    to carry (the host memo library, ready markers), not counted as entries. Returns (entries, bytes written)."""
    import tarfile

    mode = pack_mode(out_path)
    root = os.path.abspath(root)
    entries = sorted({os.path.abspath(e) for o in outcomes if o.status != "failed" for e in o.entries})
    for e in entries:
        if os.path.commonpath([root, e]) != root or not os.path.isdir(e):
            raise RuntimeError(f"--pack: cache entry {e} is not a directory under the cache {root}")
    files = [os.path.abspath(e) for e in extra]
    for e in files:
        if os.path.commonpath([root, e]) != root or not os.path.isfile(e):
            raise RuntimeError(f"--pack: {e} is not a file under the cache {root}")
    with tarfile.open(out_path, mode) as tar:
        for e in entries + files:
            tar.add(e, arcname=os.path.relpath(e, root))
    return len(entries), os.path.getsize(out_path)


def quiet_logs_off() -> bool:
    """QLA_SERVE_PRECOMPILE_VERBOSE=1 keeps TileLang's per-kernel INFO logs."""
    return os.environ.get("QLA_SERVE_PRECOMPILE_VERBOSE", "") not in ("", "0")


def summary_json(outcomes: list[Outcome], summary: Summary) -> str:
    d = asdict(summary)
    d["ok"] = summary.ok
    d["builds"] = [{"module": o.job.module, "target": o.job.target, "name": o.job.name,
                    "status": o.status, "seconds": round(o.seconds, 3), "error": o.error}
                   for o in outcomes]
    return json.dumps(d, indent=2)
