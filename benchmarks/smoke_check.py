"""The engine-ops smoke scripts' check (vllm_ops_smoke.py, sglang_ops_smoke.py): each comparison
printed with its max abs difference, the run's verdict at the end."""

from __future__ import annotations

import sys


class Checks:
    def __init__(self):
        self.ok = True

    def __call__(self, name, a, b, tol) -> None:
        """Compare tensors ``a`` and ``b``: max |a - b| <= tol (empty tensors pass)."""
        err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        good = err <= tol
        self.ok &= good
        print(f"{'ok ' if good else 'BAD'} {name}: max|diff|={err:.3e} (tol {tol})")

    def exit(self):
        """Print SMOKE PASS / FAIL and exit with 0 / 1."""
        print("SMOKE", "PASS" if self.ok else "FAIL")
        sys.exit(0 if self.ok else 1)
