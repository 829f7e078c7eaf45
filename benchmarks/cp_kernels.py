"""Time the context-parallel helper kernels alone on a GPU: the scan (prefill_scan.py) as
shipped (rows of X per block chosen per launch: "rows" 0) and forced to 2, 4 and 8 rows, and
the warmup finder (prefill_warmup.py), at the shapes the bench rows give them
(benchmarks/prefill.md, v18). Each scan variant is first checked against the
float64 recurrence on the same inputs. GPU time per launch: CUDA-graph replay, median.

    python benchmarks/cp_kernels.py [--rows 0,2,4,8] [--json out.json]

Scan cases (Hv, heads that need maps, levels): the bench's gates put a quarter of the heads on
the exact path; "all" has every head there (cp="exact", or heads that do not decay).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCAN_CASES = [  # (label, Hv, heads needing maps, maps = segments - 1; the scan takes maps - 1 steps)
    ("2/8 1x32768 L32", 8, 2, 15),
    ("2/8 all heads exact, 16 segments", 8, 8, 15),
    ("8/24 1x32768 L64", 24, 6, 7),
    ("16/32 1x32768 L128", 32, 8, 3),
]
FINDER_CASES = [  # (label, Hv, segments, L)
    ("2/8 1x32768 L32", 8, 16, 32),
    ("2/8 1x8192 L8", 8, 16, 8),
    ("2/8 1x8192 L16", 8, 8, 16),
    ("16/32 1x32768 L128", 32, 4, 128),
]


def _scan_case(torch, hv, need_heads, levels, gen):
    maps = torch.randn(levels, hv, 2, 128, 128, generator=gen, device="cuda")
    maps[:, :, 1] *= 0.3 / 128**0.5  # transitions of norm < 1: repeated launches stay bounded
    need = torch.zeros(1, hv, dtype=torch.int32, device="cuda")
    need[0, :need_heads] = 1
    return maps, torch.tensor([levels], dtype=torch.int32, device="cuda"), need


def _scan_error(torch, scan, maps0, cut_levels, need, sm_count):
    """Largest relative error of the scanned states against the float64 recurrence."""
    from qla_serve.kernels import reference

    maps = maps0.clone()
    scan(maps, cut_levels, need, 1, sm_count)
    want = reference.scan_segment_maps(maps0.double(), cut_levels.tolist(), skip=need == 0)
    return max(float((maps[lvl, h, 0].double() - want[lvl, h, 0]).norm() / want[lvl, h, 0].norm())
               for lvl in range(1, int(cut_levels[0])) for h in range(int(need.sum())))


def _finder_case(torch, hv, nseg, L, gen):
    nchunk = nseg * L
    fbuf = torch.rand(nchunk, hv, 2, 64, generator=gen, device="cuda")
    log_decay = -25 * torch.rand(nchunk, hv, generator=gen, device="cuda")  # the bench's decays
    log_decay[:, : max(1, hv // 4)] = 0.0  # and its g = 0 heads, which walk the whole cap
    fbuf[:, :, 0, 63] = log_decay.exp()
    offs = torch.tensor([0, nchunk], dtype=torch.int32, device="cuda")
    cuts = torch.tensor([[0, nseg, 0]], dtype=torch.int32, device="cuda")
    warm = torch.empty(nseg, hv, dtype=torch.int32, device="cuda")
    need = torch.empty(1, hv, dtype=torch.int32, device="cuda")
    return fbuf, offs, cuts, warm, need


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="0,2,4,8", help="scan variants: rows of X per block (0: chosen per launch)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from qla_serve.bench.prefill import _gpu_time_ms
    from qla_serve.kernels.hopper import prefill_api as P

    gen = torch.Generator(device="cuda").manual_seed(0)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for label, hv, need_heads, levels in SCAN_CASES:
        maps0, cut_levels, need = _scan_case(torch, hv, need_heads, levels, gen)
        for rows in (int(r) for r in args.rows.split(",")):
            scan = P.build(P.scan_variant(hv, rows))
            err = _scan_error(torch, scan, maps0, cut_levels, need, sm_count)
            maps = maps0.clone()
            us = _gpu_time_ms(lambda: scan(maps, cut_levels, need, 1, sm_count), args.reps, 10)[0] * 1e3
            rec = {"kernel": "scan", "case": label, "rows": rows, "us": round(us, 2), "max_rel_err": err}
            print(json.dumps(rec), flush=True)
            results.append(rec)
    for label, hv, nseg, L in FINDER_CASES:
        fn = P.build(P.warmup_variant(hv))  # kept in-process: a second build is a dict lookup
        fbuf, offs, cuts, warm, need = _finder_case(torch, hv, nseg, L, gen)
        cap = P.max_warmup_chunks(L)
        us = _gpu_time_ms(lambda: fn(fbuf, offs, cuts, warm, need, L, cap), args.reps, 10)[0] * 1e3
        rec = {"kernel": "warmup_finder", "case": label, "us": round(us, 2)}
        print(json.dumps(rec), flush=True)
        results.append(rec)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
