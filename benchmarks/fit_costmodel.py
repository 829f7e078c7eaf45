"""Fit the prefill planner's cost model (configs/costmodel/<arch>.yaml) from a v_split sweep.

Input: the JSON files of `bash scripts/gpu_prefill.sh` with SWEEP="1 2 4" (one file per forced
v_split: `python -m qla_serve.bench.prefill --v-split V --breakdown --json ...`), i.e. the prep
and main GPU time of every (heads, row) at every split. Model (qla_serve.costmodel.CostModel):

    main  = chunk_us[v] * max(chain_chunks, ceil(v * Hv * sum(chunks) / sm_count))
    prep  = stage1_us[v] * Hv * sum(chunks) / sm_count   (per split: its stage-2 kernel's prep form)
    total = main + prep + launch_us

chunk_us[v] and stage1_us[v] by least squares on relative error (each is one coefficient of a
one-variable model, so the fit is a weighted ratio), launch_us from the residual of the smallest
rows. Prints the coefficients and the per-row error, and writes nothing: paste the numbers into
the YAML with the data files they came from.

    python benchmarks/fit_costmodel.py benchmarks/data/prefill_qla_v15_sweep_vs*_h200.json

Context parallelism (``--cp FILE.jsonl``, from scripts/gpu_prefill.sh with CP_SWEEP): with the
packaged chunk_us and stage1_us fixed, a grid search for cp_maps_ratio and cp_fixed_us (the
maps pass's per-chunk time relative to the output pass, and the scan's fixed cost) for the
smallest worst-case excess of the model's pick over the measured best per (heads, row), then
the smallest relative error of the planner's own score (qla_serve.plan._score).

    python benchmarks/fit_costmodel.py --cp benchmarks/data/prefill_v16_cp_sweep_h200.jsonl
"""

import json
import math
import statistics
import sys

from qla_serve.bench.prefill import ROWS, parse_plan_label
from qla_serve.costmodel import load_cost_model
from qla_serve.plan import CHUNK

SM = load_cost_model("sm90").sm_count  # the H200's 132 SMs


