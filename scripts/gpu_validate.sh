#!/usr/bin/env bash
# One device run that checks everything a GPU can: all `gpu` tests, the demo, the precompiled
# cold start, and the host-time benchmarks. For the lent H200:
#   run(command="bash scripts/gpu_validate.sh", carry=[".devbundle/site.tar.xz", ".devbundle/activate.sh",
#       ".devbundle/stamp", ".gpucache/tlcache.tar.xz", ".gpucache/tl_tp8.tar.xz", ".gpucache/whl"])
# .gpucache/tlcache.tar.xz: a TileLang cache compiled on a GPU-less machine for sm_90a (`qla-serve
# precompile --heads 1/1 2/4 2/8 4/8 4/16 8/24 16/32 16/64 --arch sm_90a --pack
# .gpucache/tlcache.tar.xz`: every head pair the GPU tests use, prefill and decode; --pack writes
# exactly those cache entries, unpacked below into TILELANG_CACHE_DIR); .gpucache/tl_tp8.tar.xz:
# `qla-serve precompile --config <tp8 config> --pack .gpucache/tl_tp8.tar.xz` only. Give it a call of its own: the GPU tests alone ran past 300 s in the fifth
# session, when the decode variants still compiled on the device.
set -uo pipefail
out=${OUT:-/tmp/gpu_validate}; mkdir -p "$out"
mkdir -p /tmp/tlall /tmp/tl_tp8
# TLCACHE: another compiled-kernel tar to unpack instead (as in gpu_prefill.sh).
tlcache=${TLCACHE:-.gpucache/tlcache.tar.xz}
if [[ -n ${TLCACHE:-} && ! -f $tlcache ]]; then echo "TLCACHE=$tlcache: no such file (carry it)"; exit 2; fi
[[ -f $tlcache ]] && tar -xJf "$tlcache" -C /tmp/tlall
[[ -f .gpucache/tl_tp8.tar.xz ]] && tar -xJf .gpucache/tl_tp8.tar.xz -C /tmp/tl_tp8
export TILELANG_CACHE_DIR=/tmp/tlall
source .devbundle/activate.sh
# hypothesis (test_plan.py imports it) is not on the device: unpack the carried wheels. They must
# match the device's Python (3.12; a cp311 hypothesis wheel breaks pytest's collection there):
#   pip download hypothesis sortedcontainers attrs --no-deps --python-version 3.12 \
#       --only-binary=:all: -d .gpucache/whl
for w in .gpucache/whl/*.whl; do [[ -f $w ]] && python -m zipfile -e "$w" /tmp/whlsite; done
export PYTHONPATH=$PYTHONPATH:/tmp/whlsite
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step() { echo "== $1"; shift; timeout "$@"; echo "rc=$?"; }
# PRECOMPILE_HEADS: head pairs built on the device first, one process per core (as in gpu_benchmarks.sh)
# shellcheck disable=SC2086
[[ -n ${PRECOMPILE_HEADS:-} ]] && step "precompile $PRECOMPILE_HEADS on the device" 400 python -m qla_serve.cli \
  precompile --heads $PRECOMPILE_HEADS --arch sm_90a --jobs "$(nproc)" --no-progress | tail -2
step "all gpu tests" ${GPU_TEST_TIMEOUT:-480} python -m pytest -m gpu -q -rs tests -p no:cacheprovider --continue-on-collection-errors 2>&1 | tee "$out/gpu_tests.log" | tail -40
step "demo (GPU)" 60 python -m qla_serve.cli demo 2>&1 | tee "$out/demo.log"
step "cold start with the precompiled TP8 cache" 90 env TILELANG_CACHE_DIR=/tmp/tl_tp8 \
  python -m qla_serve.deploy.coldstart --config configs/deploy/qwen3.5-397b-a17b-tp8.yaml 2>&1 | tee "$out/coldstart.log"
step "host time: ops vs kernel modules" 60 python benchmarks/ops_host.py 2>&1 | tee "$out/ops_host.log"
step "host time: prefill launch by launch (raw vs adapter)" 120 python benchmarks/launch_host.py 2>&1 | tee "$out/launch_host.log"
step "host time: planner" 40 python benchmarks/plan_host.py --iters 2000 2>&1 | tee "$out/plan_host.log"
step "host time: step plan" 40 python benchmarks/step_plan_host.py --device cuda 2>&1 | tee "$out/step_plan_host.log"
# One GDN layer per engine step beside FLA's composition, FlashInfer's (when .fibundle is sourced)
# and vLLM 0.33's own ops (when .vllmops is: benchmarks/make_vllm_ops_bundle.sh; carry
# .vllmops/vllmops.tar.xz and .vllmops/activate.sh); FLA's Triton autotuning on every new shape can
# make this long: split --heads across calls.
[[ -f .vllmops/activate.sh ]] && source .vllmops/activate.sh
step "bench layer" 590 python -m qla_serve.cli bench layer --check --json "$out/layer.json" \
  --plot "$out/layer.png" 2>&1 | tee "$out/layer.log"
# SGLang 0.5.23's steps beside its own ops (when .sglops is carried: benchmarks/make_sglang_ops_bundle.sh;
# carry .sglops/sglops.tar.xz and .sglops/activate.sh; SGLang's own extend also needs .fibundle,
# in two calls: ../shared/device/README.md): decode and extend rows on its cache layout, and its
# target verify with flashqla (the plugin's takeover against SGLang's conv).
if [[ -f .sglops/activate.sh ]]; then
  source .sglops/activate.sh
  step "bench layer (SGLang)" 400 python -m qla_serve.cli bench layer --check --pool sglang --heads 2/8 \
    --impls qla,sglang,sglang_qla --rows d1,d32,d256,16x512,1x8192 --json "$out/layer_sglang.json" \
    2>&1 | tee "$out/layer_sglang.log"
  step "SGLang target verify" 200 python benchmarks/sglang_verify.py --json "$out/sglang_verify.json" \
    2>&1 | tee "$out/sglang_verify.log"
fi
