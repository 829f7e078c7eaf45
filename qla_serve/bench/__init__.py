"""Benchmarks (`qla-serve bench prefill|decode|layer`): qla_serve beside FLA, FlashQLA and FlashInfer,
same inputs (`layer`: one whole GDN layer per engine step, conv and caches included).

Each benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
Speed is measured here, never in tests.
"""

from __future__ import annotations

import importlib
import os
import subprocess

BENCHES = {"prefill": "qla_serve.bench.prefill", "decode": "qla_serve.bench.decode",
           "layer": "qla_serve.bench.layer"}


def add_cli_commands(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks beside FLA and FlashQLA (GPU)")
    which = bench.add_subparsers(dest="bench", required=True)
    for name, module in BENCHES.items():
        p = which.add_parser(name, help=f"{name} benchmark")
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            if exc.name != module:
                raise
            p.set_defaults(fn=_missing(name))
            continue
        mod.add_arguments(p)
        p.set_defaults(fn=mod.run)


def _missing(name):
    def fn(args) -> int:
        raise RuntimeError(f"the {name} benchmark is not part of this build of qla_serve")
    return fn


def source_commit() -> str | None:
    """$QLA_SERVE_COMMIT if set, else git rev-parse HEAD of the checkout this package lives in
    ("+dirty" if it has changes). The variable is for copies whose .git is not the code's (the
    lent GPU machine receives the working tree with the .git of an older checkout)."""
    if os.environ.get("QLA_SERVE_COMMIT"):
        return os.environ["QLA_SERVE_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - not a checkout, or no git
        return None
