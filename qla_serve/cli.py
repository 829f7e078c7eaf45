"""`qla-serve` command line: info, plan, demo, bench, and the deployment commands.

Exit codes: 0 success, 1 a check failed (e.g. the demo's numbers), 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

# The argparse types live below this module and deploy/cli.py (which uses parse_heads too);
# parse_heads stays importable from here.
from qla_serve._cli_args import (join_negative_values, non_negative_int, parse_device, parse_heads,  # noqa: F401
                                 parse_seqlens, parse_strategies, positive_int)

# Options whose values may start with "-" (a negative length is reported by the option's type,
# not taken for an unknown option: `--seqlens -5,100`).
_VALUE_OPTIONS = ("--seqlens", "--heads")


def _cmd_info(args) -> int:
    import torch
    import qla_serve
    from qla_serve.ops import explain_path

    rows = [("qla_serve", qla_serve.__version__), ("python", sys.version.split()[0]),
            ("torch", torch.__version__)]
    for mod in ("tilelang", "tvm_ffi", "fla", "flash_qla", "vllm", "sglang"):
        rows.append((mod, _version_of(mod)))
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        rows.append(("gpu", f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"))
        device = "cuda"
    else:
        rows.append(("gpu", "none (CPU: the reference path runs)"))
        device = "cpu"
    for op in ("prefill", "decode", "verify"):
        path, why = explain_path(op, device)
        rows.append((f"{op} path", f"{path} ({why})"))
    rows.append(("TileLang cache", os.environ.get("TILELANG_CACHE_DIR", "~/.tilelang/cache (TileLang default)")))
    rows.append(("TMA descriptor memo", _memo_status()))
    rows.append(("start-up kernel build", _startup_status()))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _startup_status() -> str:
    """What an engine's start-up would do about kernels (deploy/startup.py), from the switches."""
    from qla_serve.deploy import startup
    try:
        if not startup.enabled():
            return "off (QLA_SERVE_STARTUP_COMPILE=0: kernels build on first use)"
        jobs = os.environ.get("QLA_SERVE_STARTUP_JOBS", "auto")
        return f"on; misses compile in {startup.build_processes()} process(es) (QLA_SERVE_STARTUP_JOBS={jobs})"
    except ValueError as exc:
        return f"refused: {exc}"


def _memo_status() -> str:
    """The TMA descriptor memo (kernels/hopper/host_cache.py) as the kernels will find it; builds nothing."""
    try:
        from qla_serve.kernels.hopper import host_cache
        if not host_cache.enabled_by_env():
            return f"off ({host_cache.ENV}=0)"
        path = host_cache.library_path()
    except Exception as exc:  # tilelang / tvm_ffi missing, or a bad switch value
        return f"not available ({type(exc).__name__}: {exc})"
    return f"built: {path}" if path.exists() else f"built with c++ at the first kernel launch ({path})"


def _version_of(module: str) -> str:
    import importlib
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # not installed, or fails to load
        return f"not available ({type(exc).__name__})"
    return str(getattr(mod, "__version__", "installed"))


def _cmd_plan(args) -> int:
    from qla_serve.plan import plan_prefill

    hk, hv = args.heads
    plan = plan_prefill(args.seqlens, hv, hk, device="cpu", cp=args.cp, sm_count=args.sm_count,
                        arch=args.arch, supported_strategies=args.strategies)
    d = plan.describe()
    if args.json:
        print(json.dumps(d))
        return 0
    print(f"strategy {d['strategy']}  v_split {d['v_split']}  segment {d['segment_chunks']} chunks  "
          f"cp={d['cp']}  arch {d['arch']} ({d['sm_count']} SMs)")
    print(f"{d['num_seqs']} seqs, {d['total_tokens']} tokens, heads {hk}/{hv}: {d['num_segments']} segments, "
          f"{d['blocks']} blocks, modelled {d['estimated_us']} us")
    print(f"{'seg':>4} {'seq':>4} {'first chunk':>11} {'chunks':>6}  initial state")
    for i, (seq, first, n, carried) in enumerate(d["segments"][: args.max_rows]):
        print(f"{i:>4} {seq:>4} {first:>11} {n:>6}  {'carried (pool)' if carried else 'recomputed'}")
    if len(d["segments"]) > args.max_rows:
        print(f"... {len(d['segments']) - args.max_rows} more (--max-rows)")
    return 0


def _cmd_demo(args) -> int:
    from qla_serve.demo import run_demo
    return run_demo(device=args.device, heads=args.heads, seqlens=args.seqlens,
                    decode_steps=args.decode_steps, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qla-serve", description="Gated DeltaNet kernels for LLM serving")
    p.add_argument("-v", "--verbose", action="store_true", help="log which path each op takes")
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="versions, GPU, the path each op takes").set_defaults(fn=_cmd_info)

    pl = sub.add_parser("plan", help="print the prefill plan for a batch")
    pl.add_argument("--heads", type=parse_heads, required=True, help="TP-local QK/V heads, e.g. 2/8")
    pl.add_argument("--seqlens", type=parse_seqlens, required=True, help="e.g. 32768,8192")
    pl.add_argument("--cp", choices=("auto", "off", "exact"), default="auto")
    pl.add_argument("--arch", choices=("sm90", "sm100"), default="sm90")
    pl.add_argument("--sm-count", type=positive_int, default=None, help="default: the cost model's")
    pl.add_argument("--strategies", type=parse_strategies, default=None,
                    help="comma list the kernels support (default: all: plain,vsplit,cp)")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--max-rows", type=non_negative_int, default=32)
    pl.set_defaults(fn=_cmd_plan)

    de = sub.add_parser("demo", help="varlen prefill + decode on the best path, checked against float64")
    de.add_argument("--device", type=parse_device, default=None, help="cuda or cpu (default: cuda if available)")
    de.add_argument("--heads", type=parse_heads, default=(2, 8))
    de.add_argument("--seqlens", type=parse_seqlens, default=[300, 1, 0, 129])
    de.add_argument("--decode-steps", type=non_negative_int, default=4)
    de.add_argument("--seed", type=int, default=0)
    de.set_defaults(fn=_cmd_demo)

    from qla_serve.bench import add_cli_commands as add_bench
    add_bench(sub)
    try:
        from qla_serve.deploy import add_cli_commands as add_deploy
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("qla_serve.deploy"):
            raise
    else:
        add_deploy(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(join_negative_values(sys.argv[1:] if argv is None else list(argv), _VALUE_OPTIONS))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    try:
        return int(args.fn(args) or 0)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"qla-serve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger("qla_serve").debug("took %.2f s", time.perf_counter() - t0)


if __name__ == "__main__":
    sys.exit(main())
