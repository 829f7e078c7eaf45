"""Fit the prefill planner's cost model (configs/costmodel/<arch>.yaml) from a v_split sweep.

Input: the JSON files of `bash scripts/gpu_prefill.sh` with SWEEP="1 2 4" (one file per forced
v_split: `python -m qla_serve.bench.prefill --v-split V --breakdown --json ...`), i.e. the prep
and main GPU time of every (heads, row) at every split. Model (qla_serve.costmodel.CostModel;
the fit scores through qla_serve.plan._score, so it fits the formula the planner uses):

    main  = max(ceil(chain_blocks / sm_count) * (chunk_us[v] * chain_chunks + item_us[v]),
                chunk_us[v] * ceil(block_chunks / sm_count) + item_us[v] * ceil(blocks / sm_count))
    prep  = stage1_us[v] * Hv * sum(chunks) / sm_count   (per split: its stage-2 kernel's prep form)
    total = main + prep + launch_us

(blocks: sequences x v-heads x v; chain_blocks: those walking the longest sequence's chunks.)
chunk_us[v] and item_us[v] by a grid search for the smallest relative RMS error of main,
stage1_us[v] by least squares on relative error (a weighted ratio), launch_us from the
residual of the smallest rows. Prints the coefficients and the per-row error, and writes
nothing: paste the numbers into the YAML with the data files they came from.

    python benchmarks/fit_costmodel.py benchmarks/data/costmodel_sweep_vs*_h200.json

Context parallelism (``--cp FILE.jsonl``, from scripts/gpu_prefill.sh with CP_SWEEP): with the
packaged chunk_us, item_us and stage1_us fixed, a grid search for cp_maps_ratio, cp_fixed_us and
cp_level_us (the maps pass's per-chunk time relative to the output pass, the CP launches' fixed
cost, the cost per scan step) for the smallest worst-case excess of the model's pick over the
measured best per (heads, row), then the smallest total excess, then the smallest relative
error of the planner's own score (qla_serve.plan._score).

    python benchmarks/fit_costmodel.py --cp benchmarks/data/costmodel_cp_sweep_h200.jsonl
"""

import json
import math
import statistics
import sys

from qla_serve.bench.prefill import ROWS, parse_plan_label
from qla_serve.costmodel import load_cost_model
from qla_serve.plan import _score, seq_chunks

SM = load_cost_model("sm90").sm_count  # the H200's 132 SMs


def _chunks(row: str) -> list[int]:
    return [c for c in seq_chunks(ROWS[row]) if c]


def _ratio_fit(xs, ys):
    """argmin_c sum((c x - y) / y)^2 = sum(x / y) / sum((x / y)^2)."""
    r = [x / y for x, y in zip(xs, ys)]
    return sum(r) / sum(t * t for t in r)


def _rms(errs) -> float:
    return math.sqrt(sum(e * e for e in errs) / len(errs))


def _fit_stage2(sel, vs, base):
    """(chunk_us, item_us) of split vs: coarse then fine grid on the relative RMS of main."""
    def rms(c, i):
        m = base.model_copy(update={"chunk_us": {vs: c}, "item_us": {vs: i}, "stage1_us": 0.0,
                                    "launch_us": 0.0})
        return _rms([(_score(m, _chunks(r["row"]), r["hv"], SM, vs, 0) - r["main"]) / r["main"] for r in sel])

    best = min((rms(c / 10, i), c / 10, i) for c in range(5, 40) for i in range(0, 20))
    _, c0, i0 = best
    best = min((rms(c0 + dc / 100, max(0.0, i0 + di / 10)), round(c0 + dc / 100, 2), round(max(0.0, i0 + di / 10), 1))
               for dc in range(-10, 11) for di in range(-10, 11))
    return best[1], best[2]


