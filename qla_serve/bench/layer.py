"""`qla-serve bench layer`: ONE GDN layer per engine step, as the engines run it.

One call is an engine GDN layer's core for one step (the work behind vLLM's
``qwen_gdn_attention_core``): causal conv1d (width 4, SiLU, bias) of ``mixed_qkv`` with the per-slot
conv cache, gating from the raw ``a``/``b``, q/k L2 norm, the GDN recurrence on the paged SSM cache,
outputs into ``out``; spec decodes (vLLM's MTP: ``sNxD`` rows, each draft position's state into
its own slot) first, then decodes, then prefills in the token layout. Caches are vLLM-shaped
(``--pool paged``, the default): one page per slot holding the conv state ([S, dim, W-1], a
transposed strided view, bf16) and the SSM state ([S, Hv, 128, 128], fp32 or bf16, page stride >
one slot); slot 0 is vLLM's null block and never used; the pool holds more slots than the batch and
each sequence gets a random slot. Inputs are fresh random bf16 ``mixed_qkv``/``a``/``b`` (never
zeros), fp32 ``A_log`` ~ U(-1, 0.5) (``--decay weak``, the default; ``--decay init``: log U(1, 16),
near the models' initialisation A ~ U(0, 16)) and ``dt_bias`` = softplus^-1(U(0.001, 0.1)), so g = -exp(A_log)
softplus(a + dt_bias) is negative and small, with a quarter of the heads at A_log = -12 (g ~ 0);
random initial conv and SSM states; prefills alternate resumed (has_initial_state) and new. The
decay matters to qla_serve's context-parallel prefill only (weak decay: every head takes the exact
maps pass; benchmarks/layer.md). The rows, inputs and caches are built in bench/layer_inputs.py.

Implementations, same inputs and caches:

* ``qla``: qla_serve's adapter core. :func:`qla_serve.backends.gdn_layer.make_step_plan` once per
  step, then :func:`~qla_serve.backends.gdn_layer.gdn_layer_forward`. The step's slot ids (engine
  ids -> the ops' int32 ids, on the device) are derived with the plan, outside the timed layer
  call: an engine derives them in its first GDN layer of the step and every later layer reuses
  them. The median host time of both (plan and derivation, once per step; the engine's slot and
  has_initial_state tensors already on the device, as its metadata builder hands them) is the
  "plan host us" column; the derivation's GPU time is the JSON's ``step_ids_gpu_us``.
* ``fla``, ``flashinfer``, ``vllm``: the same layer composed from other libraries' ops
  (bench/layer_composed.py, and composed_vllm.py for vLLM's, say exactly which and how each is
  called). Rows with spec decodes:
  ``vllm`` only (its Triton spec path); the others report that they compose no spec step.
* ``sglang``, ``sglang_qla`` (decode-only or prefill-only rows, ``--pool sglang``): SGLang 0.5.23's
  decode or extend step, with its own core (packed decode; FlashInfer's prefill) or with qla_serve's
  SGLang kernel after SGLang's conv; ``sglang_fused``, ``sglang_fused_qla``, ``qla_split``: the
  decode from Qwen3.5's projections (composed_sglang.py).

Timing (GPU, the same helpers as ``bench prefill`` / ``bench decode``):

* decode-only rows: CUDA-graph replay. One graph holds one layer call per disjoint slot set of the
  pool (enough sets that the states come from HBM, not L2; each set has its own step plan), replayed
  ``--reps`` times; the median per call (``bench.decode._graph_time_us``). An impl whose call cannot
  be captured gets "n/a" with the reason (and, for information, the profiler's kernel sum over eager
  calls in the JSON as ``profiler_us``).
* rows with prefills: ``bench.prefill._gpu_time_ms``: CUDA-graph replay of ``--graph-calls`` calls
  (median of ``--reps`` replays), or where capture fails the profiler's kernel sum over eager calls
  ("profiler" in the timing column).
* host: ``host wall us`` = perf_counter around one eager call with a sync after it (nothing
  subtracted), ``host issue us`` = the same call's CPU time to issue it, without the sync; medians of
  ``--host-reps`` calls, each started on an idle GPU.

``--check`` (before timing): every impl runs once from the same initial caches (restored byte for
byte); outputs, final SSM states and conv states are compared with qla's in float64: the max over the
batch's sequences of ||x - x_qla|| / ||x_qla||.

CPU testing (tests/test_bench_layer.py): the composed layers take their ops as a
``layer_composed.ComposedOps``, so the test runs them on CPU tensors with torch stand-ins for the
libraries' kernels (written from their documented contracts) and checks them against qla_serve's
CPU path through ``gdn_layer_forward``. The real Triton/CUDA ops run only on the GPU.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import statistics
import time
from typing import Callable

from . import source_commit
from .layer_composed import COMPOSED, LOADERS, SGLANG_LAYOUT_IMPLS, composed_call, composed_step
from .layer_inputs import (CONV_WIDTH, DECAYS, MAX_SLOT_SETS, NAMED_ROWS, NULL_SLOT, LayerCase, Row,
                           make_caches, parse_row, positive_int, slot_sets_for)

# The inputs are layer_inputs.py's; the benchmark scripts and tests reach them as layer.X too.
__all__ = ["CONV_WIDTH", "DECAYS", "MAX_SLOT_SETS", "NAMED_ROWS", "NULL_SLOT", "LayerCase", "Row", "make_caches",
           "parse_row", "slot_sets_for", "add_arguments", "run", "main"]

COMPOSED_IMPLS = tuple(COMPOSED)              # fla, flashinfer, vllm, the sglang ones (bench/layer_composed.py)
IMPLS = ("qla", *COMPOSED_IMPLS)
# --impls' default: the sglang impls run decode-only rows on --pool sglang, not the default rows
DEFAULT_IMPLS = tuple(i for i in IMPLS if i not in SGLANG_LAYOUT_IMPLS)
POOLS = ("paged", "compact", "sglang")
STATE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
PREFILL_HEADS = [(2, 8), (4, 16), (16, 64)]
PREFILL_ROWS = ["1x32768", "1x8192", "16x512", "4x8192", "mixed"]
DECODE_ROWS = {(2, 8): ["d1", "d32", "d256"], (16, 32): ["d64", "d256"]}
# vLLM's MTP steps (2 drafts): spec decodes alone (its FULL decode graphs) and beside a chunked prefill
SPEC_ROWS = {(2, 8): ["s32x3", "s8x3+4x512"]}


# ---------------------------------------------------------------------------------------------
# Arguments (rows: layer_inputs.py)
# ---------------------------------------------------------------------------------------------

def parse_heads(text: str) -> list[tuple[int, int]]:
    """``Hk/Hv`` pairs, comma-separated (TP-local heads; Hv a multiple of Hk)."""
    pairs = []
    for item in text.split(","):
        try:
            hk, hv = (positive_int(x) for x in item.split("/"))
        except ValueError:
            raise ValueError(f"heads: expected Hk/Hv pairs like 2/8,16/64, got {item!r}") from None
        if hv % hk:
            raise ValueError(f"heads {item}: Hv ({hv}) must be a multiple of Hk ({hk})")
        pairs.append((hk, hv))
    return pairs


def _list_of(choices, what):
    """An argparse type: a comma-separated subset of ``choices``."""
    def parse(text):
        items = [x for x in text.split(",") if x]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{what}: expected a comma-separated subset of "
                                             f"{','.join(choices)}, got {text!r}")
        return items
    return parse


def _argtype(fn):
    """An argparse type from a parser raising ValueError (its message becomes argparse's)."""
    def parse(text):
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = fn.__name__
    return parse


def _rows_arg(text: str) -> list[Row]:
    """Rows separated by ',' (``mixed``'s lengths are joined by '+' inside a row)."""
    rows = [parse_row(r) for r in text.split(",") if r.strip()]
    if not rows:
        raise ValueError("rows: expected at least one row")
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's options; every value is validated by its argparse type (usage error, exit 2)."""
    dflt = ", ".join(f"{hk}/{hv}: {' '.join(r + SPEC_ROWS.get((hk, hv), []))}" for (hk, hv), r in DECODE_ROWS.items())
    p.add_argument("--heads", type=_argtype(parse_heads), default=None,
                   help="Hk/Hv pairs, e.g. 2/8,16/64 (default: prefill rows at "
                        f"{','.join(f'{a}/{b}' for a, b in PREFILL_HEADS)}, decode rows at "
                        f"{','.join(f'{a}/{b}' for a, b in DECODE_ROWS)})")
    p.add_argument("--rows", type=_argtype(_rows_arg), default=None,
                   help="rows, comma-separated: NxL, L+L+..., dB (B decodes), sNxD (N spec decodes of "
                        "D = 1 + drafts tokens: vLLM's MTP steps, qla and vllm only), combined with '+' "
                        f"(d32+4x512, s8x3+4x512), or 'mixed' = {'+'.join(map(str, NAMED_ROWS['mixed']))}. Default: "
                        f"{','.join(PREFILL_ROWS)} at the prefill heads; decode and spec {dflt}")
    p.add_argument("--impls", type=_list_of(IMPLS, "impls"), default=list(DEFAULT_IMPLS),
                   help=f"subset of {','.join(IMPLS)} (default: {','.join(DEFAULT_IMPLS)}; an impl whose "
                        "library is missing reports 'not installed'; the sglang ones and qla_split "
                        "run with --pool sglang, sglang and sglang_qla on decode-only or prefill-only "
                        "rows, the others on decode-only rows)")
    p.add_argument("--states", type=_list_of(tuple(STATE_DTYPES), "states"), default=["fp32", "bf16"],
                   help="SSM state dtypes of decode-only rows (default fp32,bf16)")
    p.add_argument("--prefill-states", type=_list_of(tuple(STATE_DTYPES), "prefill-states"),
                   default=["fp32"], help="SSM state dtypes of rows with prefills (default fp32)")
    p.add_argument("--pool", choices=POOLS, default="paged",
                   help="cache layout: paged (vLLM: conv and SSM state in one page per slot, page "
                        "stride > slot), compact (separate contiguous tensors) or sglang (SGLang's "
                        "mamba pool: conv [S, dim, W-1] window-contiguous, SSM [S, Hv, 128, 128]; the "
                        "sglang impls run on it only)")
    p.add_argument("--cp", choices=("auto", "exact", "off"), default="auto",
                   help="qla_serve's planner cp mode (make_step_plan's cp)")
    p.add_argument("--reps", type=_argtype(positive_int), default=20, help="graph replays (median taken)")
    p.add_argument("--graph-calls", type=_argtype(positive_int), default=5,
                   help="layer calls per graph on rows with prefills")
    p.add_argument("--host-reps", type=_argtype(positive_int), default=20, help="eager calls for host time")
    p.add_argument("--plan-reps", type=_argtype(positive_int), default=50, help="step plans for plan host time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decay", choices=DECAYS, default="weak",
                   help="the heads' decay rates A = exp(A_log): weak, U(0.37, 1.65) (the default; every "
                        "head keeps its past long, so qla's context-parallel passes take the exact path), "
                        "or init, U(1, 16) (bench prefill's draw, near the models' initialisation, A ~ U(0, "
                        "16) in the Qwen3-Next/3.5 modeling code; stronger decay lets qla's CP segments "
                        "start cold); a quarter of "
                        "the heads at A_log = -12 (g ~ 0) either way")
    p.add_argument("--check", action="store_true",
                   help="before timing, run every impl once from the same caches and report the max "
                        "relative L2 difference (float64) of outputs, SSM and conv states from qla's")
    p.add_argument("--json", metavar="PATH", default=None, help="write every figure as JSON")
    p.add_argument("--plot", metavar="PATH", default=None, help="write a PNG of GPU us per row (matplotlib)")


def schedule(heads, rows, states, prefill_states) -> list[tuple[int, int, Row, str]]:
    """(Hk, Hv, row, state dtype) points to time. ``heads``/``rows`` None: the defaults (prefill
    rows at PREFILL_HEADS, DECODE_ROWS and SPEC_ROWS at their heads; given heads alone take their default rows,
    given rows alone run at every default head pair). Decode-only rows run once per ``states``,
    rows with prefills once per ``prefill_states``."""
    if heads is None:
        heads = PREFILL_HEADS + [h for h in DECODE_ROWS if h not in PREFILL_HEADS]
    out = []
    for hk, hv in heads:
        if rows is not None:
            hrows = rows
        else:
            names = ((PREFILL_ROWS if (hk, hv) in PREFILL_HEADS else []) + DECODE_ROWS.get((hk, hv), [])
                     + SPEC_ROWS.get((hk, hv), []))
            hrows = [parse_row(n) for n in (names or PREFILL_ROWS + ["d1", "d32", "d256"])]
        for row in hrows:
            for st in (states if row.decode_only else prefill_states):
                out.append((hk, hv, row, st))
    return out


# ---------------------------------------------------------------------------------------------
# qla: the adapters' layer function
# ---------------------------------------------------------------------------------------------

def qla_step(case: LayerCase, i: int, cp: str = "auto"):
    """The step plan of slot set i, as an adapter builds it once per step. Its slot ids are
    derived here, once (an engine's first GDN layer of the step derives them, every later layer
    reuses them): a layer call then times one layer's work, as the composed layers' calls do
    (their ids are uploaded per step). :func:`step_ids_gpu_us` times the derivation itself."""
    step = _qla_plan(case, i, cp)
    for kind in step_id_kinds(step):
        step.ids(kind)
    return step


def step_id_kinds(step) -> list[str]:
    """The slot-id kinds a bench step's layers ask for (its rows hold spec decodes, decodes and
    prefills)."""
    spec = ["spec", "spec_conv", "num_accepted", "spec_cu_seqlens"] if step.num_spec_decodes else []
    return spec + ["decode"] * bool(step.num_decodes) + ["prefill"] * (step.prefill_plan is not None)


STEP_IDS_PER_GRAPH = 32


def step_ids_gpu_us(case: LayerCase, reps: int) -> float:
    """GPU us of one step's slot-id derivation (StepPlan.ids for every kind the step uses): what
    an engine pays once per step on top of its layers' calls. A CUDA graph of
    STEP_IDS_PER_GRAPH derivations, per derivation, so that the graph's own launch latency (a few
    us, more than these small kernels take) is spread over them as it is over a step's layers."""
    import torch

    from qla_serve.bench import decode as bdec

    step = _qla_plan(case, 0, "auto")
    kinds = step_id_kinds(step)
    fns = [lambda: [step._derive(k) for k in kinds]] * STEP_IDS_PER_GRAPH
    return bdec._graph_time_us(torch, fns, reps)


def _qla_plan(case: LayerCase, i: int, cp: str):
    from qla_serve.backends import gdn_layer

    ds, ps, has = case.slots(i)
    spec = {}
    if case.row.spec:     # the spec tokens lead, no token indices: what the vLLM adapter hands it
        slots, cu, acc = case.spec_slots(i)
        spec = dict(spec_slots=slots, spec_cu_seqlens=cu, num_accepted=acc, num_spec_tokens=case.row.spec_tokens)
    return gdn_layer.make_step_plan(
        num_actual_tokens=case.row.tokens, num_v_heads=case.hv, num_k_heads=case.hk,
        conv_width=CONV_WIDTH, device=case.device, decode_slots=ds,
        prefill_lens=list(case.row.prefill_lens), prefill_slots=ps,
        prefill_has_initial_state=has, null_slot=NULL_SLOT, cp=cp, **spec)


# The GDN layers of a step a bench call cycles through (Qwen3-Next's 36 of 48 layers).
STEP_LAYERS = 36


def qla_call(case: LayerCase, step) -> Callable[[], None]:
    """One layer call of qla_serve's adapter core on the case's tensors, for ``step``: successive
    calls go through STEP_LAYERS sets of views of those tensors, each set standing for one GDN
    layer's own tensors (the same memory: the GPU work is the same). An engine calls each layer
    of a step on its own tensors, and from the step's third layer on the layer replays the
    launches that the step recorded (backends/launch_replay.py); one set of tensors called over
    and over would never replay (the recording waits for other layer tensors)."""
    import torch

    from qla_serve.backends import gdn_layer

    kw = case.layer_kwargs()

    def views(x):
        return x.view(x.shape) if isinstance(x, torch.Tensor) else x
    layers = itertools.cycle([((views(case.mixed_qkv), views(case.a), views(case.b)),
                               {k: views(v) for k, v in kw.items()}) for _ in range(STEP_LAYERS)])

    def call():
        (x, a, b), layer = next(layers)
        gdn_layer.gdn_layer_forward(step, x, a, b, activation="silu", scale=None, **layer)
    return call


# ---------------------------------------------------------------------------------------------
# --check
# ---------------------------------------------------------------------------------------------

def seq_bounds(row: Row) -> list[tuple[int, int]]:
    """(first, end) token of each sequence of the row's step: spec decodes, decodes, then prefills."""
    lens = [row.spec_len] * row.spec + [1] * row.decodes + list(row.prefill_lens)
    return [(e - n, e) for n, e in zip(lens, itertools.accumulate(lens))]


def run_check(case: LayerCase, calls: dict) -> dict:
    """Every call once from the same caches (slot set 0); for each impl other than "qla", the max
    over the batch's sequences of the relative L2 difference (float64) from qla's output, and over
    its slots (a spec decode's one per token) of the final SSM state and conv state:
    ``{impl: {"o_rel", "ssm_rel", "conv_rel"}}`` (or ``{"error"}``). The caches are restored
    afterwards."""
    import torch

    snap = case.snapshot()
    ids = torch.tensor(case.slot_sets[0], dtype=torch.long, device=case.device)
    bounds = seq_bounds(case.row)
    res, errors = {}, {}
    for impl, fn in calls.items():
        case.restore(snap)
        case.out.fill_(float("nan"))
        try:
            fn()
            res[impl] = (case.out.clone(), case.ssm_state[ids].clone(), case.conv_state[ids].clone())
        except Exception as exc:  # noqa: BLE001 - one impl failing must not hide the others
            errors[impl] = f"{type(exc).__name__}: {exc}"[:300]
    case.restore(snap)
    rec = {}
    for impl in calls:
        if impl != "qla":
            err = errors.get(impl) or ("qla: " + errors.get("qla", "did not run") if "qla" not in res else None)
            rec[impl] = {"error": err} if err else _differences(res[impl], res["qla"], bounds)
    return rec


def _differences(got, want, bounds) -> dict:
    """Max over sequences of rel_l2 of the out rows, over slots of the SSM and conv states, from
    ``want``'s."""
    from qla_serve.kernels.reference import rel_l2

    (o, s, c), (o0, s0, c0) = got, want
    slots = range(s.shape[0])
    return {"o_rel": max(rel_l2(o[lo:hi], o0[lo:hi]) for lo, hi in bounds),
            "ssm_rel": max(rel_l2(s[j], s0[j]) for j in slots),
            "conv_rel": max(rel_l2(c[j], c0[j]) for j in slots)}


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def host_us(fn, reps: int) -> tuple[float, float]:
    """(median wall us of one eager call: perf_counter around the call and a sync after it;
    median us to issue it: the same call without the sync). Each call starts on an idle GPU."""
    import torch

    walls, issues = [], []
    torch.cuda.synchronize()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issues.append(t1 - t0)
        walls.append(t2 - t0)
    return statistics.median(walls) * 1e6, statistics.median(issues) * 1e6


def median_us(fn, reps: int) -> float:
    """Median host us of fn() (host code: no sync)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _steps_and_calls(impl, case, args, ops):
    """(per-step plan function of set i, the layer call of a step) for impl."""
    if impl == "qla":
        return (lambda i: qla_step(case, i, args.cp)), (lambda st: qla_call(case, st))
    return (lambda i: composed_step(case, i, impl)), (lambda st: composed_call(impl, case, st, ops))


def _graph_us(fns, reps) -> dict:
    """GPU us per call from one CUDA graph holding every call of ``fns`` (bench decode's helper);
    where capture fails, "n/a" with the reason and the profiler's kernel sum of eager calls."""
    import torch

    from qla_serve.bench import decode as bdec
    from qla_serve.bench import prefill as bpre

    try:
        return {"gpu_us": round(bdec._graph_time_us(torch, fns, reps), 3), "timing": "graph"}
    except Exception as exc:  # noqa: BLE001 - n/a with the reason
        torch.cuda.synchronize()
        rec = {"gpu_us": None, "timing": "n/a", "gpu_na": f"not capturable: {type(exc).__name__}: {exc}"[:300]}
    try:
        rec["profiler_us"] = round(bpre._kernel_sum_ms(fns[0], reps) * 1e3, 3)
    except Exception:  # noqa: BLE001 - informational only
        pass
    return rec


def time_impl(impl, case: LayerCase, nsets: int, args, ops) -> dict:
    """GPU, host and plan figures of one impl on one row (see the module docstring)."""
    import torch

    from qla_serve.bench import prefill as bpre

    plan, call = _steps_and_calls(impl, case, args, ops)
    rec = {"plan_host_us": round(median_us(lambda: plan(0), args.plan_reps), 2)}
    fns = [call(plan(i)) for i in range(nsets)]
    fns[0]()
    torch.cuda.synchronize()
    if case.row.decode_only:
        rec.update(_graph_us(fns, args.reps))
    else:
        ms, how, eager = bpre._gpu_time_ms(fns[0], args.reps, args.graph_calls)
        rec["gpu_us"], rec["timing"] = round(ms * 1e3, 3), how
        if eager is not None:
            rec["eager_events_us"] = round(eager * 1e3, 3)
    wall, issue = host_us(fns[0], args.host_reps)
    rec["host_wall_us"], rec["host_issue_us"] = round(wall, 2), round(issue, 2)
    rec["slot_sets"] = nsets
    if impl == "qla":
        rec["step_ids_gpu_us"] = round(step_ids_gpu_us(case, args.reps), 3)
    return rec


def load_ops(impls) -> tuple[dict, dict]:
    """({impl: ComposedOps}, {impl: why not}) for the composed impls asked for."""
    ops, missing = {}, {}
    for impl in impls:
        if impl in LOADERS:
            try:
                ops[impl] = LOADERS[impl]()
            except Exception as exc:  # noqa: BLE001 - ImportError, or a library failing to load
                missing[impl] = f"not installed ({type(exc).__name__}: {exc})"[:300]
    return ops, missing


def _first_calls(case, args, ops) -> dict:
    """{impl: the layer call on slot set 0} of every impl asked for that can run."""
    calls = {}
    for impl in args.impls:
        if impl == "qla":
            calls[impl] = qla_call(case, qla_step(case, 0, args.cp))
        elif impl in ops:
            calls[impl] = composed_call(impl, case, composed_step(case, 0, impl), ops[impl])
    return calls


def run_point(hk, hv, row, state, args, ops, missing, device="cuda") -> dict:
    """Every impl on one (heads, row, state dtype) point: the JSON record of the point."""
    import torch

    from qla_serve.bench import decode as bdec

    sdt = getattr(torch, STATE_DTYPES[state])
    nsets = slot_sets_for(row, hv, sdt, bdec.L2_FLUSH_BYTES)
    case = LayerCase(hk, hv, row, sdt, device, nsets=nsets, seed=args.seed, layout=args.pool, decay=args.decay)
    rec = {"heads": f"{hk}/{hv}", "row": row.name, "state": state, "tokens": row.tokens,
           "decodes": row.decodes, "prefills": len(row.prefill_lens), "spec_decodes": row.spec, "impls": {}}
    if args.check:
        rec["check"] = run_check(case, _first_calls(case, args, ops))
    for impl in args.impls:
        if impl in missing:
            rec["impls"][impl] = {"error": missing[impl]}
            continue
        try:
            rec["impls"][impl] = time_impl(impl, case, nsets, args, ops.get(impl))
        except Exception as exc:  # noqa: BLE001 - recorded, not hidden
            torch.cuda.synchronize()
            rec["impls"][impl] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    q = rec["impls"].get("qla", {}).get("gpu_us")
    for impl in COMPOSED_IMPLS:
        other = rec["impls"].get(impl, {}).get("gpu_us")
        if q and other:
            rec[f"qla_over_{impl}"] = round(q / other, 3)
    del case
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

def _cell(x, fmt="{:.1f}"):
    """A table cell: x formatted, or "-" when absent."""
    return "-" if x is None else fmt.format(x)


def format_table(results) -> str:
    """Markdown table: one line per (point, impl)."""
    head = ["heads", "row", "state", "impl", "GPU us", "timing", "host wall us", "host issue us",
            "plan host us", "qla/impl"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        for impl, x in r["impls"].items():
            if "error" in x:
                cells = [x["error"][:80], "", "", "", "", ""]
            else:
                gpu = _cell(x.get("gpu_us")) if x.get("gpu_us") is not None else "n/a"
                cells = [gpu, x.get("timing", ""), _cell(x.get("host_wall_us")),
                         _cell(x.get("host_issue_us")), _cell(x.get("plan_host_us")),
                         _cell(r.get(f"qla_over_{impl}"), "{:.3f}")]
            lines.append("| " + " | ".join([r["heads"], r["row"], r["state"], impl] + cells) + " |")
    notes = [f"- {r['heads']} {r['row']} {r['state']} {i}: {x['gpu_na']}"
             for r in results for i, x in r["impls"].items() if x.get("gpu_na")]
    return "\n".join(lines + (["", "n/a:"] + notes if notes else [])) + "\n"


def format_check(results) -> str:
    """Markdown table of --check: max relative L2 difference from qla per sequence."""
    lines = ["| heads | row | state | impl | o rel | ssm rel | conv rel |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for impl, c in r.get("check", {}).items():
            cells = ([c["error"][:80], "", ""] if "error" in c else
                     [f"{c['o_rel']:.2e}", f"{c['ssm_rel']:.2e}", f"{c['conv_rel']:.2e}"])
            lines.append("| " + " | ".join([r["heads"], r["row"], r["state"], impl] + cells) + " |")
    return "\n".join(lines) + "\n"


def _versions(missing) -> dict:
    """Library versions (or why not loaded)."""
    import importlib

    out = {}
    for name in ("torch", "fla", "flashinfer", "triton", "vllm"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            out[name] = f"not installed ({type(exc).__name__})"
    out.update({f"{k}_status": v for k, v in missing.items()})
    return out


def plot(results, impls, path) -> None:
    """Bars of GPU us per point and impl (log scale), if matplotlib imports."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"bench layer: matplotlib not installed, no plot written ({path})")
        return
    labels = [f"{r['heads']} {r['row']} {r['state']}" for r in results]
    fig, ax = plt.subplots(figsize=(max(8, len(results) * 0.6), 4.5))
    w = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        ys = [r["impls"].get(impl, {}).get("gpu_us") or math.nan for r in results]
        ax.bar([i + j * w for i in range(len(results))], ys, w, label=impl)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(results))], labels, rotation=90, fontsize=7)
    ax.set_ylabel("GPU us per layer call")
    ax.set_yscale("log")
    ax.set_title("one GDN layer per step (conv + gating + recurrence + cache updates)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"bench layer: plot {path}")


def run(args) -> int:
    """Time every point of the schedule; 2 without a CUDA GPU."""
    os.environ["FLA_FLASH_QLA"] = "0"           # FLA's own Triton kernels, before fla is imported
    import torch

    if not torch.cuda.is_available():
        print("bench layer: needs a CUDA GPU")
        return 2
    import qla_serve

    points = schedule(args.heads, args.rows, args.states, args.prefill_states)
    if args.pool == "sglang":   # spec rows are vLLM's MTP steps (its conv window and per-token slots)
        if any(row.spec for row in args.rows or ()):
            print("bench layer: rows with spec decodes (sNxD) are vLLM's MTP steps: run them on --pool paged "
                  "or compact (SGLang's verify step: benchmarks/sglang_verify.py)")
            return 2
        points = [p for p in points if not p[2].spec]
    ops, missing = load_ops(args.impls)
    for impl, why in missing.items():
        print(f"bench layer: {impl}: {why}")
    dev = torch.device("cuda", torch.cuda.current_device())
    meta = {"commit": source_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "gpu": torch.cuda.get_device_name(), "versions": _versions(missing),
            "FLA_FLASH_QLA": os.environ["FLA_FLASH_QLA"],
            "qla_paths": {op: list(qla_serve.explain_path(op, dev)) for op in ("prefill", "decode")},
            "args": {k: v for k, v in vars(args).items() if k not in ("fn", "heads", "rows")},
            "points": [f"{hk}/{hv} {row.name} {st}" for hk, hv, row, st in points]}
    print(f"bench layer: {meta['gpu']}, commit {meta['commit']}, {len(points)} points")
    results = []
    for hk, hv, row, st in points:
        rec = run_point(hk, hv, row, st, args, ops, missing)
        print(json.dumps(rec), flush=True)
        results.append(rec)
    report(results, meta, args)
    return 0


def report(results, meta, args) -> None:
    """The tables on stdout, then --json and --plot."""
    print(format_table(results))
    if args.check:
        print(format_check(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "results": results}, f, indent=1)
        print(f"bench layer: JSON {args.json}")
    if args.plot:
        plot(results, args.impls, args.plot)


def main(argv=None) -> int:
    """``python -m qla_serve.bench.layer``: the same as ``qla-serve bench layer``."""
    p = argparse.ArgumentParser(prog="qla-serve bench layer", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
