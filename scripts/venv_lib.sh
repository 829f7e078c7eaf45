# Sourced by scripts/setup_{vllm,sglang}_env.sh: the shared steps of building an engine venv on a
# CPU machine. Before sourcing, set: name (log prefix), venv (its path), TORCH_VERSION.
# Defines say/fail (pip output goes to $log, printed only when a step fails), py, pipi, have,
# install_cpu_torch and patch_torchvision_for_cpu_torch; creates the venv if it is missing.
log="$(mktemp -t "$name.XXXXXX.log")"
say() { echo "[$name] $*"; }
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

# torch first, exactly this version, alone: a resolver left to pick torch on its own (for an
# engine's requirements) could reach for PyPI's multi-GB CUDA build.
install_cpu_torch() {
  if ! have torch "$TORCH_VERSION"; then
    say "installing torch==$TORCH_VERSION (CPU)"
    pipi "torch==$TORCH_VERSION"
  fi
}

# PyPI's torchvision is a CUDA build: its fake-op registrations for torchvision::nms/qnms raise
# on CPU torch, where those ops do not exist. Register them only when torchvision's native ops
# loaded (the check it uses for its other meta kernels). Rewrites one file of the venv; a no-op
# once done.
patch_torchvision_for_cpu_torch() {
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
}