def main(paths: list[str]) -> None:
    rows = []
    for p in paths:
        for r in json.load(open(p))["results"]:
            if "qla_main_gpu_ms" not in r:
                continue
            hv = int(r["heads"].split("/")[1])
            rows.append(dict(heads=r["heads"], row=r["row"], hv=hv, vs=parse_plan_label(r["qla_plan"])[1],
                             ch=hv * sum(_chunks(r["row"])) / SM, main=r["qla_main_gpu_ms"] * 1e3,
                             prep=r["qla_prep_gpu_ms"] * 1e3, total=r["qla_gpu_ms"] * 1e3))
    base = load_cost_model("sm90")
    splits = sorted({r["vs"] for r in rows})
    fitted = {vs: _fit_stage2([r for r in rows if r["vs"] == vs], vs, base) for vs in splits}
    stage1_us = {vs: _ratio_fit([r["ch"] for r in rows if r["vs"] == vs], [r["prep"] for r in rows if r["vs"] == vs])
                 for vs in splits}
    model = base.model_copy(update={"chunk_us": {vs: f[0] for vs, f in fitted.items()},
                                    "item_us": {vs: f[1] for vs, f in fitted.items()},
                                    "stage1_us": stage1_us, "launch_us": 0.0, "cp_segment_chunks": [10 ** 6]})
    for r in rows:
        r["est"] = _score(model, _chunks(r["row"]), r["hv"], SM, r["vs"], 0)
    resid = sorted(r["total"] - r["est"] for r in rows)
    launch_us = max(0.0, statistics.median(resid[: max(1, len(resid) // 4)]))
    errs = []
    for r in rows:
        errs.append((r["est"] + launch_us - r["total"]) / r["total"])
        print(f"{r['heads']:>6} {r['row']:>10} vs{r['vs']}  measured {r['total']:8.1f} us  "
              f"model {r['est'] + launch_us:8.1f} us  {errs[-1]:+.0%}")
    print(f"\nchunk_us: {{{', '.join(f'{k}: {v[0]:.2f}' for k, v in fitted.items())}}}")
    print(f"item_us: {{{', '.join(f'{k}: {v[1]:.1f}' for k, v in fitted.items())}}}")
    print(f"stage1_us: {{{', '.join(f'{k}: {v:.3f}' for k, v in stage1_us.items())}}}\nlaunch_us: {launch_us:.1f}")
    print(f"RMS relative error {_rms(errs):.1%} over {len(errs)} timings")
    # Does the model pick the measured-best split per (heads, row)?
    best = {}
    for r in rows:
        best.setdefault((r["heads"], r["row"]), []).append((r["total"], r["est"], r["vs"]))
    agree = sum(min(v)[2] == min(v, key=lambda t: t[1])[2] for v in best.values())
    print(f"model's split = measured-best split on {agree}/{len(best)} (heads, row) pairs")


def _cp_score(model, r) -> float:
    hv = int(r["heads"].split("/")[1])
    _, vs, L = parse_plan_label(r["qla_plan"])
    return _score(model, _chunks(r["row"]), hv, SM, vs, L)


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
    for ratio in [x / 20 for x in range(2, 31)]:
        for fixed in (0.0, 5.0, 10.0, 20.0, 30.0, 40.0, 60.0):
            for level in (0.0, 0.5, 1.0, 2.0, 3.0):
                m = base.model_copy(update={"cp_maps_ratio": ratio, "cp_fixed_us": fixed, "cp_level_us": level})
                rms = _rms([(_cp_score(m, r) - r["qla_gpu_ms"] * 1e3) / (r["qla_gpu_ms"] * 1e3) for r in recs])
                excess = pick_excess(m)
                fits.append((round(max(excess), 2), round(sum(excess), 2), rms, ratio, fixed, level, m))
    _, _, rms, ratio, fixed, level, m = min(fits, key=lambda t: t[:3])
    for r in recs:
        print(f"{r['heads']:>6} {r['row']:>10} {r['qla_plan']:>12}  measured {r['qla_gpu_ms'] * 1e3:8.1f} us  "
              f"model {_cp_score(m, r):8.1f} us")
    print(f"\ncp_maps_ratio: {ratio}\ncp_fixed_us: {fixed}\ncp_level_us: {level}\n"
          f"RMS relative error {rms:.1%} over {len(recs)} timings")
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
