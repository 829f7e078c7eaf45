#!/usr/bin/env bash
# One device run for prefill kernel work: the prefill GPU tests, the benchmark and an ncu profile
# of each kernel (prep, main) on the headline row. For the lent H200:
#   run(command="bash scripts/gpu_prefill.sh", carry=[".devbundle/site.tar.xz", ".devbundle/activate.sh",
#       ".devbundle/stamp", ".gpucache/tlcache.tar.xz", ".gpucache/whl"])
# Knobs (environment): IMPLS (default qla; add fla,flashqla for the side-by-side table: FlashQLA
# JIT-compiles ~2.5 min per head pair on a fresh machine, so keep HEADS to two pairs per run),
# HEADS, ROWS, TESTS (pytest -k filter, "none" skips the tests), BENCH=0 skips the
# planner-choice table, SWEEP="1 2 4" times qla at each forced v_split (the data for
# benchmarks/fit_costmodel.py), CP_SWEEP="4:64 2:128 ..." times qla at each forced v_split:segment
# length (context parallelism; one JSON-lines file), WARMUP=on|off runs the bench and the CP sweep with
# --gate-warmup on|off (prefill_api.GATE_WARMUP; default on), MAIN=v8|vfirst runs them on that stage-2
# kernel (prefill_api.MAIN_IMPL; default vfirst at v_split 1/2), NCU=0 skips the profile (NCU_KERNEL=<regex> picks the kernels, default gdn_prefill; NCU_LAUNCHES how many launches), KERNELS=1 records qla's kernels of a call in launch order (GPU us, idle us
# before each; bench --kernels), SANITIZE=1 adds compute-sanitizer
# memcheck and racecheck on test_sanitizer_case, SAVE_JIT=1 tars every TileLang cache file this run
# created (FlashQLA's JIT kernels: ~2.5 min of compiling per head pair) into
# $OUT/flashqla_tlcache.tar.xz; carried back as .gpucache/flashqla_tlcache.tar.xz it is unpacked
# beside tlcache. AB_TREE=DIR (another tree's package, e.g. `git archive REV qla_serve | tar -x -C
# .ab/REV` here, carried) makes the bench an A/B: this tree and DIR's in alternating processes,
# AB_ROUNDS rounds (default 2), their stage 1 / stage 2 / call GPU ms side by side in
# $OUT/ab.txt (the carried TLCACHE tars must hold both trees' kernels: precompile each with
# PYTHONPATH=DIR for the other). The tests append every case's o / state errors to
# $OUT/prefill_errors.jsonl. The device returns at most 8 files from $OUT.
set -uo pipefail
out=${OUT:-/tmp/gpu_prefill}; mkdir -p "$out"
source scripts/gpu_lib.sh
# TLCACHE: the compiled-kernel tars (gpu_lib.sh; a branch's own, e.g. .gpucache/tlcache_next.tar.xz,
# when that file is carried instead of .gpucache/tlcache.tar.xz).
unpack_kernel_tars
touch /tmp/tlall.mark  # SAVE_JIT: the cache files this run creates are newer
activate_device_env
step() { echo "== $1"; shift; timeout "$@"; echo "rc=$?"; }
if [[ ${TESTS:-} != none ]]; then
  export QLA_ERRORS_JSONL="$out/prefill_errors.jsonl"  # every case's o / state errors
  step "prefill gpu tests" ${TEST_TIMEOUT:-240} python -m pytest -m gpu -q -x tests/kernels/test_prefill_gpu.py \
    -p no:cacheprovider ${TESTS:+-k "$TESTS"} 2>&1 | tee "$out/prefill_tests.log" | tail -25
fi
if [[ ${BENCH:-1} == 1 && -n ${AB_TREE:-} ]]; then
  [[ -d $AB_TREE/qla_serve ]] || { echo "AB_TREE=$AB_TREE: no qla_serve package there (carry it)"; exit 2; }
  for r in $(seq "${AB_ROUNDS:-2}"); do
    for tree in this "$AB_TREE"; do
      pp=$PWD; [[ $tree == this ]] || pp=$(cd "$tree" && pwd)
      tag=$([[ $tree == this ]] && echo this || echo ab)
      PYTHONPATH=$pp:$PYTHONPATH step "bench prefill A/B: $tag, round $r" ${BENCH_TIMEOUT:-300} python -m qla_serve.bench.prefill \
        --impls "${IMPLS:-qla16}" --heads "${HEADS:-all}" --rows "${ROWS:-all}" --breakdown --reps 10 --graph-calls 3 \
        --json "$out/prefill_${tag}_$r.json" >> "$out/bench_ab.log" 2>&1
    done
  done
  python - "$out" "${IMPLS:-qla16}" <<'PY' | tee "$out/ab.txt"
