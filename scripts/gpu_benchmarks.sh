#!/usr/bin/env bash
# Regenerates every file in benchmarks/data: each benchmark's current result (its JSON and, where
# the bench draws one, its plot), the GPU-suite log and error log, the TP8 cold start, and the
# inputs of benchmarks/fit_costmodel.py. Every file records the commit and the UTC date it ran
# at: a JSON as top-level "commit" / "date", a JSON-lines file in every record, a text file in a
# first "# commit ..., date ..." line. Copy what comes back into benchmarks/data and update the
# table in benchmarks/README.md (and the write-ups' figures). For the lent H200, one part per
# call (a call runs at most 10 minutes and brings back at most 8 files):
#   run(command="QLA_SERVE_COMMIT=<sha> PART=<part> bash scripts/gpu_benchmarks.sh",
#       carry=[".devbundle/site.tar.xz", ".devbundle/activate.sh", ".devbundle/stamp",
#              ".gpucache/tlcache.tar.xz", ".gpucache/tl_tp8.tar.xz", ".gpucache/whl"])
# (the files scripts/gpu_validate.sh carries; add .gpucache/flashqla_tlcache.tar.xz where
# `SAVE_JIT=1 bash scripts/gpu_prefill.sh` made one: FlashQLA JIT-compiles ~2.5 min per head pair
# without it). QLA_SERVE_COMMIT: the commit of the tree that runs (the device's .git is an older
# checkout's); without it `git rev-parse` of that .git is recorded, marked "-unverified".
#
# PART (default: every part in turn, for a machine without the 10-minute limit) -> files in $OUT:
#   tests      gpu_tests_h200.log (every `gpu` test), prefill_errors_h200.jsonl (the prefill tests'
#              o / state errors against the float64 recurrence)
#   coldstart  coldstart_tp8_h200.json (the TP8 deployment's first calls from its precompiled cache)
#   prefill    prefill_h200.json, prefill_h200.png (bench prefill: qla, qla16, FlashQLA at all five
#              head pairs, FLA at 2/8 and 16/64); supersedes prefill_2-8_h200.json: delete that one
#   check      prefill_check_h200.json (bench prefill --check at 2/8 and 16/64: o and final states
#              against FLA and FlashQLA)
#   decode     decode_h200.json, decode_h200.png (bench decode with the tile sweep),
#              verify_tiles_h200.json (benchmarks/verify_tiles.py: verify and verify_slots in ten tiles)
#   flashinfer prefill_flashinfer_h200.json, decode_flashinfer_h200.json (bench prefill and bench
#              decode beside FlashInfer 0.7.2, --check; needs .fibundle as the layer part does)
#   layer      layer_h200.json, layer_h200.png (bench layer --check, every default row)
#   spec       spec_layouts_h200.txt (benchmarks/spec_prefill_host.py: vLLM's MTP steps beside a
#              chunked prefill, the spec rows as views, gathered, and interleaved; 2/8 and 2/4)
#   conv       conv_forms_h200.txt (conv_prefill's forms, conv.PREFILL_LANE_CHANNELS,
#              PREFILL_ROW_OFFSETS and PREFILL_LOAD_HINT: the kernel in each form
#              (benchmarks/conv_prefill_ab.py) first, then their GPU tests and the layer's
#              preamble against issue 24's target at the 8192-token rows
#              (benchmarks/layer_preamble.py), the file written as each step runs, so that a call
#              cut short returns what ran; ~5 min with their kernels
#              carried, e.g. TLCACHE=".gpucache/tlcache.tar.xz .gpucache/conv_forms.tar.xz")
#   decode-tiles decode_tiles_h200.txt (the decode's candidate tiles beside the defaults and
#              FlashInfer, fp32 and bf16 states, two rounds, then the layer with the fp32
#              candidate forced: DECODE_TILES against the H100's choices of session 55,
#              benchmarks/decode.md; needs .fibundle as the flashinfer part does; written as each
#              step runs; fp32 two rounds, bf16 one, sized for one 10-minute call). Its
#              kernels: `bench decode --precompile sm_90a` with the same arguments (~25 s on 2
#              cores) and `qla-serve precompile --heads 2/8 16/32 --arch sm_90a --match
#              "conv_decode|gdn_decode|slot_ids"` for the layer (~9 min on 2 cores), all into one
#              TILELANG_CACHE_DIR, tarred as TLCACHE (`tar -cJf X.tar.xz -C DIR .`, ~1.7 MB)
#   inputs     prefill_inputs_h200.txt (benchmarks/prefill_inputs.py)
#   sustained  sustained_h200.txt (benchmarks/sustained.py, the 16/64 and 2/8 rows of prefill.md)
#   sweep      costmodel_sweep_vs{1,2,4}_h200.json (fit_costmodel.py: every row at forced v_split)
#   cp-sweep   costmodel_cp_sweep_h200.jsonl (fit_costmodel.py --cp: forced v_split x segment length)
#   maps       costmodel_maps_vs{1,2}_h200.json (tests/test_plan.py: the CP maps pass at split 1, 2)
# Knobs: PREFILL_GROUPS (the prefill part's "heads:impls" groups, one bench process each; to split
# them over calls, run a group per call and merge the earlier calls' JSONs, carried back, with
# PREFILL_MERGE="path ..."), FI_GROUPS / FI_IMPLS / FI_DECODE (the flashinfer part's "heads|rows"
# groups, e.g. FI_GROUPS="16/64|4x8192,2048x4,1024x8 4/16|1024x8", its prefill impls, e.g.
# qla16,flashinfer without FlashQLA's JIT, FI_ROUNDS each group's process that many times (default 1;
# results carry their round), and FI_DECODE=0 to skip its decode bench), CP_GROUPS
# (the cp-sweep part's "heads|rows|v_split:L ..." groups),
# TIMEOUT (seconds per step, default 560), TLCACHE (compiled-kernel tars, space-separated),
# PRECOMPILE_HEADS (head pairs, e.g. "2/4 4/8", whose kernels are built on the device first, one
# process per core: 338 variants of a pair in ~100 s on the lent H200's 16 cores, against
# 10-60 s per kernel when the tests compile them one by one),
# GPU_TESTS (the tests part's pytest paths and options).
set -uo pipefail
out=${OUT:-/tmp/gpu_benchmarks}; mkdir -p "$out"
part=${PART:-all}
parts="tests coldstart prefill check decode flashinfer layer spec conv decode-tiles inputs sustained sweep cp-sweep maps"
if [[ $part != all && " $parts " != *" $part "* ]]; then echo "PART=$part: expected one of: $parts (or all)"; exit 2; fi
want() { [[ $part == all || $part == "$1" ]]; }

