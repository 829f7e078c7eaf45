#!/usr/bin/env bash
# Builds .vllmops/: vLLM 0.33.0's own pure-Triton GDN ops, taken unmodified from the released
# wheel, for a benchmark on a GPU machine that has torch + triton + numpy but no vLLM (and must not
# load vLLM's compiled extension). No vLLM code is committed to this repo: everything lands in the
# git-ignored .vllmops/ (.gitignore).
#
#   bash benchmarks/make_vllm_ops_bundle.sh           # from the repo root
#   VLLM_WHEEL=/path/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl bash benchmarks/make_vllm_ops_bundle.sh
#
# Without VLLM_WHEEL the wheel is fetched with `python3 -m pip download vllm==0.33.0 --no-deps
# --only-binary=:all:` into .vllmops/wheel/ (no install, never torch).
#
# Output:
#   .vllmops/site/          vllm/... : the import closure of
#                             vllm.model_executor.layers.mamba.ops.causal_conv1d
#                               (causal_conv1d_fn, causal_conv1d_update)
#                             vllm.third_party.flash_linear_attention.ops
#                               (fused_post_conv_prep, fused_recurrent_gated_delta_rule_packed_decode,
#                                ops.chunk.l2norm_fwd, and the rest of that package's __init__)
#                           copied byte for byte from the wheel (checked against its RECORD), plus
#                           small stubs, each headed "qla_serve stub", for the vllm modules those files
#                           import that would pull in the rest of vLLM or its extension.
#   .vllmops/fallback/      einops stub, put on PYTHONPATH by activate.sh only where no einops exists.
#   .vllmops/vllmops.tar.xz site/ + fallback/
#   .vllmops/activate.sh    `source .vllmops/activate.sh` on the GPU machine, from the repo root:
#                           unpacks the tarball once into /tmp/vllmops, prepends /tmp/vllmops/site to
#                           PYTHONPATH, sets VLLM_OPS_BUNDLE_READY=1 only if the ops import.
# Carry .vllmops/vllmops.tar.xz and .vllmops/activate.sh to the device machine.
# On the GPU machine: `python benchmarks/vllm_ops_smoke.py` checks the ops against torch references.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/ops_bundle_lib.sh"

VERSION=0.33.0
WHEEL_NAME="vllm-${VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
OUTDIR=.vllmops

# ---------------------------------------------------------------- 1. the wheel
find_wheel vllm "$VERSION" "$WHEEL_NAME" "$OUTDIR" "${VLLM_WHEEL:-}" \
  --platform manylinux_2_28_x86_64
wheel=$WHEEL

rm -rf "$OUTDIR/site" "$OUTDIR/fallback" "$OUTDIR/vllmops.tar.xz" "$OUTDIR/activate.sh"
mkdir -p "$OUTDIR/site" "$OUTDIR/fallback"

# ---------------------------------------------------------------- 2. extract the closure
# Import-time closure of the two target modules (module-level imports, followed by hand from
# vLLM 0.33.0's source; lazy imports inside functions are reached only on ROCm/CPU/warmup paths).
# Every vllm module imported at import time is either here or stubbed in step 3.
FLA=vllm/third_party/flash_linear_attention
EXTRACT=(
  vllm/envs.py                                    # stdlib-only at import; read by gpu_sync_debug, jit_warmup_triton_helper
  vllm/utils/__init__.py                          # uuid + torch only
  vllm/utils/math_utils.py                        # stdlib only
  vllm/utils/gpu_sync_debug.py                    # imported by fla ops/index.py (envs, platforms)
  vllm/v1/__init__.py                             # empty package files
  vllm/v1/attention/__init__.py
  vllm/v1/attention/backends/__init__.py
  vllm/model_executor/layers/__init__.py
  vllm/model_executor/layers/mamba/__init__.py
  vllm/model_executor/layers/mamba/ops/__init__.py
  vllm/model_executor/layers/mamba/ops/causal_conv1d.py
  vllm/model_executor/warmup/__init__.py
  vllm/model_executor/warmup/jit_warmup.py        # stdlib only; imported by fla ops/layernorm_guard.py
  vllm/model_executor/warmup/jit_warmup_triton_helper.py  # ditto (envs, platforms, triton_utils)
  vllm/third_party/__init__.py
  $FLA/__init__.py
  $FLA/LICENSE
  $FLA/ops/__init__.py                            # imports chunk, fused_gdn_prefill_post_conv,
  $FLA/ops/chunk.py                               #   fused_recurrent, fused_sigmoid_gating,
  $FLA/ops/chunk_delta_h.py                       #   layernorm_guard and what they import
  $FLA/ops/chunk_o.py
  $FLA/ops/chunk_scaled_dot_kkt.py
  $FLA/ops/cumsum.py
  $FLA/ops/fused_gdn_prefill_post_conv.py
  $FLA/ops/fused_recurrent.py
  $FLA/ops/fused_sigmoid_gating.py
  $FLA/ops/index.py
  $FLA/ops/l2norm.py
  $FLA/ops/layernorm_guard.py
  $FLA/ops/op.py
  $FLA/ops/solve_tril.py
  $FLA/ops/utils.py
  $FLA/ops/wy_fast.py
)
extract_from_wheel "$wheel" "$OUTDIR/site" vllm "$VERSION" "${EXTRACT[@]}"

