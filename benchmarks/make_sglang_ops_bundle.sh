#!/usr/bin/env bash
# Builds .sglops/: SGLang 0.5.23's own pure-Triton ops for a Qwen3-Next / Qwen3.5 GatedDeltaNet
# DECODE step (projection outputs -> conv state update -> the kernel backend's decode), taken
# unmodified from the released wheel, for a benchmark on a GPU machine that has torch + triton +
# numpy but no SGLang and no sgl_kernel (nothing of sgl_kernel, and none of SGLang's JIT CUDA / tvm-ffi
# ops, is bundled). No SGLang code is committed to this repo: everything lands in the git-ignored
# .sglops/.
#
#   bash benchmarks/make_sglang_ops_bundle.sh           # from the repo root
#   SGLANG_WHEEL=/path/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl bash benchmarks/make_sglang_ops_bundle.sh
#
# Without SGLANG_WHEEL the wheel is fetched with `python3 -m pip download sglang==0.5.23 --no-deps
# --only-binary=:all:` (pinned to the cp311 manylinux_2_34 build) into .sglops/wheel/ (no install,
# never torch). Only pure-Python files are taken from it, so the GPU machine's Python version does
# not have to be 3.11.
#
# Output:
#   .sglops/site/           sglang/... : the import closure of
#                             sglang.kernels.ops.attention.triton_gdn_fused_proj
#                               (fused_qkvzba_split_reshape_cat          Qwen3-Next decode split,
#                                fused_qkvzba_split_reshape_cat_contiguous Qwen3.5 split,
#                                fused_qkvzba_causal_conv1d_update_contiguous
#                                                                        Qwen3.5 decode split+conv,
#                                qwen3_5_gdn_prefill_projection_views, fused_qkv_split_gdn_prefill)
#                             sglang.kernels.ops.mamba.causal_conv1d_triton
#                               (causal_conv1d_update: the decode conv; causal_conv1d_fn: the
#                                prefill conv GDN runs on CUDA)
#                             sglang.kernels.ops.attention.fla.fused_recurrent
#                               (fused_recurrent_gated_delta_rule_packed_decode: what the default
#                                --linear-attn-backend triton runs as decode(), gating fused in)
#                             sglang.kernels.ops.attention.linear.fused_gdn_gating
#                               (fused_gdn_gating: SGLang's separate g/beta kernel, extend path)
#                           copied byte for byte from the wheel (checked against its RECORD), plus
#                           small stubs, each headed "qla_serve stub", for the sglang modules those
#                           files import that would pull in the rest of SGLang, its kernel registry
#                           (tvm-ffi JIT) or sgl_kernel.
#   .sglops/fallback/       packaging stub, put on PYTHONPATH by activate.sh only where no packaging exists.
#   .sglops/sglops.tar.xz   site/ + fallback/
#   .sglops/activate.sh     `source .sglops/activate.sh` on the GPU machine, from the repo root:
#                           unpacks the tarball once into /tmp/sglops, prepends /tmp/sglops/site to
#                           PYTHONPATH, sets SGLANG_OPS_BUNDLE_READY=1 only if the ops import.
# Carry .sglops/sglops.tar.xz and .sglops/activate.sh to the device machine.
# On the GPU machine: `python benchmarks/sglang_ops_smoke.py` checks the ops against torch references.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/ops_bundle_lib.sh"

VERSION=0.5.23
WHEEL_NAME="sglang-${VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
OUTDIR=.sglops

# ---------------------------------------------------------------- 1. the wheel
find_wheel sglang "$VERSION" "$WHEEL_NAME" "$OUTDIR" "${SGLANG_WHEEL:-}" \
  --platform manylinux_2_34_x86_64 --python-version 3.11 --implementation cp --abi cp311
wheel=$WHEEL

rm -rf "$OUTDIR/site" "$OUTDIR/fallback" "$OUTDIR/sglops.tar.xz" "$OUTDIR/activate.sh"
mkdir -p "$OUTDIR/site" "$OUTDIR/fallback"

