"""`qla-serve bench prefill --breakdown`: stage 2 timed apart runs on stage 1's real outputs.

bench/prefill._qla_fn(stages="main") builds a plan whose stage-1 scratch (gates, P, M) nothing
has written; stage 2 reads it, and on context-parallel plans the warmup finder's choices follow
its gates, so the figure depended on leftover memory (session 57 saw 0.098 against 0.207 ms for
one row). The function now runs stage 1 once on the same plan first. The Hopper kernels cannot
run on this machine, so the kernel module is a stand-in that records each call's stages and
plan: what is checked is the bench's call order, not the kernels."""

import types

import torch

from qla_serve import ops
from qla_serve.bench import prefill as B


def _recording_module(calls):
    def prefill(q, k, v, g, beta, pool, slots, plan, has_initial_state=None, scale=None, out=None,
                _stages="prep,main"):
        calls.append((_stages, id(plan)))
    return types.SimpleNamespace(prefill=prefill, SUPPORTED_STRATEGIES=frozenset({"plain", "vsplit", "cp"}))


def _data(lens, hk=2, hv=8):
    T = sum(lens)
    return (torch.zeros(T, hk, 128), torch.zeros(T, hk, 128), torch.zeros(T, hv, 128),
            torch.zeros(T, hv), torch.zeros(T, hv), torch.zeros(len(lens), hv, 128, 128))


def _as_hopper(monkeypatch, calls):
    monkeypatch.setattr(ops, "device_arch", lambda dev: "sm90")
    monkeypatch.setattr(ops, "kernel_module", lambda arch: _recording_module(calls))


def _run(monkeypatch, stages):
    calls = []
    _as_hopper(monkeypatch, calls)
    fn, _, _, plan = B._qla_fn([100, 30], 2, 8, _data([100, 30]), "auto", stages)
    built = list(calls)
    fn()
    return built, calls[len(built):], id(plan)


def test_stage_two_alone_runs_on_stage_one_outputs_of_its_own_plan(monkeypatch):
    built, timed, plan = _run(monkeypatch, "main")
    assert built == [("prep", plan)]  # stage 1 once, into this plan's scratch, before any timing
    assert timed == [("main", plan)]  # the timed call is stage 2 alone


def test_whole_call_and_stage_one_alone_run_nothing_ahead(monkeypatch):
    for stages in ("prep,main", "prep"):
        built, timed, plan = _run(monkeypatch, stages)
        assert built == []
        assert timed == [(stages, plan)]


def test_rows_record_stage_one_heads_per_cta(monkeypatch):
    """The JSON's qla_prep_heads is what prefill_launch._Launches would pick for the plan: the rule
    (one head while one wave of one-head CTAs holds the call) or QLA_SERVE_PREP_HEADS's choice."""
    from qla_serve.kernels.hopper import prefill_api
    _as_hopper(monkeypatch, [])
    _, _, _, plan = B._qla_fn([100, 30], 2, 8, _data([100, 30]), "auto", "prep,main")
    assert B._prep_heads(plan, 2, 8) == 1  # 3 chunks x 8 heads: one wave of one-head CTAs
    monkeypatch.setattr(prefill_api, "PREP_HEADS", 4)
    assert B._prep_heads(plan, 2, 8) == 4
    monkeypatch.setattr(prefill_api, "PREP_HEADS", 2)
    assert B._prep_heads(plan, 2, 8) == 2