# ---------------------------------------------------------------- 3. stubs
S=$OUTDIR/site/vllm
mkdir -p "$S/platforms" "$S/triton_utils" "$S/v1/attention/backends" "$S/utils"

cat > "$S/__init__.py" <<'EOF'
# qla_serve stub, not vLLM code: stands in for vllm/__init__.py of vLLM 0.33.0.
# Why: the real one imports vllm.env_override (torch/inductor patches, vllm.logger, vllm.config)
# and lazily the engine; the bundled GDN ops need only the package to exist.
# Not replicated from env_override: it sets TRITON_CACHE_AUTOTUNING=1 (setdefault), which only
# affects on-disk caching of autotune results.
__version__ = "0.33.0"
EOF

cat > "$S/model_executor/__init__.py" <<'EOF'
# qla_serve stub, not vLLM code: stands in for vllm/model_executor/__init__.py of vLLM 0.33.0.
# Why: the real one imports vllm.model_executor.parameter (distributed, quantization, ...); the
# bundled ops only need the package to exist so its subpackages can be imported.
EOF

cat > "$S/platforms/__init__.py" <<'EOF'
# qla_serve stub, not vLLM code: stands in for vllm/platforms/__init__.py of vLLM 0.33.0.
# Why: the real module detects the platform through NVML/amdsmi and imports vllm.platforms.cuda,
# which pulls in vllm.config, the logger and the compiled extension. Here `current_platform` is
# resolved the CUDA way (what vLLM picks on an NVIDIA GPU: CudaPlatformBase in
# vllm/platforms/cuda.py), with only the members the bundled files use:
#   is_cpu()              causal_conv1d.py module level (CPU fallback switch) -> False
#   is_rocm()             fla ops/chunk_scaled_dot_kkt.py module level -> False
#   is_cuda_alike()       fla ops/utils.py, utils/gpu_sync_debug.py module level -> True
#   is_cuda(), is_device_capability_family()  fused_recurrent_gated_delta_rule_packed_decode
#                         (SM10x block-size choice)
#   is_arch_support_pdl() launch_pdl of causal_conv1d_fn / causal_conv1d_update
#   device_type, num_compute_units(), is_pin_memory_available()  warmup helper and the
#                         utils.platform_utils / utils.torch_utils stubs
# Device capability comes from torch.cuda (vLLM's NonNvmlCudaPlatform way) instead of NVML; the
# two agree outside MIG/odd visibility setups.
import functools
from typing import NamedTuple

import torch


class DeviceCapability(NamedTuple):  # as vllm/platforms/interface.py
    major: int
    minor: int

    def to_int(self) -> int:
        assert 0 <= self.minor < 10
        return self.major * 10 + self.minor