commit=${QLA_SERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)-unverified}
export QLA_SERVE_COMMIT=$commit        # bench layer records it itself
run_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
echo "gpu_benchmarks: PART=$part, commit $commit, $run_date"

source scripts/gpu_lib.sh
unpack_kernel_tars  # TLCACHE (gpu_lib.sh)
mkdir -p /tmp/tl_tp8
[[ -f .gpucache/tl_tp8.tar.xz ]] && tar -xJf .gpucache/tl_tp8.tar.xz -C /tmp/tl_tp8
activate_device_env
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
T=${TIMEOUT:-560}
step() { echo "== $1" >&2; shift; timeout "$@"; echo "rc=$?" >&2; }   # notes on stderr: not in the data files
if [[ -n ${PRECOMPILE_HEADS:-} ]]; then
  # shellcheck disable=SC2086
  step "precompile $PRECOMPILE_HEADS on the device" $T python -m qla_serve.cli precompile --heads $PRECOMPILE_HEADS \
    --arch sm_90a --jobs "$(nproc)" --no-progress | tail -2
fi

# stamp FILE...: the run's commit and date into each file (kept where the bench wrote its own).
stamp() {
  python - "$commit" "$run_date" "$@" <<'PY'
import json, sys
commit, date, *paths = sys.argv[1:]
for p in paths:
    try:
        text = open(p).read()
    except OSError:
        print(f"stamp: {p} missing (its step failed)")
        continue
    if p.endswith(".json"):
        d = json.loads(text)
        d = {"commit": d.get("commit") or commit, "date": d.get("date") or date,
             **{k: v for k, v in d.items() if k not in ("commit", "date")}}
        text = json.dumps(d, indent=1) + "\n"
    elif p.endswith(".jsonl"):
        recs = [json.loads(line) for line in text.splitlines() if line.strip()]
        text = "".join(json.dumps({"commit": commit, "date": date, **r}) + "\n" for r in recs)
    else:
        text = f"# commit {commit}, date {date}\n" + text
    open(p, "w").write(text)
PY
}

