"""Print the CLI options of an installed engine as JSON: {"engine", "version", "options": {flag: choices|null}}.

Run with the engine's own interpreter (it imports the engine, which the test venv lacks):

    .venv-vllm/bin/python tests/deploy/extract_engine_flags.py vllm
    .venv-sglang/bin/python tests/deploy/extract_engine_flags.py sglang

``tests/deploy/engine_flags.json`` is this script's output for the pinned engines, one
entry per engine (regenerate it with ``--update`` after an engine upgrade). The parsers
are built the way the engines build them for ``vllm serve`` and
``python -m sglang.launch_server``. vLLM loads its general plugins while building the
parser, so where qla_serve's plugin is registered (``qla_serve_plugin`` true) its
``--linear-attn-backend`` appears; the snapshot was taken without it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys


def _options(parser: argparse.ArgumentParser) -> dict:
    out = {}
    for action in parser._actions:  # argparse has no public accessor for its actions
        choices = sorted(str(c) for c in action.choices) if action.choices is not None else None
        for opt in action.option_strings:
            out[opt] = choices
    return dict(sorted(out.items()))


def vllm_parser() -> argparse.ArgumentParser:
    # vLLM moved make_arg_parser between releases; try the known homes, newest first.
    for mod in ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"):
        try:
            make_arg_parser = importlib.import_module(mod).make_arg_parser
            break
        except ImportError:
            continue
    else:
        raise RuntimeError("vllm: make_arg_parser not found")
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    if _qla_plugin_registered("sglang"):
        # launch_server loads plugins before parsing; do the same so flashqla is a choice.
        from sglang.srt.plugins import load_plugins
        load_plugins()

    p = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(p)
    return p


def extract(engine: str) -> dict:
    # PyPI's torchvision is a CUDA build that fails to import against the CPU torch of these
    # venvs (ENGINES.md), and the argument parsers never need it: hide it, so transformers
    # sees it as absent instead of crashing.
    sys.modules.setdefault("torchvision", None)
    mod = importlib.import_module(engine)
    parser = {"vllm": vllm_parser, "sglang": sglang_parser}[engine]()
    return {"engine": engine, "version": str(getattr(mod, "__version__", "?")), "options": _options(parser),
            "qla_serve_plugin": _qla_plugin_registered(engine)}


def _qla_plugin_registered(engine: str) -> bool:
    """Whether qla_serve registered its plugin entry point in this environment (vLLM loads
    general plugins while building its parser, so the plugin's flags then appear above)."""
    from importlib.metadata import entry_points

    group = {"vllm": "vllm.general_plugins", "sglang": "sglang.srt.plugins"}[engine]
    return any(ep.value.startswith("qla_serve") for ep in entry_points(group=group))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=("vllm", "sglang"))
    ap.add_argument("--update", metavar="JSON", help="merge into this snapshot file instead of printing")
    a = ap.parse_args()
    data = extract(a.engine)
    if a.update:
        snap = {}
        if os.path.exists(a.update):
            with open(a.update, encoding="utf-8") as f:
                snap = json.load(f)
        snap[a.engine] = {"version": data["version"], "options": data["options"]}
        with open(a.update, "w", encoding="utf-8") as f:
            json.dump(dict(sorted(snap.items())), f, indent=1, sort_keys=True)
            f.write("\n")
    else:
        json.dump(data, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
