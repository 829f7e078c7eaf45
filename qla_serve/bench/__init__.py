"""Benchmarks (`qla-serve bench prefill|decode|layer`): qla_serve beside FLA, FlashQLA and FlashInfer,
same inputs (`layer`: one whole GDN layer per engine step, conv and caches included).

Each benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
Speed is measured here, never in tests.
"""

from __future__ import annotations

import importlib

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