if want tests; then
  rm -f "$out/prefill_errors_h200.jsonl"
  # GPU_TESTS: the pytest paths and options (default: all of tests/); split the suite over calls
  # where it runs past a call's 10 minutes, e.g. "tests/kernels" then "tests --ignore=tests/kernels".
  # shellcheck disable=SC2086
  QLA_ERRORS_JSONL="$out/prefill_errors_h200.jsonl" step "gpu tests: ${GPU_TESTS:-tests}" $T python -m pytest -m gpu \
    -q -rs ${GPU_TESTS:-tests} -p no:cacheprovider --continue-on-collection-errors > "$out/gpu_tests_h200.log" 2>&1
  tail -5 "$out/gpu_tests_h200.log"
  stamp "$out/gpu_tests_h200.log" "$out/prefill_errors_h200.jsonl"
fi

if want coldstart; then
  step "TP8 cold start from the precompiled cache" 120 env TILELANG_CACHE_DIR=/tmp/tl_tp8 \
    python -m qla_serve.deploy.coldstart --config configs/deploy/qwen3.5-397b-a17b-tp8.yaml \
    > "$out/coldstart_tp8_h200.json"
  stamp "$out/coldstart_tp8_h200.json"
fi

if want prefill; then
  files=()
  i=0
  for group in ${PREFILL_GROUPS:-"2/8,16/64:qla,qla16,flashqla,fla" "4/16,8/24,16/32:qla,qla16,flashqla"}; do
    step "bench prefill ${group%%:*} (${group#*:})" $T python -m qla_serve.bench.prefill --heads "${group%%:*}" \
      --impls "${group#*:}" --breakdown --json "/tmp/prefill_part$i.json" | grep -v '^{'
    files+=("/tmp/prefill_part$i.json"); i=$((i + 1))
  done
  # One JSON and one plot: the groups' results in head-pair order, unchanged.
  python - "$out/prefill_h200" ${PREFILL_MERGE:-} "${files[@]}" <<'PY'
import json, os, sys
from qla_serve.bench.prefill import HEAD_PAIRS, ROWS, _plot
dest, *paths = sys.argv[1:]
results, device = [], None
for p in paths:
    if not os.path.exists(p):
        print(f"merge: {p} missing (its bench failed)")
        continue
    d = json.load(open(p))
    device = device or d.get("device")
    results += d["results"]
order = {f"{hk}/{hv}": i for i, (hk, hv) in enumerate(HEAD_PAIRS)}
rows = list(ROWS)
results.sort(key=lambda r: (order.get(r["heads"], 99), rows.index(r["row"]) if r["row"] in rows else 99))
impls = [i for i in ("qla", "qla16", "flashqla", "fla") if any(f"{i}_gpu_ms" in r for r in results)]
json.dump({"device": device, "results": results}, open(dest + ".json", "w"), indent=1)
_plot(results, impls, dest + ".png")
print(f"merge: {len(results)} rows, impls {impls}")
PY
  stamp "$out/prefill_h200.json"