def _features(row: str, heads: str, v_split: int):
    hk, hv = (int(x) for x in heads.split("/"))
    chunks = [-(-n // CHUNK) for n in ROWS[row] if n]
    chain = max(chunks)
    waves = math.ceil(v_split * hv * sum(chunks) / SM)
    return max(chain, waves), hv * sum(chunks) / SM


def _ratio_fit(xs, ys):
    """argmin_c sum((c x - y) / y)^2 = sum(x / y) / sum((x / y)^2)."""
    r = [x / y for x, y in zip(xs, ys)]
    return sum(r) / sum(t * t for t in r)


def main(paths: list[str]) -> None:
    rows = []
    for p in paths:
        for r in json.load(open(p))["results"]:
            if "qla_main_gpu_ms" not in r:
                continue
            vs = parse_plan_label(r["qla_plan"])[1]
            busy, chunk_heads_per_sm = _features(r["row"], r["heads"], vs)
            rows.append(dict(heads=r["heads"], row=r["row"], vs=vs, busy=busy, ch=chunk_heads_per_sm,
                             main=r["qla_main_gpu_ms"] * 1e3, prep=r["qla_prep_gpu_ms"] * 1e3,
                             total=r["qla_gpu_ms"] * 1e3))
    chunk_us = {}
    for vs in sorted({r["vs"] for r in rows}):
        sel = [r for r in rows if r["vs"] == vs]
        chunk_us[vs] = _ratio_fit([r["busy"] for r in sel], [r["main"] for r in sel])
    # per split: the stage-1 form follows the stage-2 kernel (sm90: v8 at v_split 4 reads U0/Wk)
    stage1_us = {vs: _ratio_fit([r["ch"] for r in rows if r["vs"] == vs], [r["prep"] for r in rows if r["vs"] == vs])
                 for vs in chunk_us}
    resid = [r["total"] - chunk_us[r["vs"]] * r["busy"] - stage1_us[r["vs"]] * r["ch"] for r in rows]
    launch_us = max(0.0, statistics.median(sorted(resid)[: max(1, len(resid) // 4)]))
    errs = []
    for r in rows:
        est = chunk_us[r["vs"]] * r["busy"] + stage1_us[r["vs"]] * r["ch"] + launch_us
        errs.append((est - r["total"]) / r["total"])
        print(f"{r['heads']:>6} {r['row']:>10} vs{r['vs']}  measured {r['total']:8.1f} us  model {est:8.1f} us  "
              f"{errs[-1]:+.0%}")
    print(f"\nchunk_us: {{{', '.join(f'{k}: {v:.2f}' for k, v in chunk_us.items())}}}")
    print(f"stage1_us: {{{', '.join(f'{k}: {v:.3f}' for k, v in stage1_us.items())}}}\nlaunch_us: {launch_us:.1f}")
    print(f"RMS relative error {math.sqrt(sum(e * e for e in errs) / len(errs)):.1%} over {len(errs)} timings")
    # Does the model pick the measured-best split per (heads, row)?
    best = {}
    for r in rows:
        key = (r["heads"], r["row"])
        est = chunk_us[r["vs"]] * r["busy"] + stage1_us[r["vs"]] * r["ch"]
        best.setdefault(key, []).append((r["total"], est, r["vs"]))
    agree = sum(min(v)[2] == min(v, key=lambda t: t[1])[2] for v in best.values())
    print(f"model's split = measured-best split on {agree}/{len(best)} (heads, row) pairs")


def _cp_score(model, r) -> float:
    from qla_serve.plan import _score

    hv = int(r["heads"].split("/")[1])
    _, vs, L = parse_plan_label(r["qla_plan"])
    return _score(model, [-(-n // CHUNK) for n in ROWS[r["row"]]], hv, SM, vs, L)


def fit_cp(path: str) -> None:
    recs = [json.loads(line) for line in open(path) if "qla_gpu_ms" in line]
    base = load_cost_model("sm90")
    cases = {}
    for r in recs:
        cases.setdefault((r["heads"], r["row"]), []).append(r)

    def pick_excess(m) -> list[float]:
        """Per (heads, row): how much slower than the measured best the model's favourite is."""
        return [min(rs, key=lambda r: _cp_score(m, r))["qla_gpu_ms"] / min(r["qla_gpu_ms"] for r in rs) - 1
                for rs in cases.values()]

    # Chosen by the planner's job, picking: the smallest worst-case pick excess (to 1%), then the
    # smallest total excess, then the RMS error of the score (its absolute level matters less
    # than its order).
    fits = []
    for ratio in [x / 20 for x in range(2, 61)]:
        for fixed in (0.0, 5.0, 10.0, 20.0, 40.0, 60.0, 100.0):
            m = base.model_copy(update={"cp_maps_ratio": ratio, "cp_fixed_us": fixed})
            errs = [(_cp_score(m, r) - r["qla_gpu_ms"] * 1e3) / (r["qla_gpu_ms"] * 1e3) for r in recs]
            rms = math.sqrt(sum(e * e for e in errs) / len(errs))
            excess = pick_excess(m)
            fits.append((round(max(excess), 2), round(sum(excess), 2), rms, ratio, fixed, m))
    _, _, rms, ratio, fixed, m = min(fits, key=lambda t: t[:3])
    for r in recs:
        print(f"{r['heads']:>6} {r['row']:>10} {r['qla_plan']:>12}  measured {r['qla_gpu_ms'] * 1e3:8.1f} us  "
              f"model {_cp_score(m, r):8.1f} us")
    print(f"\ncp_maps_ratio: {ratio}\ncp_fixed_us: {fixed}\nRMS relative error {rms:.1%} over {len(recs)} timings")
    best = {}
    for r in recs:
        best.setdefault((r["heads"], r["row"]), []).append((r["qla_gpu_ms"], _cp_score(m, r), r["qla_plan"]))
    for key, v in sorted(best.items()):
        got, pick = min(v), min(v, key=lambda t: t[1])
        print(f"{key[0]:>6} {key[1]:>10}: measured best {got[2]} {got[0]:.3f} ms; model picks {pick[2]} "
              f"{pick[0]:.3f} ms ({pick[0] / got[0] - 1:+.0%})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cp"]:
        fit_cp(sys.argv[2])
    else:
        main(sys.argv[1:])