# ---------------------------------------------------------------- 2. extract the closure
# Import-time closure of the six target modules (module-level imports, followed by hand from
# SGLang 0.5.23's source and re-checked by step 4 below). sglang/srt, sglang/kernels/ops/attention/fla
# have no __init__.py in the wheel (namespace packages) and get none here either.
KOPS=sglang/kernels/ops
EXTRACT=(
  sglang/srt/environ.py                           # stdlib only at import; `envs` for triton_gdn_fused_proj
  sglang/kernels/jit/__init__.py                  # docstring only
  sglang/kernels/jit/utils/arch.py                # is_arch_support_pdl (PDL launch of causal_conv1d_update)
  sglang/kernels/jit/utils/common.py              # torch only; cache_once, is_hip_runtime, ... for arch.py
  $KOPS/mamba/causal_conv1d_triton.py             # causal_conv1d_update / causal_conv1d_fn (Triton)
  $KOPS/attention/triton_gdn_fused_proj.py        # the qkvz/ba split kernels, fused split + conv update
  $KOPS/attention/linear/__init__.py              # docstring only
  $KOPS/attention/linear/fused_gdn_gating.py      # triton + torch only
  $KOPS/attention/fla/fused_recurrent.py          # packed decode (the Triton backend's decode)
  $KOPS/attention/fla/l2norm.py                   # gdn_prefill_qkv_prepare_fwd (FlashInfer extend's q/k norm)
  $KOPS/attention/linear/fused_sigmoid_gating_recurrent.py   # its Triton backend's target_verify kernel
  $KOPS/attention/fla/op.py
  $KOPS/attention/fla/utils.py                    # imports packaging (fallback below) and torch_release
)
extract_from_wheel "$wheel" "$OUTDIR/site" sglang "$VERSION" "${EXTRACT[@]}"

# ---------------------------------------------------------------- 3. stubs
S=$OUTDIR/site/sglang
mkdir -p "$S/srt/utils" "$S/kernels/ops/attention" "$S/kernels/ops/mamba" "$S/kernels/jit/utils"

cat > "$S/__init__.py" <<'EOF'
# qla_serve stub, not SGLang code: stands in for sglang/__init__.py of SGLang 0.5.23.
# Why: the real one imports sglang.srt.environ, HF transformers patches, the sglang.lang frontend
# (api, runtime endpoint, choices, global config); the bundled ops need only the package to exist.
__version__ = "0.5.23"
EOF

cat > "$S/kernels/__init__.py" <<'EOF'
# qla_serve stub, not SGLang code: stands in for sglang/kernels/__init__.py of SGLang 0.5.23.
# Why: the real one imports the kernel registry / selector / fused_op machinery and then
# sglang.kernels.ops, which imports every op group (activation, gemm, moe, ... and their JIT /
# sgl_kernel backends); the bundled ops only need the package to exist.
EOF

cat > "$S/kernels/ops/__init__.py" <<'EOF'
# qla_serve stub, not SGLang code: stands in for sglang/kernels/ops/__init__.py of SGLang 0.5.23.
# Why: the real one import_module()s every op group to fill the kernel registry; the bundled ops
# are imported by their module paths and need only the package to exist.
EOF

cat > "$S/kernels/ops/attention/__init__.py" <<'EOF'
# qla_serve stub, not SGLang code: stands in for sglang/kernels/ops/attention/__init__.py of
# SGLang 0.5.23. Why: the real one registers ~100 attention kernels (registry, selector, JIT and
# sgl_kernel targets); the bundled modules below it are imported by path and need only the package.
EOF

cat > "$S/kernels/ops/mamba/__init__.py" <<'EOF'
# qla_serve stub, not SGLang code: stands in for sglang/kernels/ops/mamba/__init__.py of SGLang 0.5.23.
# Why: the real one registers the JIT (tvm-ffi, nvcc-built) causal_conv1d_fwd / causal_conv1d_update
# and other mamba kernels in SGLang's kernel registry and exports wrappers that resolve them through
# it. Those CUDA ops are deliberately NOT bundled (not pure Triton); only causal_conv1d_triton, the
# module GDN's decode imports directly, is. Nothing is exported here.
EOF

cat > "$S/kernels/jit/utils/__init__.py" <<'EOF'
# qla_serve stub, not SGLang code: stands in for sglang/kernels/jit/utils/__init__.py of SGLang 0.5.23.
# Why: the real one also imports sglang.kernels.jit.utils.compile (the tvm-ffi / nvcc JIT loader).
# Re-exported here, from the bundled (unmodified) arch.py and common.py, are the names the real
# module exports from those two files; causal_conv1d_triton.py imports is_arch_support_pdl.
from sglang.kernels.jit.utils.arch import (
    get_activation_cuda_cflags,
    get_jit_cuda_arch,
    is_arch_support_pdl,
    override_jit_cuda_arch,
)
from sglang.kernels.jit.utils.common import (
    aligned_new_empty,
    cache_once,
    device_guard,
    empty_sentinel,
    get_ci_test_range,
    is_hip_runtime,
    is_musa_runtime,
    lazy_register_class,
    should_run_full_tests,
)
EOF

