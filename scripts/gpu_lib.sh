# Sourced by scripts/gpu_prefill.sh and scripts/gpu_benchmarks.sh (on the device, from the
# checkout root): the setup both share.

# unpack_kernel_tars: the compiled-kernel tars into /tmp/tlall. TLCACHE: space-separated tars
# (default .gpucache/tlcache.tar.xz, written by `qla-serve precompile --heads ... --arch sm_90a
# --pack ...`; a named one that is missing is an error), then FlashQLA's own TileLang kernels where
# an earlier `SAVE_JIT=1 bash scripts/gpu_prefill.sh` saved them (.gpucache/flashqla_tlcache.tar.xz).
unpack_kernel_tars() {
  mkdir -p /tmp/tlall
  local tlcache
  for tlcache in ${TLCACHE:-.gpucache/tlcache.tar.xz}; do
    if [[ -n ${TLCACHE:-} && ! -f $tlcache ]]; then echo "TLCACHE: $tlcache: no such file (carry it)"; exit 2; fi
    [[ -f $tlcache ]] && tar -xJf "$tlcache" -C /tmp/tlall
  done
  [[ -f .gpucache/flashqla_tlcache.tar.xz ]] && tar -xJf .gpucache/flashqla_tlcache.tar.xz -C /tmp/tlall
  return 0
}

# activate_device_env: TileLang's cache at /tmp/tlall, the carried bundle (.devbundle) and any
# carried wheels (.gpucache/whl) on PYTHONPATH.
activate_device_env() {
  export TILELANG_CACHE_DIR=/tmp/tlall
  source .devbundle/activate.sh
  local w
  for w in .gpucache/whl/*.whl; do [[ -f $w ]] && python -m zipfile -e "$w" /tmp/whlsite; done
  export PYTHONPATH=${PYTHONPATH:-}:/tmp/whlsite
  export PYTHONUNBUFFERED=1
}
