"""A digest of every kernel variant's TileLang program, without compiling: is a refactor a no-op?

    python benchmarks/program_digest.py --heads 2/8 16/64 [--arch sm_90a] [--match RE] > after.txt
    git stash; python benchmarks/program_digest.py ... > before.txt; git stash pop
    diff before.txt after.txt          # empty: the same programs, the same CUDA, the same cache keys

For each (variant, target) that ``qla-serve precompile --heads ...`` would build, one line
``target name sha256``: the SHA-256 of the program's TVMScript text with its metadata
(``func.script(show_meta=True)``), the text TileLang 0.1.12 keys its kernel cache by
(tilelang/cache/kernel_cache.py, ``_generate_key``). Two trees with the same lines generate the
same kernels: a restructuring of kernel Python code shown this way needs no GPU run. A changed
line says which variants changed; look at the programs themselves with ``--dump DIR``.

How: the kernel modules' ``build`` is called as precompile calls it, with ``tilelang.compile``
replaced by a function that records the program and stops the build; nothing is compiled or
cached. Runs in a few seconds per head pair on any machine (no GPU, no nvcc).
"""

import argparse
import hashlib
import pathlib
import sys


class _Captured(Exception):
    """Raised by the stand-in for tilelang.compile, carrying the program."""

    def __init__(self, func):
        super().__init__("captured")
        self.func = func


def _capture(func, *args, **kwargs):
    raise _Captured(func)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", required=True, metavar="HK/HV")
    p.add_argument("--arch", default="sm_90a", help="comma list of targets (default sm_90a)")
    p.add_argument("--match", help="only variants whose name matches this regex")
    p.add_argument("--dump", help="also write each program's text to DIR/<target>/<name>.tir")
    args = p.parse_args()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    import tilelang

    import qla_serve
    from qla_serve.deploy import precompile as pc

    print(f"qla_serve from {pathlib.Path(qla_serve.__file__).parent}", file=sys.stderr)

    requests = []
    for h in args.heads:
        hk, hv = (int(x) for x in h.split("/"))
        requests.append(pc.HeadRequest(hk, hv, tuple(args.arch.split(","))))
    modules, problems = pc.discover_modules()
    jobs, more = pc.enumerate_jobs(requests, modules, args.match)
    if problems or more:
        sys.exit("\n".join(problems + more))
    builds = {m.name: m.build for m in modules}
    tilelang.compile = _capture
    for job in jobs:
        try:
            builds[job.module](job.variant, job.target)
        except _Captured as c:
            text = c.func.script(show_meta=True)
        else:
            sys.exit(f"{job.name}: its build did not go through tilelang.compile (already built?)")
        print(job.target, job.name, hashlib.sha256(text.encode()).hexdigest())
        if args.dump:
            out = pathlib.Path(args.dump) / job.target / f"{job.name}.tir"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
