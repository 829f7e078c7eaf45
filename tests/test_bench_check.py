"""`qla-serve bench prefill --check` (bench/prefill._check_against): qla_serve's forms compared
with a baseline from the same initial states.

The timed calls leave qla_serve's pool at a later state than the row's initial one (each call
writes its final state in place), while FLA and FlashQLA start every call from the row's h0.
Before this check reran qla_serve from h0 it compared different problems (a 0.08-1.1 relative
"difference" on the H200, sixteenth session). The kernels and baselines need CUDA, so these CPU
tests stand in for them with a tiny linear recurrence that has the same in-place pool contract;
the real comparison runs on the H200 (benchmarks/prefill.md, sixteenth session; full text: `git show 99e7d48:benchmarks/prefill.md`)."""

import pytest
import torch

from qla_serve.bench.prefill import _check_against
from qla_serve.kernels.reference import rel_l2


def _stand_in(h0, x):
    """A qla_serve-shaped call: out from the pool's state, the final state written in place.
    And a baseline-shaped call that starts from h0 (given K-first) every time."""
    pool = h0.clone()
    out = torch.empty(x.shape[0], *h0.shape[1:3])  # [T, H, V]

    def qla_call():
        out.copy_(x[:, None, None] * pool[0].sum(-1))
        pool.mul_(0.5).add_(1.0)

    res = {}

    def base_call():
        state = h0.clone()
        res["o"] = (x[:, None, None] * state[0].sum(-1))[None]
        res["ht"] = (state * 0.5 + 1.0).transpose(-1, -2)  # K-first, as FLA returns it
        return res

    return qla_call, out, pool, base_call, res


def test_check_reruns_qla_from_the_initial_states():
    h0 = torch.randn(1, 2, 4, 4)
    x = torch.randn(3)
    qla_call, out, pool, base_call, res = _stand_in(h0, x)
    for _ in range(5):  # the timed calls: the pool drifts away from h0
        qla_call()
    assert rel_l2(pool, h0) > 0.1
    rec = _check_against("fla", base_call, res, {"qla": (qla_call, out, pool)}, h0)
    assert rec == {"qla_vs_fla_o_rel": 0.0, "qla_vs_fla_state_rel": 0.0}


def test_check_reports_a_real_difference():
    h0 = torch.randn(1, 2, 4, 4)
    x = torch.randn(3)
    qla_call, out, pool, base_call, res = _stand_in(h0, x)

    def off_by_a_bit():
        qla_call()
        out.mul_(1.01)

    rec = _check_against("flashqla", base_call, res, {"qla16": (off_by_a_bit, out, pool)}, h0)
    assert rec["qla16_vs_flashqla_o_rel"] == pytest.approx(0.01, rel=1e-3)
    assert rec["qla16_vs_flashqla_state_rel"] == 0.0


def test_check_reruns_an_in_place_baseline_from_the_initial_states():
    """A baseline that, like FlashInfer's prefill, writes its pool in place (bench prefill's
    flashinfer: res["from_h0"] resets its pool to h0 and runs): its timed calls leave the pool
    drifted, and the check must compare from h0 all the same."""
    h0 = torch.randn(1, 2, 4, 4)
    x = torch.randn(3)
    qla_call, out, pool, _, _ = _stand_in(h0, x)
    base_pool = h0.clone()
    base_out = torch.empty_like(out)
    res = {"o": base_out[None], "ht": base_pool.transpose(-1, -2)}

    def base_call():
        base_out.copy_(x[:, None, None] * base_pool[0].sum(-1))
        base_pool.mul_(0.5).add_(1.0)

    def from_h0():
        base_pool.copy_(h0)
        base_call()

    res["from_h0"] = from_h0
    for _ in range(5):  # both timed: both pools drift
        qla_call()
        base_call()
    rec = _check_against("flashinfer", base_call, res, {"qla": (qla_call, out, pool)}, h0)
    assert rec == {"qla_vs_flashinfer_o_rel": 0.0, "qla_vs_flashinfer_state_rel": 0.0}
    del res["from_h0"]  # without the reset the baseline would run from its drifted pool
    rec = _check_against("flashinfer", base_call, res, {"qla": (qla_call, out, pool)}, h0)
    assert rec["qla_vs_flashinfer_o_rel"] > 0.1
