#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, then run the demo on the best available path
# (TileLang kernels on Hopper, the torch reference on a CPU machine), checked against float64.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then "$py" -m venv .venv; fi
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e .
.venv/bin/qla-serve info
.venv/bin/qla-serve demo "$@"
