#!/usr/bin/env bash
# Create or update .venv-sglang (repo root): SGLang 0.5.23 on CPU torch, for qla_serve's SGLang
# backend tests (tests/backends/sglang_plugin). No model runs here (SGLang's CPU engine needs sgl_kernel
# CPU ops that no PyPI wheel has); the plugin, flags, backend, pool and GDN test kit all import.
#
#   torch==2.13.0 (CPU; a local wheel where the machine has one) FIRST
#   -> sglang==0.5.23 --no-deps (its metadata pins torch 2.14.1 and CUDA wheels: never resolve it)
#   -> the packages its import path needs, pinned, --no-deps (so nothing can pull a CUDA torch)
#   -> make PyPI's (CUDA) torchvision importable on CPU torch (sglang imports it unconditionally)
#   -> pip install -e . --no-deps (qla_serve) + its deps + pytest -> import check.
#
# Idempotent (a second run only checks, ~15 s), quiet (pip output goes to a log printed only when
# a step fails), fails loudly (set -e, and a final import of SGLang's GDN backend and the plugin).
# Env: SGLANG_VENV (default <repo>/.venv-sglang), PYTHON (default python3).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SGLANG_VENV:-$repo/.venv-sglang}"
TORCH_VERSION=2.13.0
SGLANG_VERSION=0.5.23

# What `import sglang.srt.server_args / ...linear.gdn_backend / ...model_runner` and the GDN test
# kit import on a CPU machine, found by importing them in a bare venv. Versions: SGLang's own pins
# where it has them (transformers, tokenizers range, openai, compressed-tensors, tvm-ffi), else
# the versions this was checked with. All --no-deps.
SGLANG_IMPORT_DEPS=(
  "numpy==2.4.6" "orjson==3.13.0" "psutil==7.2.2" "pybase64==1.5.1" "requests==2.34.2"
  "urllib3==2.8.0" "idna==3.20" "certifi==2026.10.19.post1" "charset-normalizer"
  "triton==3.9.0" "packaging==26.4" "pillow==13.0.0" "starlette==1.10.0" "anyio==4.16.0"
  "sniffio==1.3.1" "msgspec==0.23.0" "pydantic==2.14.4" "pydantic_core==2.50.5"
  "typing-inspection==0.4.5" "annotated-types==0.8.0" "pyzmq==27.3.0" "tqdm==4.70.1"
  "ipython==9.18.1" "traitlets==5.16.1" "Pygments==2.21.0" "aiohttp==3.14.5" "multidict==7.2.1"
  "attrs==26.1.0" "yarl==1.25.1" "propcache==0.5.4" "aiohappyeyeballs==2.7.1" "aiosignal==1.4.0"
  "frozenlist==1.8.0" "transformers==5.19.0" "tokenizers==0.23.3" "safetensors==0.8.0"
  "huggingface_hub==2.4.0" "hf-xet==1.8.0" "httpx2==2.16.2" "httpcore2==2.16.2" "httpx==0.28.1"
  "h11==0.16.0" "truststore==0.10.5" "regex==2026.11.19" "PyYAML==6.0.4" "typer==0.29.2"
  "click==8.5.1" "rich==15.0.0" "markdown-it-py==4.3.0" "mdurl==0.1.2" "shellingham==1.5.4"
  "annotated-doc==0.0.7" "dill==0.4.1" "sentencepiece==0.2.3" "apache-tvm-ffi==0.1.11"
  "einops==0.8.2" "compressed-tensors==0.18.0" "loguru==0.7.3" "gguf==0.19.0" "openai==2.8.0"
  "distro==1.9.0" "jiter" "partial-json-parser==0.2.1.1.post7" "uvicorn==0.54.0"
  "fastapi==0.165.0" "opentelemetry-api==1.45.2" "importlib-metadata" "zipp" "torchvision==0.29.1"
)
# qla_serve itself (pyproject dependencies; torch is already there) and the test runner.
QLA_DEPS=(
  "tilelang==0.1.12" "cloudpickle" "ml-dtypes" "torch-c-dlpack-ext" "z3-solver"
  "pytest" "iniconfig" "pluggy" "hypothesis" "sortedcontainers"
)

name=setup_sglang_env
source "$repo/scripts/venv_lib.sh"

# 1. torch first (venv_lib.sh).
install_cpu_torch
# 2. SGLang without its dependency list (it pins torch==2.14.1, flashinfer, sgl-kernel, CUDA wheels).
if ! have sglang "$SGLANG_VERSION"; then
  say "installing sglang==$SGLANG_VERSION --no-deps"
  pipi --no-deps "sglang==$SGLANG_VERSION"
fi
# 3. Import-time packages, only when one is missing (a plain check is much faster than pip).
missing=$("$py" - "${SGLANG_IMPORT_DEPS[@]}" "${QLA_DEPS[@]}" <<'PY'
import sys, re, importlib.metadata as md
out = []
for spec in sys.argv[1:]:
    name, _, ver = spec.partition("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        out.append(spec); continue
    if ver and have.split("+")[0] != ver:
        out.append(spec)
print(" ".join(out))
PY
)
if [[ -n "$missing" ]]; then
  say "installing $(wc -w <<<"$missing") import-time packages (--no-deps)"
  # shellcheck disable=SC2086
  pipi -q --no-deps $missing
fi
"$py" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') and not torch.version.cuda else 1)" \
  || fail "torch is not the CPU build $TORCH_VERSION (something pulled another torch)"

# 4. PyPI's torchvision (a CUDA build) must import on CPU torch.
patch_torchvision_for_cpu_torch

# 5. qla_serve, editable, without deps (they are above; torch must stay the CPU build).
pipi -q -e "$repo" --no-deps
say "checking imports"
"$py" - <<'PY' >>"$log" 2>&1 || fail "import check"
import importlib.metadata as md
import warnings
warnings.simplefilter("ignore")
import sglang
import sglang.srt.server_args  # noqa: F401
import sglang.srt.layers.attention.linear.gdn_backend  # noqa: F401
import sglang.srt.model_executor.model_runner  # noqa: F401
import sglang.test.kits.attention_unittest.attention_methods.gdn_attention  # noqa: F401
import qla_serve
from qla_serve.backends.sglang import register  # noqa: F401
eps = [e.value for e in md.entry_points(group="sglang.srt.plugins")]
print(f"[setup_sglang_env] sglang {sglang.__version__}, torch {md.version('torch')}, "
      f"qla_serve {qla_serve.__version__}, sglang.srt.plugins: {eps or 'NONE (pyproject entry point missing)'}")
PY
tail -n 1 "$log"
rm -f "$log"
say "ready: $venv"