fi

if want check; then
  step "bench prefill --check" $T python -m qla_serve.bench.prefill --impls qla,qla16,flashqla,fla --heads 2/8,16/64 \
    --check --json "$out/prefill_check_h200.json" | grep -v '^{'
  stamp "$out/prefill_check_h200.json"
fi

if want decode; then
  step "bench decode" $T python -m qla_serve.cli bench decode --out /tmp/decode_out \
    --tiles bv32,bv64,bv32s-mb8,bv64s-mb5,bv8w1,bv16w2,bv8w1s-mb32
  cp /tmp/decode_out/results.json "$out/decode_h200.json"; cp /tmp/decode_out/decode.png "$out/decode_h200.png"
  step "verify tiles" $T python benchmarks/verify_tiles.py --json "$out/verify_tiles_h200.json"
  stamp "$out/decode_h200.json" "$out/verify_tiles_h200.json"
fi

if want flashinfer; then
  # FlashInfer from .fibundle (make-fibundle.sh): carry site-a.tar.xz + activate.sh in one call,
  # then this part with site-b.tar.xz + activate.sh on the same warm machine.
  if [[ -f .fibundle/activate.sh ]]; then source .fibundle/activate.sh; fi
  # FI_ROUNDS: each group's process that many times (FlashInfer's and qla's figures moved 6-8%
  # between H100 machines, sessions 62 and 66; rounds show the spread within one machine)
  files=()
  for round in $(seq "${FI_ROUNDS:-1}"); do
    for group in ${FI_GROUPS:-"2/8|1x32768,1x8192,64x512,mixed8192,4x8192" "16/64|4x8192,1x32768,2048x4,1024x8"}; do
      i=${#files[@]}
      step "bench prefill beside FlashInfer ${group%%|*}, round $round" $((T / 3)) python -m qla_serve.bench.prefill \
        --heads "${group%%|*}" --rows "${group#*|}" --impls "${FI_IMPLS:-qla,qla16,flashqla,flashinfer}" --check --reps 10 \
        --graph-calls 3 --json "/tmp/prefill_fi$i.json" | grep -v '^{'
      files+=("$round:/tmp/prefill_fi$i.json")
    done
  done
  python - "$out/prefill_flashinfer_h200.json" "${files[@]}" <<'PY'
import json, os, sys
dest, *tagged = sys.argv[1:]
rounds_paths = [t.split(":", 1) for t in tagged]   # "round:path"
parts = [(int(k), json.load(open(p))) for k, p in rounds_paths if os.path.exists(p)]
json.dump({"device": parts[0][1]["device"] if parts else None,
           "results": [dict(r, round=k) for k, d in parts for r in d["results"]]}, open(dest, "w"), indent=1)
PY
  if [[ ${FI_DECODE:-1} == 1 ]]; then
    step "bench decode beside FlashInfer" $((T / 3)) python -m qla_serve.cli bench decode --heads 2/8,16/32 \
      --batches 1,32,64,256 --impls qla-fused,flashinfer --check --replays 10 --out /tmp/decode_fi
    cp /tmp/decode_fi/results.json "$out/decode_flashinfer_h200.json"
    stamp "$out/decode_flashinfer_h200.json"
  fi
  stamp "$out/prefill_flashinfer_h200.json"
fi

if want layer; then
  # FLA's Triton autotuning on every new shape makes this long: split --heads over calls if needed.
  # The FlashInfer column needs .fibundle (make-fibundle.sh): carry site-a.tar.xz + activate.sh in
  # one call, then this part with site-b.tar.xz + activate.sh on the same warm machine. The vllm
  # column (vLLM 0.33.0's stock GDN core) needs .vllmops (benchmarks/make_vllm_ops_bundle.sh):
  # carry .vllmops/vllmops.tar.xz + .vllmops/activate.sh beside it.
  if [[ -f .fibundle/activate.sh ]]; then source .fibundle/activate.sh; fi
  if [[ -f .vllmops/activate.sh ]]; then source .vllmops/activate.sh; fi
  step "bench layer" $T python -m qla_serve.cli bench layer --check --json "$out/layer_h200.json" \
    --plot "$out/layer_h200.png" | grep -v '^{'
  stamp "$out/layer_h200.json"
fi

if want spec; then
  step "spec + prefill steps by token layout" $T bash -c "python benchmarks/spec_prefill_host.py --heads 2/8,2/4 \
    --specs 8,32 --rounds 2 --steps 10 > $out/spec_layouts_h200.txt"
  cat "$out/spec_layouts_h200.txt"; stamp "$out/spec_layouts_h200.txt"
fi

if want conv; then
  f="$out/conv_forms_h200.txt"
  # Written as each step runs (tee -a), the A/B first: a call cut short by the device's limit or
  # its budget still brings back the steps that ran, the deciding one first (so the stamp's line
  # comes first, not after the last step)
  echo "# commit $commit, date $run_date" > "$f"
  # (forms: the default, its reads without the L2::evict_first policy, the plain form with 8
  # channels a lane and clamped rows, 4 lanes with row offsets at 16-step walks)
  echo "## python benchmarks/conv_prefill_ab.py (forms: default, without the load hint, plain, 4 lanes + row offsets at 16-step walks)" | tee -a "$f"
  step "conv forms: kernel A/B" 170 python benchmarks/conv_prefill_ab.py --heads 2/8,4/16,16/64 \
    --rows 1x8192,16x512,mixed,1x32768 --forms 3:auto:fast+lcauto+ro+ef,3:auto:fast+lcauto+ro,3:auto:fast,3:16:fast+lc4+ro \
    2>&1 | tee -a "$f"
  # (the forms set by the tests themselves; the plain form's cases ran before)
  sel="load_hint or fixed_forms or ((random_batches or widths or decode_rows) and not 8-False)"
  echo "## pytest -m gpu tests/kernels/test_layer_ops_gpu.py -k '$sel'" | tee -a "$f"
  step "conv forms: GPU tests" 190 python -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_layer_ops_gpu.py \
    -k "$sel" 2>&1 | tail -6 | tee -a "$f"
  echo "## python benchmarks/layer_preamble.py --conv-forms autoroef,autoro,8 (layer - core against 1.25 x floor)" | tee -a "$f"
  step "conv forms: layer preamble" 180 python benchmarks/layer_preamble.py --heads 2/8,4/16 \
    --rows 1x8192,16x512,mixed --conv-forms autoroef,autoro,8 2>&1 | tee -a "$f"
fi

if want decode-tiles; then
  f="$out/decode_tiles_h200.txt"
  if [[ -f .fibundle/activate.sh ]]; then source .fibundle/activate.sh; fi
  echo "# commit $commit, date $run_date" > "$f"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$f"
  # (pool | tiles | round: fp32, the open question, twice; bf16 once)
  for spec in "float32|bv16l16-cs,bv8l32-cs-p8s3,bv8l32-cs-p8s3-o,bv8l32-p2-e-o|1" \
              "float32|bv16l16-cs,bv8l32-cs-p8s3,bv8l32-cs-p8s3-o,bv8l32-p2-e-o|2" \
              "bfloat16|bv32l16-cs,bv16l16-cs-p8s4,bv16l16-cs-p8s4-o|1"; do
    IFS='|' read -r pool tiles round <<< "$spec"
    echo "## bench decode $pool, round $round (kernel GPU us, graph replay)" | tee -a "$f"
    step "decode tiles $pool $round" 140 python -m qla_serve.cli bench decode \
      --pools "$pool" --heads 2/8,16/32 --batches 64,256,512,1024,2048 \
      --impls qla-fused,flashinfer --tiles "$tiles" --out /tmp/decode_tiles 2>&1 | grep "^|" | tee -a "$f"
  done
  echo "## layer_ab.py decode.TILE_OVERRIDE=None,'bv8l32-p2-e-o' (GPU us per layer call)" | tee -a "$f"
  step "decode tiles: layer" 110 python benchmarks/layer_ab.py --switch "decode.TILE_OVERRIDE=None,'bv8l32-p2-e-o'" \
    --heads 2/8,16/32 --rows d256,d512,d1024 --states fp32 2>&1 | grep -v INFO | tee -a "$f"
fi

if want inputs; then
  step "prefill inputs" $T python benchmarks/prefill_inputs.py > "$out/prefill_inputs_h200.txt" 2>/tmp/inputs.err
  tail -3 /tmp/inputs.err
  cat "$out/prefill_inputs_h200.txt"; stamp "$out/prefill_inputs_h200.txt"
fi

if want sustained; then
  step "sustained load" $T python benchmarks/sustained.py \
    --rows 16/64:64x512,16/64:4x8192,2/8:64x512,2/8:1x32768 > "$out/sustained_h200.txt" 2>/tmp/sustained.err
  tail -3 /tmp/sustained.err
  cat "$out/sustained_h200.txt"; stamp "$out/sustained_h200.txt"
fi

if want sweep; then
  # Every row at forced v_split 1 and 2; v_split 4 where it can win (the small-sequence rows).
  for vs in 1 2 4; do
    if [[ $vs == 4 ]]; then heads=2/8,4/16 rows=2048x4,1024x8,mixed8192; else heads=all rows=all; fi
    step "sweep v_split $vs" $T python -m qla_serve.bench.prefill --impls qla --heads $heads --rows $rows \
      --v-split $vs --breakdown --reps 10 --json "$out/costmodel_sweep_vs${vs}_h200.json" | grep -v '^{'
    stamp "$out/costmodel_sweep_vs${vs}_h200.json"
  done
fi

if want cp-sweep; then
  # The long and mixed rows uncut (L 0) and cut at each (v_split, L); longer segments and v_split 4
  # on the heavy heads' 1x32768. One JSON-lines file of every timing.
  rm -f "$out/costmodel_cp_sweep_h200.jsonl"
  for group in ${CP_GROUPS:-"all|1x32768,1x8192,4x8192,mixed8192|1:0,2:0,1:8,1:16,1:32,1:64,2:16,2:32,2:64" \
                            "8/24,16/32,16/64|1x32768|1:128,1:256,2:128,2:256,4:64,4:128"}; do
    IFS='|' read -r heads rows pairs <<< "$group"
    for pair in ${pairs//,/ }; do
      step "cp sweep $heads $rows v_split:L $pair" $T python -m qla_serve.bench.prefill --impls qla --heads "$heads" \
        --rows "$rows" --v-split ${pair%%:*} --segment-chunks ${pair##*:} --breakdown --reps 10 \
        --json /tmp/cp_sweep_one.json | grep -v '^{'
      python -c "import json; [print(json.dumps(r)) for r in json.load(open('/tmp/cp_sweep_one.json'))['results']]" \
        >> "$out/costmodel_cp_sweep_h200.jsonl" && rm -f /tmp/cp_sweep_one.json
    done
  done
  stamp "$out/costmodel_cp_sweep_h200.jsonl"
fi

if want maps; then
  # The CP-capable rows with the maps pass forced to split 1, then 2 (FlashQLA beside them).
  for split in 1 2; do
    step "maps pass at v_split $split" $T python -m qla_serve.bench.prefill --impls qla,flashqla \
      --rows 1x32768,1x8192,4x8192 --maps-v-split $split --kernels \
      --json "$out/costmodel_maps_vs${split}_h200.json" | grep -v '^{'
    stamp "$out/costmodel_maps_vs${split}_h200.json"
  done
fi
ls -la "$out"
