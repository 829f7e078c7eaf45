"""benchmarks/fit_prep_heads.py: stage 1's heads-per-CTA rule refit from bench rows. The rule's
committed figures (prefill_api._PREP_COST_US) come back from the committed sweep they were fit
on (session 65, H100, the pair solve), and the script's labels (qla_prep_heads, the device scripts' prep_heads, --by-order) go
where they should. Recorded data only: no GPU."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "benchmarks" / "fit_prep_heads.py"
SWEEP = ROOT / "benchmarks" / "data" / "prep_heads_pair_h100.jsonl"  # rows labelled by qla_prep_heads


def _run(*args) -> list[str]:
    out = subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.splitlines()


def test_refit_of_the_committed_sweep_gives_the_committed_rule():
    from qla_serve.kernels.hopper import prefill_api

    line = [s for s in _run(SWEEP) if s.startswith("_PREP_COST_US = ")]
    assert len(line) == 1
    fitted = ast.literal_eval(line[0].split(" = ", 1)[1])  # the dict literal the script prints to paste
    assert fitted == prefill_api._PREP_COST_US


def test_labels_from_the_rows_and_errors_without_them(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("fit_prep_heads", TOOL)
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    rows = [{"heads": "2/8", "row": "2048x4", "qla16_prep_gpu_ms": 0.010, "qla_prep_heads": 2},
            {"heads": "2/8", "row": "64x512", "qla16_prep_gpu_ms": 0.040, "prep_heads": "4"},
            {"heads": "2/8", "row": "1024x8", "qla16_gpu_ms": 0.05}]  # no stage-1 figure: skipped
    points = fit.labelled_points(rows, None, 132)
    assert sorted(points) == [2, 4]
    (x, us, _, _), = points[2]
    assert x == pytest.approx(32 * 4 * 8 / 132) and us == pytest.approx(10.0)
    with pytest.raises(ValueError, match="--by-order"):
        fit.labelled_points([{"heads": "2/8", "row": "64x512", "qla16_prep_gpu_ms": 0.04}], None, 132)
    assert fit.fit_line([(1, 3.0), (2, 5.0), (3, 7.0)]) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError, match="two or more x"):
        fit.fit_line([(1, 3.0), (1, 5.0)])
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"device": "x", "results": rows}))
    assert fit.read_rows(path) == rows
