"""Refit stage 1's heads-per-CTA rule (prefill_api._PREP_COST_US) from `bench prefill` rows.

The rule models stage 1's GPU time of a call, per choice of v-heads per CTA n, as a line in the
call's chunk-heads per SM x:  t_n(x) = a_n + b_n x  (us), and takes the cheapest n
(prefill_api.prep_heads_per_cta). This script fits (a_n, b_n) by least squares over the rows of
`qla-serve bench prefill --impls qla16 --breakdown` (its --json file, or the JSON line it prints
per row, as the device scripts keep them), one sweep per heads-per-CTA setting:

    QLA_SERVE_PREP_HEADS=1|2|4 qla-serve bench prefill --impls qla16 --breakdown \
        --heads 2/8,16/64 --rows 64x512,2048x4,1024x8,1x8192,mixed8192     # on the GPU, per n
    python benchmarks/fit_prep_heads.py ROWS.jsonl [...] [--sms 132]          # anywhere

A row's n is its "qla_prep_heads" (bench prefill records it since session 59), else the
device scripts' "prep_heads" label (QLA_SERVE_PREP_HEADS, when not 0). Rows recorded before
either, in sweep order, take --by-order (e.g. `--by-order 1,2,4` for
data/prep_heads_v31_h200.jsonl: each head pair's rows ran once per setting, in that order).
Prints the fit, each point's residual, and the `_PREP_COST_US` line to paste.
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _chunks(row: str) -> int:
    """Chunks of a `bench prefill` row name (its ROWS table: the sequence lengths)."""
    from qla_serve.bench import prefill as B
    from qla_serve.plan import seq_chunks

    return sum(seq_chunks(B.ROWS[row]))


def labelled_points(rows: list[dict], by_order: list[int] | None, sms: int) -> dict[int, list[tuple]]:
    """{heads per CTA: [(chunk-heads per SM, stage-1 us, heads, row)]} from bench rows.
    by_order labels unlabelled rows: within each head pair, consecutive runs of its rows take
    the settings in this order (a row name seen again starts the next setting)."""
    points: dict[int, list[tuple]] = {}
    seen: dict[str, set] = {}
    setting: dict[str, int] = {}
    for r in rows:
        if "qla16_prep_gpu_ms" not in r:
            continue
        n = r.get("qla_prep_heads") or int(r.get("prep_heads", 0) or 0)
        if not n:
            if by_order is None:
                raise ValueError(f"row {r['heads']} {r['row']}: no qla_prep_heads / prep_heads label; pass --by-order")
            pair = r["heads"]
            if r["row"] in seen.setdefault(pair, set()):
                setting[pair] = setting.get(pair, 0) + 1
                seen[pair] = set()
            seen[pair].add(r["row"])
            if setting.get(pair, 0) >= len(by_order):
                raise ValueError(f"--by-order {by_order}: head pair {pair} has more sweeps than settings")
            n = by_order[setting.get(pair, 0)]
        hv = int(r["heads"].split("/")[1])
        x = _chunks(r["row"]) * hv / sms
        points.setdefault(int(n), []).append((x, r["qla16_prep_gpu_ms"] * 1e3, r["heads"], r["row"]))
    return points


def read_rows(path: Path) -> list[dict]:
    """Rows of a bench prefill --json file ({"results": [...]}) or of a JSON-lines file."""
    text = path.read_text()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return whole["results"] if isinstance(whole, dict) and "results" in whole else [whole]


def fit_line(pts: list[tuple]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b x through pts' (x, y)."""
    n = len(pts)
    if len({p[0] for p in pts}) < 2:
        raise ValueError(f"a line needs points at two or more x, got {[p[0] for p in pts]}")
    sx = sum(p[0] for p in pts)
    sy = sum(p[1] for p in pts)
    sxx = sum(p[0] * p[0] for p in pts)
    sxy = sum(p[0] * p[1] for p in pts)
    b = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy - b * sx) / n, b


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="JSON-lines files of bench prefill rows")
    p.add_argument("--by-order", default=None, help="heads per CTA of unlabelled sweeps, in order: 1,2,4")
    p.add_argument("--sms", type=int, default=132, help="the GPU's SMs (H100 / H200 SXM: 132)")
    args = p.parse_args(argv)
    order = [int(s) for s in args.by_order.split(",")] if args.by_order else None
    rows = [r for f in args.files for r in read_rows(Path(f))]
    points = labelled_points(rows, order, args.sms)
    fits = {}
    for n, pts in sorted(points.items()):
        a, b = fits[n] = fit_line(pts)
        print(f"{n} head(s) per CTA: {a:.2f} + {b:.3f} x us over {len(pts)} points")
        for x, y, heads, row in pts:
            print(f"    {heads:>6} {row:<10} x {x:6.1f}  {y:7.1f} us  residual {y - (a + b * x):+.1f}")
    print("_PREP_COST_US = {" + ", ".join(f"{n}: ({a:.1f}, {b:.2f})" for n, (a, b) in fits.items()) + "}")
    for (n1, (a1, b1)), (n2, (a2, b2)) in itertools.combinations(fits.items(), 2):
        cross = (a2 - a1) / (b1 - b2) if b1 != b2 else -1.0
        if cross > 0:
            print(f"{n1} and {n2} heads cross at x = {cross:.1f} chunk-heads per SM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