cat > "$S/srt/utils/__init__.py" <<'EOF'
# qla_serve stub, not SGLang code: stands in for sglang/srt/utils/__init__.py of SGLang 0.5.23.
# Why: the real one star-imports sglang.srt.utils.common (3000+ lines: runtime context, platforms,
# observability, msgspec, video decoding, ...). triton_gdn_fused_proj.py imports only is_hip;
# fused_sigmoid_gating_recurrent.py get_device_sm, is_cuda, is_gfx95_supported, is_hip and
# is_sm90_supported.
from sglang.srt.utils.common import (get_cuda_version, get_device_sm, is_cuda, is_gfx95_supported,  # noqa: F401
                                     is_hip, is_sm90_supported, torch_release)
EOF

python3 - "$wheel" "$S/srt/utils/common.py" <<'PY'
# Copies is_hip, is_cuda and get_cuda_version verbatim (with their decorators) out of the wheel's
# sglang/srt/utils/common.py.
import ast, sys, zipfile
src = zipfile.ZipFile(sys.argv[1]).read("sglang/srt/utils/common.py").decode()
lines = src.splitlines()
tree = ast.parse(src)
wanted = ("is_hip", "is_cuda", "get_cuda_version", "is_gfx95_supported", "_check_cuda_device_version")
found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted}
if set(found) != set(wanted):
    sys.exit(f"sglang/srt/utils/common.py: missing {set(wanted) - set(found)}")
# torch_release must still be what the stub below computes.
if "torch_release = pkg_version.parse(torch.__version__).release" not in lines:
    sys.exit("sglang/srt/utils/common.py: torch_release is no longer pkg_version.parse(...).release")
bodies = []
for name in wanted:
    fn = found[name]
    start = min([d.lineno for d in fn.decorator_list] + [fn.lineno])
    bodies.append("\n".join(lines[start - 1:fn.end_lineno]))
header = '''# qla_serve stub, not SGLang code: stands in for sglang/srt/utils/common.py of SGLang 0.5.23.
# Why: the real module imports the runtime context, platforms, observability, msgspec, video
# decoding, ... at import time. The bundled files need: torch_release (fla/utils.py), is_cuda
# (kernels/jit/utils/arch.py), get_cuda_version (arch.py, lazily, SM12x only) and is_hip (through
# sglang.srt.utils); fused_sigmoid_gating_recurrent.py (SGLang's Triton target verify) also
# is_gfx95_supported, get_device_sm and is_sm90_supported. The five functions below the header are
# copied verbatim from the wheel by benchmarks/make_sglang_ops_bundle.sh. Written here instead:
# get_device_sm (the real one asks NVML first, then torch; both give major * 10 + minor) and
# is_sm90_supported (the real module's lru_cache(partial(_check_cuda_device_version, [9],
# (12, 3))), the same expression). torch_release: the real module computes
# `packaging.version.parse(torch.__version__).release`; here the same tuple (the leading dotted
# integers, e.g. (2, 11, 0) for 2.11.0+cu128) is parsed without `packaging`.
import re
from functools import lru_cache
from typing import List, Tuple

import torch

torch_release = tuple(int(p) for p in re.match(r"\\d+(?:\\.\\d+)*", torch.__version__).group(0).split("."))


'''
footer = '''


def get_device_sm():
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor
    return 0


is_sm90_supported = lru_cache(maxsize=1)(
    lambda: _check_cuda_device_version(device_capability_majors=[9], cuda_version=(12, 3)))
'''
open(sys.argv[2], "w").write(header + "\n\n\n".join(bodies) + footer)
PY

