#!/usr/bin/env bash
# The demo without an engine, on a fresh machine: set up .venv, then run prefill + decode on the best path
# (TileLang kernels on Hopper, the torch reference on a CPU machine), checked against float64.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then "$py" -m venv .venv; fi
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
# The kernels are built and tested with what vLLM 0.33 / SGLang 0.5.23 pin (pyproject allows <0.2).
.venv/bin/pip install -q --disable-pip-version-check tilelang==0.1.12 apache-tvm-ffi==0.1.11
.venv/bin/pip install -q --disable-pip-version-check -e .
.venv/bin/qla-serve info
.venv/bin/qla-serve demo "$@"