import glob, json, sys
out, impl = sys.argv[1], sys.argv[2].split(",")[0]
rows = {}
for path in sorted(glob.glob(f"{out}/prefill_*_*.json")):
    tag = path.rsplit("/", 1)[1].split("_")[1]
    for x in json.load(open(path))["results"]:
        cell = "/".join(f"{x.get(f'{impl}_{k}gpu_ms', float('nan')):.4f}" for k in ("prep_", "main_", ""))
        rows.setdefault((x["heads"], x["row"], x.get("qla_plan")), {}).setdefault(tag, []).append(cell)
print(f"| heads | row | plan | this tree ({impl} stage 1 / stage 2 / call GPU ms, per round) | AB_TREE |")
print("|---|---|---|---|---|")
for (heads, row, plan), v in rows.items():
    print(f"| {heads} | {row} | {plan} | {' ; '.join(v.get('this', []))} | {' ; '.join(v.get('ab', []))} |")
PY
elif [[ ${BENCH:-1} == 1 ]]; then
  step "bench prefill (${IMPLS:-qla})" ${BENCH_TIMEOUT:-300} python -m qla_serve.bench.prefill --impls "${IMPLS:-qla}" \
    --heads "${HEADS:-all}" --rows "${ROWS:-all}" ${WARMUP:+--gate-warmup $WARMUP} ${MAIN:+--main $MAIN} --breakdown $([[ ${KERNELS:-0} == 1 ]] && echo --kernels) --json "$out/prefill.json" --md "$out/prefill.md" \
    --png "$out/prefill.png" 2>&1 | tee "$out/bench.log" | grep -v '^{' | tail -60
  [[ ${KERNELS:-0} == 1 ]] && python -c "import json,sys
for r in json.load(open(sys.argv[1]))['results']:
    print(r['heads'], r['row'], r.get('qla_plan'), r.get('qla_gpu_ms'), [(k['kernel'][12:], k['us'], k['idle_us']) for k in r.get('qla_kernels', [])])" "$out/prefill.json"
fi
for vs in ${SWEEP:-}; do
  step "sweep v_split $vs" 150 python -m qla_serve.bench.prefill --impls qla --heads "${HEADS:-all}" --rows "${ROWS:-all}" \
    ${MAIN:+--main $MAIN} --v-split $vs --breakdown --reps 10 --json "$out/sweep_vs$vs.json" 2>&1 | grep -v "^{" | tail -3
done
for pair in ${CP_SWEEP:-}; do
  step "cp sweep v_split:L $pair" 150 python -m qla_serve.bench.prefill --impls qla --heads "${HEADS:-all}" \
    --rows "${ROWS:-all}" --v-split ${pair%%:*} --segment-chunks ${pair##*:} ${WARMUP:+--gate-warmup $WARMUP} ${MAIN:+--main $MAIN} --breakdown --reps 10 \
    --json /tmp/cp_sweep_one.json 2>&1 | grep -v "^{" | tail -3
  python -c "import json; [print(json.dumps(r)) for r in json.load(open('/tmp/cp_sweep_one.json'))['results']]" \
    >> "$out/cp_sweep.jsonl"
done
if [[ ${NCU:-1} == 1 ]]; then
  step "ncu: ${NCU_KERNEL:-gdn_prefill}, 2/8 1x32768" 180 ncu --clock-control none --set full -k regex:${NCU_KERNEL:-gdn_prefill} --launch-count ${NCU_LAUNCHES:-2} \
    -o "$out/prof" python -m qla_serve.bench.prefill --impls qla --heads 2/8 --rows 1x32768 --reps 1 --graph-calls 1 \
    > "$out/ncu_run.txt" 2>&1
  ncu -i "$out/prof.ncu-rep" --page details > "$out/ncu.txt" 2>&1
  grep -E "gdn_prefill|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit (Reg|Shared)|Dynamic Shared" "$out/ncu.txt" | head -30
  # Per-SASS-instruction stall samples, for finding the hot spots offline.
  ncu -i "$out/prof.ncu-rep" --page source --print-source sass --csv > "$out/sass.csv" 2>&1; ls -la "$out/sass.csv"
fi
if [[ ${SANITIZE:-0} == 1 ]]; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool" ${SANITIZE_TIMEOUT:-200} compute-sanitizer --tool $tool --kernel-name kns=gdn_prefill \
      python -m pytest -m gpu -q -x tests/kernels/test_prefill_gpu.py -p no:cacheprovider -k sanitizer_case \
      2>&1 | tee "$out/sanitizer_$tool.log" | tail -8
  done
fi
if [[ ${SAVE_JIT:-0} == 1 ]]; then
  (cd /tmp/tlall && find . -type f -newer /tmp/tlall.mark | tar -cJf "$out/flashqla_tlcache.tar.xz" -T -)
  ls -la "$out/flashqla_tlcache.tar.xz"
fi