mkdir -p "$OUTDIR/fallback/packaging"
cat > "$OUTDIR/fallback/packaging/__init__.py" <<'EOF'
# qla_serve stub, not packaging: activate.sh puts this folder on PYTHONPATH only when
# `import packaging` fails. Why: SGLang's kernels/ops/attention/fla/utils.py (imported by
# fused_recurrent.py) does `from packaging import version` at import time, but uses it only in
# check_environments(), a version warning none of the bundled ops call.
EOF
cat > "$OUTDIR/fallback/packaging/version.py" <<'EOF'
# qla_serve stub, not packaging (see __init__.py beside it).
def parse(*args, **kwargs):
    raise NotImplementedError("qla_serve packaging stub: install packaging to use version.parse")
EOF

# Manifest: what is SGLang's (byte for byte) and what is ours.
write_manifest "$OUTDIR" sglang "SGLang $VERSION GDN decode ops" \
  "fallback/packaging/{__init__,version}.py (only without a real packaging)" "${EXTRACT[@]}"

# ---------------------------------------------------------------- 4. closure check (no triton needed)
# Every sglang.* import reached at import time must resolve inside site/; nothing may import
# sgl_kernel (or sgl_kernel_npu) at all. Imports inside functions or under a module-level `if` are
# listed, not required.
python3 - "$OUTDIR/site" <<'PY'
import ast, os, sys

site = sys.argv[1]

def resolves(mod):
    path = os.path.join(site, *mod.split("."))
    return os.path.isfile(path + ".py") or os.path.isdir(path)

def walk(node, where):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from walk(child, "lazy")
        elif isinstance(child, ast.If) and where == "top":
            yield from walk(child, "conditional")
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, where
        else:
            yield from walk(child, where)

bad, notes = [], []
for root, _, files in os.walk(os.path.join(site, "sglang")):
    for fname in sorted(files):
        if not fname.endswith(".py"):
            continue
        path = os.path.join(root, fname)
        rel = os.path.relpath(path, site)
        tree = ast.parse(open(path).read(), rel)
        for node, where in walk(tree, "top"):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif node.level:
                bad.append(f"{rel}:{node.lineno}: relative import (not expected)")
                continue
            else:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(m.split(".")[0].startswith("sgl_kernel") for m in mods):
                bad.append(f"{rel}:{node.lineno}: imports {mods[0]} ({where})")
                continue
            if not mods[0].startswith("sglang"):
                continue
            if isinstance(node, ast.ImportFrom):
                # `from X import name`: X must resolve; name may be an attribute or a submodule.
                ok = resolves(node.module)
                missing = node.module
            else:
                ok = all(resolves(m) for m in mods)
                missing = ",".join(m for m in mods if not resolves(m))
            if not ok:
                msg = f"{rel}:{node.lineno}: {missing} not bundled ({where})"
                (bad if where == "top" else notes).append(msg)
for n in notes:
    print("  note:", n)
if bad:
    print("closure check FAILED:", *bad, sep="\n  ")
    sys.exit(1)
print("closure check: every import-time sglang.* import resolves in site/; no sgl_kernel import")
PY

# ---------------------------------------------------------------- 5. pack + activate.sh
IMPORTS="sglang.kernels.ops.attention.triton_gdn_fused_proj, sglang.kernels.ops.mamba.causal_conv1d_triton"
IMPORTS+=", sglang.kernels.ops.attention.fla.fused_recurrent, sglang.kernels.ops.attention.linear.fused_gdn_gating"
IMPORTS+=", sglang.kernels.ops.attention.fla.l2norm, sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent"
pack_bundle "$OUTDIR" sglops
write_activate "$OUTDIR" sglops SGLANG_OPS_BUNDLE_READY packaging.version "$IMPORTS" \
  SGLang "SGLang $VERSION GDN decode ops without SGLang / sgl_kernel installed"

# ---------------------------------------------------------------- 6. report
n_ext=${#EXTRACT[@]}
n_stub=$(cd "$OUTDIR/site" && grep -rl --include="*.py" "^# qla_serve stub" sglang | wc -l)
echo "bundle: $OUTDIR/sglops.tar.xz $(stat -c %s "$OUTDIR/sglops.tar.xz") bytes" \
  "($(du -sh "$OUTDIR/sglops.tar.xz" | cut -f1)); $OUTDIR/site $(du -sh "$OUTDIR/site" | cut -f1) unpacked;" \
  "$((n_ext + 1)) files from the wheel, $n_stub sglang stubs + packaging fallback"
echo "activate: source $OUTDIR/activate.sh   (carry $OUTDIR/sglops.tar.xz and $OUTDIR/activate.sh)"