class _CudaPlatform:
    device_name = "cuda"
    device_type = "cuda"

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False

    def is_cuda_alike(self) -> bool:
        return True

    @staticmethod
    @functools.cache
    def get_device_capability(device_id: int = 0) -> DeviceCapability:
        major, minor = torch.cuda.get_device_capability(device_id)
        return DeviceCapability(major=major, minor=minor)

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        # interface.py Platform.is_device_capability_family
        return (self.get_device_capability(device_id).to_int() // 10) == (capability // 10)

    @staticmethod
    @functools.cache
    def is_arch_support_pdl() -> bool:
        # cuda.py CudaPlatformBase.is_arch_support_pdl, verbatim logic
        try:
            device = torch.cuda.current_device()
            major, _ = torch.cuda.get_device_capability(device)
        except Exception:
            return False
        return major >= 9

    def num_compute_units(self, device_id: int = 0) -> int:
        return torch.cuda.get_device_properties(device_id).multi_processor_count

    def is_pin_memory_available(self) -> bool:
        # CudaPlatformBase returns True except under WSL, which the GPU machine is not.
        return True


current_platform = _CudaPlatform()
EOF

cat > "$S/triton_utils/__init__.py" <<'EOF'
# qla_serve stub, not vLLM code: stands in for vllm/triton_utils/__init__.py of vLLM 0.33.0.
# Why: the real one goes through vllm.triton_utils.importing (vllm.logger, the full
# vllm.platforms) to decide HAS_TRITON and falls back to placeholders; on the GPU machine it
# resolves to the real triton, which is what this exports. Only the names the bundled files
# import: tl, tldevice, triton, HAS_TRITON.
import os

import triton
import triton.language as tl
import triton.language.extra.libdevice as tldevice

HAS_TRITON = True

# The real module installs a first-config autotune patch when this is set (default off); the stub
# does not carry that patch, so refuse rather than silently autotune.
if os.environ.get("VLLM_TRITON_FORCE_FIRST_CONFIG", "0").strip().lower() in ("1", "true"):
    raise ImportError("VLLM_TRITON_FORCE_FIRST_CONFIG is not supported by the qla_serve stub")
EOF

# Values taken verbatim from the wheel, not typed in here.
pad_slot=$(python3 - "$wheel" <<'PY'
import re, sys, zipfile
src = zipfile.ZipFile(sys.argv[1]).read("vllm/v1/attention/backends/utils.py").decode()
for name in ("PAD_SLOT_ID", "NULL_BLOCK_ID"):
    m = re.findall(rf"^{name} = (-?\d+)$", src, re.M)
    if len(m) != 1:
        sys.exit(f"{name}: expected one module-level assignment, found {m}")
    print(f"{name} = {m[0]}")
PY
)
{
  cat <<'EOF'
# qla_serve stub, not vLLM code: stands in for vllm/v1/attention/backends/utils.py of vLLM 0.33.0.
# Why: causal_conv1d.py imports only NULL_BLOCK_ID and PAD_SLOT_ID from it, but the real module
# imports vllm.config, the KV-cache interface, distributed KV transfer, etc.
# The two values below were copied from the wheel's module by benchmarks/make_vllm_ops_bundle.sh.
EOF
  echo "$pad_slot"
} > "$S/v1/attention/backends/utils.py"

cat > "$S/utils/platform_utils.py" <<'EOF'
# qla_serve stub, not vLLM code: stands in for vllm/utils/platform_utils.py of vLLM 0.33.0.
# Why: the real module imports the third-party `regex` package at import time (for a function the
# ops never call). fla ops/layernorm_guard.py imports num_compute_units from it; that function is
# copied verbatim.
from functools import cache


@cache
def num_compute_units(device_id: int = 0) -> int:
    """Get the number of compute units of the current device."""
    from vllm.platforms import current_platform

    return current_platform.num_compute_units(device_id)
EOF

python3 - "$wheel" "$S/utils/torch_utils.py" <<'PY'
# Copies async_tensor_h2d verbatim out of the wheel's vllm/utils/torch_utils.py.
import ast, sys, zipfile
src = zipfile.ZipFile(sys.argv[1]).read("vllm/utils/torch_utils.py").decode()
fn = next(n for n in ast.parse(src).body
          if isinstance(n, ast.FunctionDef) and n.name == "async_tensor_h2d")
body = "\n".join(src.splitlines()[fn.lineno - 1:fn.end_lineno])
header = '''# qla_serve stub, not vLLM code: stands in for vllm/utils/torch_utils.py of vLLM 0.33.0.
# Why: the real module (1000+ lines) imports vllm.logger, vllm.utils.torch_version (packaging) and
# vllm.utils.platform_utils (regex). fla ops/index.py imports only async_tensor_h2d (used by
# prepare_chunk_indices on the chunked-prefill path); it is copied verbatim from the wheel below,
# with PIN_MEMORY defined as the real module does (PIN_MEMORY = is_pin_memory_available()).
import numpy as np
import torch

from vllm.platforms import current_platform

PIN_MEMORY = current_platform.is_pin_memory_available()


'''
open(sys.argv[2], "w").write(header + body + "\n")
PY

mkdir -p "$OUTDIR/fallback/einops"
cat > "$OUTDIR/fallback/einops/__init__.py" <<'EOF'
# qla_serve stub, not einops: activate.sh puts this folder on PYTHONPATH only when `import einops`
# fails. Why: vLLM's flash_linear_attention/ops/layernorm_guard.py (imported by ops/__init__.py)
# does `from einops import rearrange` at import time, but uses it only in rms_norm_ref, a reference
# path none of the bundled GDN ops call.
def rearrange(*args, **kwargs):
    raise NotImplementedError("qla_serve einops stub: install einops to use rearrange")
EOF

# Manifest: what is vLLM's (byte for byte) and what is ours.
write_manifest "$OUTDIR" vllm "vLLM $VERSION GDN ops" \
  "fallback/einops/__init__.py (only without a real einops)" "${EXTRACT[@]}"

# ---------------------------------------------------------------- 4. pack + activate.sh
pack_bundle "$OUTDIR" vllmops
write_activate "$OUTDIR" vllmops VLLM_OPS_BUNDLE_READY einops \
  "vllm.model_executor.layers.mamba.ops.causal_conv1d, vllm.third_party.flash_linear_attention.ops" \
  vLLM "vLLM $VERSION GDN ops without vLLM installed"

# ---------------------------------------------------------------- 5. report
n_ext=${#EXTRACT[@]}
n_stub=$(cd "$OUTDIR/site" && grep -rl --include="*.py" "^# qla_serve stub" vllm | wc -l)
echo "bundle: $OUTDIR/vllmops.tar.xz $(stat -c %s "$OUTDIR/vllmops.tar.xz") bytes" \
  "($(du -sh "$OUTDIR/vllmops.tar.xz" | cut -f1)); $OUTDIR/site $(du -sh "$OUTDIR/site" | cut -f1) unpacked;" \
  "$((n_ext + 1)) files from the wheel, $n_stub vllm stubs + einops fallback"
echo "activate: source $OUTDIR/activate.sh   (carry $OUTDIR/vllmops.tar.xz and $OUTDIR/activate.sh)"
