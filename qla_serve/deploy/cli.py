"""The deployment commands of `qla-serve`, registered by :func:`add_cli_commands`.

    qla-serve config check FILE...        every bad field, one line each (exit 1), or a summary
    qla-serve config render FILE [--format shell|argv|json]
    qla-serve config render FILE... --format compose    (docker/compose.tp8-long.yaml)
    qla-serve precompile (--config FILE|DIR ... | --heads 2/8 ...) [--arch sm_90a,sm_100a] [--pack OUT.tar.xz]
                         [--engine vllm|sglang] [--match REGEX] [--list] [--json OUT] [--no-progress] [--jobs N|auto]

Every handler returns its exit code: 0 ok, 1 a check or a build failed (a config with bad
fields), 2 bad input (a file that is missing, not text or not YAML; a bad --heads / --arch
value). `config check`, `config render` and `precompile --config` agree on these.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from qla_serve._cli_args import parse_heads, positive_int

from .config import ENGINES, TARGETS, ConfigError, DeploymentConfig, check_config, read_yaml, resolve_config

# Exit codes (module docstring).
CHECK_FAILED, BAD_INPUT = 1, 2


def _parse_arch(text: str) -> tuple[str, ...]:
    archs = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in archs if a not in TARGETS]
    if not archs or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of {', '.join(TARGETS)}, got {text!r}"
            + (" (sm_90 without 'a' cannot lower the warpgroup instructions)" if "sm_90" in bad else ""))
    return tuple(dict.fromkeys(archs))


def _pack_path(text: str) -> str:
    """--pack's file name, its suffix checked before anything compiles."""
    from .precompile import pack_mode
    try:
        pack_mode(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _config_files(paths: list[str], what: str = "FILE") -> list[str]:
    """Files as given; a directory stands for its *.yaml files (sorted); a bare name that is
    not a file is a shipped config (``qwen3.5-397b-a17b-tp8``)."""
    out = []
    for p in map(resolve_config, paths):
        if os.path.isdir(p):
            found = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith((".yaml", ".yml")))
            if not found:
                raise ValueError(f"{what}: directory {p} has no *.yaml files")
            out += found
        else:
            out.append(p)
    return out


# --------------------------------------------------------------------------- config check / render


def _load_or_report(path: str, *, summary: bool = False) -> tuple[Optional[DeploymentConfig], int]:
    """(config, 0), or (None, exit code) after printing every problem, each prefixed with the
    file: BAD_INPUT for a file that cannot be read as YAML (missing, not UTF-8 text, bad YAML),
    CHECK_FAILED for a config with bad fields. One rule for check, render and precompile."""
    try:
        raw = read_yaml(path)
    except ConfigError as e:
        for p in e.problems:
            print(f"{path}: {p}", file=sys.stderr)
        return None, BAD_INPUT
    cfg, problems = check_config(raw, path)
    if problems:
        for p in problems:
            print(f"{path}: {p}", file=sys.stderr)
        if summary:
            print(f"{path}: {len(problems)} problem(s)", file=sys.stderr)
        return None, CHECK_FAILED
    return cfg, 0


def _cmd_check(args) -> int:
    worst = 0
    for path in _config_files(args.files):   # every file, whatever the ones before it held
        cfg, code = _load_or_report(path, summary=True)
        worst = max(worst, code)
        if cfg is not None:
            print(f"OK {path}: {cfg.summary()}")
    return worst


def _cmd_render(args) -> int:
    from .render import compose_for, render_command, render_json

    files = _config_files(args.files)
    loaded = [_load_or_report(f) for f in files]
    worst = max(code for _, code in loaded)
    if worst:
        return worst
    configs = [cfg for cfg, _ in loaded]
    if args.format == "compose":
        print(compose_for(configs, files), end="")
        return 0
    if len(configs) != 1:
        raise ValueError(f"--format {args.format} renders one config, got {len(configs)} files")
    cfg = configs[0]
    if args.format == "json":
        print(render_json(cfg))
    elif args.format == "argv":
        cmd = render_command(cfg)
        for k, v in sorted(cmd.env.items()):
            print(f"env {k}={v}")
        print("\n".join(cmd.argv))
    else:
        print(render_command(cfg).shell())
    return 0


# --------------------------------------------------------------------------- precompile


def _cmd_precompile(args) -> int:
    from . import precompile as pc
    from . import ready

    requests: list[pc.HeadRequest] = []
    if args.config:
        loaded = [_load_or_report(path) for path in _config_files(args.config, "--config")]
        worst = max(code for _, code in loaded)
        if worst:
            return worst
        configs = [cfg for cfg, _ in loaded]
        if args.engine:
            configs, code = _configs_for_engine(configs, args.engine)
            if code:
                return code
        requests += pc.requests_from_configs(configs, args.arch)
    for hk, hv in args.heads or []:
        requests.append(pc.HeadRequest(hk, hv, args.arch or TARGETS, source=f"--heads {hk}/{hv}"))

    modules, problems = pc.discover_modules()
    jobs, more = pc.enumerate_jobs(requests, modules, args.match)
    problems += more
    for r in requests:
        print(f"heads {r.heads} for {r.source}: targets {','.join(r.targets)}"
              + (f", state {r.state_dtype}, io {r.io_dtype}" if r.state_dtype else ""))
    mods = ", ".join(f"{m.name} ({'/'.join(m.targets)})" for m in modules)
    print(f"kernel modules: {mods or 'none'}")
    if args.list:
        for j in jobs:
            print(f"{j.target} {j.module} {j.name}")
        print(f"{len(jobs)} kernel variant builds")
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 1 if problems else 0
    if not jobs and not problems:
        problems.append("nothing to compile (check --match and the kernel modules)")

    def log_line(o, _n=[0]):
        # Without a progress bar (build logs, CI), one line per build instead.
        _n[0] += 1
        extra = f" {o.error}" if o.error else ""
        print(f"[{_n[0]}/{len(jobs)}] {o.status:<8} {o.seconds:6.1f} s  {o.job.target} {o.job.name}{extra}",
              flush=True)

    workers = pc.auto_jobs() if args.jobs == "auto" else args.jobs
    outcomes, summary = pc.run_jobs(jobs, modules, progress=not args.no_progress, workers=workers,
                                    on_outcome=log_line if args.no_progress else None)
    summary.problems = problems + summary.problems
    print(summary.text())
    memo = _build_host_memo()
    # the engines' start-up skips its check of a set marked complete (deploy/ready.py); with
    # --match only part of a set is built, and no set is marked
    markers = [] if args.match else ready.mark_built_sets(requests, modules, outcomes, summary.cache_dir)
    if markers:
        print(f"marked {len(markers)} start-up kernel sets complete ({ready.READY_DIR}/ in the cache)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(pc.summary_json(outcomes, summary))
    if args.pack:
        n, size = pc.pack_entries(outcomes, args.pack, summary.cache_dir, extra=([memo] if memo else []) + markers)
        print(f"packed {n} cache entries{' and the TMA descriptor memo' if memo else ''} "
              f"({size / 2**20:.1f} MiB) into {args.pack}: "
              f"tar -xf {args.pack} -C DIR, then TILELANG_CACHE_DIR=DIR"
              + ("" if summary.ok else " (failed builds left out)"))
    return 0 if summary.ok else 1


def _build_host_memo():
    """The TMA descriptor memo's library (kernels/hopper/host_cache.py) beside the kernels, so a
    packed or baked cache carries it; its path, or None (said why: the kernels still work)."""
    from qla_serve.kernels.hopper import host_cache

    if not host_cache.enabled_by_env():
        print(f"host: TMA descriptor memo not built ({host_cache.ENV}=0)")
        return None
    try:
        path = host_cache.build()
    except (OSError, RuntimeError) as e:
        print(f"host: TMA descriptor memo not built (kernels encode their descriptors per launch): {e}")
        return None
    print(f"host: TMA descriptor memo {path}")
    return str(path)


def _parse_jobs(text: str):
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None


def _configs_for_engine(configs, engine: str):
    """(the configs served by ``engine``, exit code): an image for one engine compiles only its
    own deployments' kernels. None of them left is an error (exit 2), not an empty build."""
    kept = [c for c in configs if c.engine.name == engine]
    for c in configs:
        if c.engine.name != engine:
            print(f"skipped config {c.name}: engine {c.engine.name}, not {engine}")
    if not kept:
        print(f"qla-serve precompile: error: --engine {engine}: none of the {len(configs)} config(s) "
              f"is for {engine}", file=sys.stderr)
        return [], 2
    return kept, 0


# --------------------------------------------------------------------------- registration


def add_cli_commands(subparsers) -> None:
    """Register ``config`` (check, render) and ``precompile`` on `qla-serve`'s subparsers.

    Handlers are set as ``fn`` (``args.fn(args) -> int``), as qla_serve/cli.py dispatches.
    """
    cfg = subparsers.add_parser("config", help="validate or render a deployment config (configs/deploy/)")
    csub = cfg.add_subparsers(dest="config_command", required=True)
    ch = csub.add_parser("check", help="report every bad field of one or more configs")
    ch.add_argument("files", nargs="+", metavar="FILE", help="YAML file(s) or a directory of them")
    ch.set_defaults(fn=_cmd_check)
    re_ = csub.add_parser("render", help="print the exact engine command for a config")
    re_.add_argument("files", nargs="+", metavar="FILE",
                     help="one config; several (or a directory) with --format compose")
    re_.add_argument("--format", choices=("shell", "argv", "json", "compose"), default="shell",
                     help="shell: one line with its env vars; argv: one token per line; json; "
                          "compose: a docker compose file, one service per config")
    re_.set_defaults(fn=_cmd_render)

    pc = subparsers.add_parser(
        "precompile", help="compile every kernel variant a deployment needs into TileLang's cache (no GPU)")
    src = pc.add_argument_group("what to compile (one or both)")
    src.add_argument("--config", action="append", metavar="FILE|DIR",
                     help="deployment config(s); its TP-local heads, dtypes and targets")
    # extend: a repeated --heads adds its pairs (argparse's default would keep the last only)
    src.add_argument("--heads", type=parse_heads, nargs="+", action="extend", metavar="HK/HV",
                     help="TP-local QK/V head counts, e.g. 2/8 (all dtypes); several, or repeated")
    pc.add_argument("--arch", type=_parse_arch, default=None,
                    help="comma list of targets (default: the config's, else sm_90a,sm_100a)")
    pc.add_argument("--engine", choices=ENGINES, default=None,
                    help="with --config: only the configs for this engine (an engine's image)")
    pc.add_argument("--match", default=None, metavar="REGEX", help="only variants whose name matches")
    pc.add_argument("--list", action="store_true", help="list the variant builds, compile nothing")
    pc.add_argument("--json", default=None, metavar="OUT", help="also write the summary as JSON")
    pc.add_argument("--pack", type=_pack_path, default=None, metavar="OUT.tar.xz",
                    help="also write the cache entries these builds use (hits included) to a tar "
                         "(.tar.xz, .tar.gz, .tar), relative to the cache: untar it into an empty "
                         "TILELANG_CACHE_DIR on another machine")
    pc.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    pc.add_argument("--jobs", "-j", type=_parse_jobs, default="auto", metavar="N",
                    help="build N variants at once in separate processes (default auto: half the "
                         "CPUs, at most 8; ~1 GB of memory each)")
    pc.set_defaults(fn=_precompile_entry(pc))


def _precompile_entry(parser: argparse.ArgumentParser):
    def run(args) -> int:
        if not args.config and not args.heads:
            parser.print_usage(sys.stderr)
            print("qla-serve precompile: error: give --config FILE or --heads HK/HV", file=sys.stderr)
            return 2
        if args.engine and not args.config:
            parser.print_usage(sys.stderr)
            print("qla-serve precompile: error: --engine selects among --config files", file=sys.stderr)
            return 2
        return _cmd_precompile(args)
    return run


def build_parser() -> argparse.ArgumentParser:
    """A parser with just the deployment commands (``python -m qla_serve.deploy``)."""
    p = argparse.ArgumentParser(prog="qla-serve", description="qla_serve deployment commands")
    sub = p.add_subparsers(dest="command", required=True)
    add_cli_commands(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (ValueError, TypeError) as e:
        print(f"qla-serve {args.command}: error: {e}", file=sys.stderr)
        return 2
