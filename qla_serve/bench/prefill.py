"""`qla-serve bench prefill`: qla_serve vs FLA 0.6 (its own Triton kernels, FLA_FLASH_QLA=0) vs
FlashQLA 0.1.3 vs FlashInfer 0.7.2 (optional), in one process on the same inputs.

Inputs per row: bf16 q/k/v (unit-norm q/k), fp32 gates g = -exp(A_log) * softplus(x + dt_bias)
(A_log ~ log U(1, 16), softplus(dt_bias) ~ U(0.001, 0.1)) with a quarter of the heads at g = 0,
beta ~ U(0.01, 0.99), fp32 initial states for every sequence.
  * qla_serve: qla_serve.kernels.<arch>.prefill on a pool of N slots, plan built once (outside the
    timed region, as an engine builds it once per step for all layers).
  * qla16 (opt-in, `--impls qla,qla16,...`): the same on fp16 copies of those q/k (bf16 v), what
    the engine layers hand prefill since gdn_prefill_inputs(..., qk_dtype=torch.float16); the
    baselines take bf16 q/k, so this row is qla_serve's engine path, not the same op's inputs.
    qla16_units: qla16 with stage 2 on a CTA per (sequence, head) unit instead of the persistent
    grid (prefill_api.PERSISTENT = False; plain and V-split plans only), the A/B in one process.
    qla16_wgmma: qla16 with stage 1's wgmma solve (prefill_api.PREP_SOLVE = "wgmma"; the default is
    the mma.sync solve). qla16_fused: qla16 with the one-launch prefill (prefill_api.FUSED, off by
    default; it applies to plain plans at v_split 1, prefill_api.fused_applies: other plans run
    the two stages as qla16 does, and the row's plan says which); qla16_fused_pp: with its
    consumer warpgroups' ping-pong (prefill_api.FUSED_PINGPONG).
  * FLA / FlashQLA: chunk_gated_delta_rule with cu_seqlens, K-first fp32 initial states, final
    state returned (what an engine does around them: gathering the pool is not counted).
  * flashinfer (opt-in, `--impls ...,flashinfer`; flashinfer-python 0.7.2.post1, vLLM 0.33's
    Hopper prefill): flashinfer.gdn_prefill.chunk_gated_delta_rule as vLLM calls it, on a pool of
    N fp32 V-first slots read and written in place through state_indices, alpha = exp(g) (its
    gate input, made once outside the timed region as qla_serve's g is), the unit-norm q/k as
    they are (no in-kernel L2 norm). `qla_over_flashinfer` is qla's GPU time over it.
GPU time per call: CUDA-graph replay of `--graph-calls` calls, median of `--reps` replays.
A baseline that cannot be captured (FLA syncs on the host) is timed by the profiler's kernel
sum over `--reps` eager calls ("profiler" in the row): the GPU's own time, without the idle gaps
its host syncs leave; CUDA events around its eager calls are kept as `<impl>_eager_ms`
("events" is the timing only if the profiler fails). Host time per eager call: wall time of
`--reps` eager calls with a sync only at the end, minus GPU time (what the CPU adds when it,
not the GPU, is the bottleneck); the median over three rounds, each with a GPU time measured
just before its eager calls (the first: the row's own; `<impl>_host_over_gpu_rounds_us`), and
the CPU time of one eager call alone (enqueue, no sync; first round) as `<impl>_host_ms`.
With --idle, the host's share measured another way: the GPU's idle time per call in back-to-back
eager calls minus that in graph replays, both from the profiler's kernel timeline
(`<impl>_host_idle_us`), which the GPU time's drift between measurements does not move.

Writes JSON (--json), a markdown table (--md) and optionally a PNG (--png, needs matplotlib).
"""

import argparse
import json
import math
import os
import statistics
import time

from . import source_commit

HEAD_PAIRS = [(2, 8), (4, 16), (8, 24), (16, 32), (16, 64)]
# (name, seq_lens) rows: the device README's table plus 2048x4, 1024x8, a mixed chunked-prefill batch.
ROWS = {
    "1x32768": [32768],
    "1x8192": [8192],
    "64x512": [512] * 64,
    "4x8192": [8192] * 4,
    "2048x4": [2048] * 4,
    "1024x8": [1024] * 8,
    # chunked-prefill step: a few long prompt chunks, mid-size prompts, many short tails (8192 tokens)
    "mixed8192": [2048, 1536, 1024, 700, 513, 300, 257, 200, 129, 128, 100, 65, 64, 63, 33, 17, 9, 1, 1, 1, 1, 1, 1, 1, 1]
    + [998],
}
# Small batches (not in --rows all): what a chunked-prefill step hands a layer beside a few decodes,
# one to eight short prompts; at 2/8 and 4/16 most run stage 2 at v_split 2 on the persistent grid.
SMALL_ROWS = {"1x512": [512], "4x512": [512] * 4, "8x256": [256] * 8, "3x300": [300] * 3, "8x512": [512] * 8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", default="all", help="qk/v head pairs, e.g. 2/8,16/64 (default: all five)")
    parser.add_argument("--rows", default="all",
                        help=f"rows among {','.join(ROWS)} (default: all) and the small batches "
                             f"{','.join(SMALL_ROWS)}")
    parser.add_argument("--impls", default="qla,fla,flashqla",
                        help="subset of qla,qla16,qla16_units,qla16_wgmma,qla16_fused,fla,flashqla,flashinfer "
                             "(qla16: qla_serve on fp16 q/k, the engine layers' form; qla16_units: the same with "
                             "stage 2 on a CTA per unit instead of the persistent grid; qla16_wgmma: with stage 1's "
                             "wgmma solve; qla16_fused: with the one-launch prefill where it applies, "
                             "qla16_fused_pp: and its consumers' ping-pong; "
                             "flashinfer: FlashInfer 0.7.2's GDN prefill, if installed)")
    parser.add_argument("--v-split", default="auto", help="qla_serve v_split: auto (planner) or 1/2/4")
    parser.add_argument("--segment-chunks", default="auto",
                        help="qla_serve CP segment length in chunks: auto (planner; no cut when --v-split "
                             "is forced), 0 (no cut) or L >= 2")
    parser.add_argument("--cp", choices=("auto", "exact", "off"), default="auto",
                        help="qla_serve's cp mode: auto (gate warmup allowed in cut segments), exact, off")
    parser.add_argument("--gate-warmup", choices=("on", "off"), default=None,
                        help="the Hopper gate warmup for cut segments under --cp auto "
                             "(prefill_api.GATE_WARMUP; default: $QLA_SERVE_GATE_WARMUP or on)")
    parser.add_argument("--main", choices=("v8", "vfirst"), default=None,
                        help="qla_serve's Hopper stage-2 kernel at v_split 1/2 (prefill_api.MAIN_IMPL; "
                             "default: $QLA_SERVE_PREFILL_MAIN or vfirst); v_split 4 always runs v8")
    parser.add_argument("--maps-v-split", type=int, default=None,
                        help="qla_serve's CP maps pass at this v_split (default: the planner's, plan.maps_v_split)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--graph-calls", type=int, default=5)
    parser.add_argument("--breakdown", action="store_true", help="also time qla_serve's prep and main kernels apart")
    parser.add_argument("--kernels", action="store_true",
                        help="also record qla_serve's kernels in launch order (GPU us each, idle us before each)")
    parser.add_argument("--idle", action="store_true",
                        help="also record each impl's GPU idle us per call in eager calls and in graph replays "
                             "(<impl>_eager_idle_us, _graph_idle_us; their difference <impl>_host_idle_us: the "
                             "host's share, free of GPU-time drift), from the profiler")
    parser.add_argument("--check", action="store_true",
                        help="also report each qla_serve form's rel. L2 difference from each baseline (o and final "
                             "state), all run once more from the row's initial states")
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    parser.add_argument("--png", default=None)


def _inputs(lens, hk, hv, seed=0):
    import torch

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    T = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(T, hk, 128, generator=gen, device=dev), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(T, hk, 128, generator=gen, device=dev), dim=-1).bfloat16()
    v = torch.randn(T, hv, 128, generator=gen, device=dev).bfloat16()
    A_log = torch.log(torch.rand(hv, generator=gen, device=dev) * 15 + 1)
    dt = torch.rand(hv, generator=gen, device=dev) * 0.099 + 0.001
    x = torch.randn(T, hv, generator=gen, device=dev)
    g = -torch.exp(A_log) * torch.nn.functional.softplus(x + torch.log(torch.expm1(dt)))
    g[:, : max(1, hv // 4)] = 0.0
    beta = torch.rand(T, hv, generator=gen, device=dev) * 0.98 + 0.01
    h0 = torch.randn(len(lens), hv, 128, 128, generator=gen, device=dev) * 0.3  # V-first
    return q, k, v, g.contiguous(), beta, h0


def _captured(fn, calls):
    """A CUDA graph of ``calls`` consecutive calls of fn (raises where fn cannot be captured)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def _profiled(fn, reps):
    """The torch profiler's record (CUDA activity) of reps calls of fn, synchronised on both sides."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof


def _kernel_sum_ms(fn, reps):
    """GPU ms per call as the profiler's sum of device time (kernels, copies) over reps eager
    calls: what the GPU spent, not the wall time between the calls' first and last kernel."""
    import torch

    prof = _profiled(fn, reps)
    cuda = torch.autograd.DeviceType.CUDA
    us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
             for e in prof.key_averages() if e.device_type == cuda)
    if us <= 0:
        raise RuntimeError("the profiler recorded no device time")
    return us / 1e3 / reps


def _gpu_time_ms(fn, reps, graph_calls):
    """(median GPU ms per call, how, eager ms or None): CUDA-graph replay; for calls that cannot
    be captured the profiler's kernel sum (and the CUDA-event time of eager calls beside it),
    or the event time alone if the profiler fails."""
    import torch

    fn()
    torch.cuda.synchronize()
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = _captured(fn, graph_calls)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / graph_calls)
        return statistics.median(times), "graph", None
    except Exception:  # noqa: BLE001 - some baselines sync or allocate on the host: time eagerly
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        eager = statistics.median(times)
        try:
            return _kernel_sum_ms(fn, reps), "profiler", eager
        except Exception:  # noqa: BLE001 - no profiler (or no device events): the wall time
            return eager, "events", eager


def _kernel_timeline(fn, reps, graph_calls):
    """qla_serve's launches of one call in order, from the profiler over CUDA-graph replays (eager
    calls if the profiler sees no kernels in a replay): [{"kernel", "us", "idle_us"}], the mean
    GPU time of each and the mean idle time between the previous kernel's end and its start
    (the first kernel's idle time is measured from the previous call's last kernel). Only
    qla_serve's kernels (names gdn_*) count: a replay may add its own."""
    import torch

    graph = _captured(fn, graph_calls)
    for run_once, calls in ((graph.replay, graph_calls), (fn, 1)):
        run_once()  # warm-up
        prof = _profiled(run_once, reps)
        cuda = torch.autograd.DeviceType.CUDA
        spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                       if e.device_type == cuda and e.name.startswith("gdn_"))
        ncalls = reps * calls
        if spans and len(spans) % ncalls == 0:
            break
    else:
        raise RuntimeError(f"the profiler recorded {len(spans)} kernels for {ncalls} calls")
    per_call = len(spans) // ncalls
    out = []
    for i in range(per_call):
        at = range(i, len(spans), per_call)
        idle = [spans[j][0] - spans[j - 1][1] for j in at if j > 0]
        out.append({"kernel": spans[i][2].split("(")[0],
                    "us": round(statistics.mean(spans[j][1] - spans[j][0] for j in at), 2),
                    "idle_us": round(statistics.mean(idle), 2) if idle else None})
    return out


def _host_rounds_ms(fn, reps, graph_calls, gpu_ms, rounds=3):
    """(CPU ms per eager call of the first round, median and all rounds of the wall time per
    back-to-back eager call above the GPU time per call). Each round measures the two next to
    each other: the GPU time of one call drifts by 1-4% between measurements minutes apart,
    10-40 us on the 1 ms rows, which a single GPU figure taken earlier put into this difference
    (benchmarks/prefill.md v19). The first round uses ``gpu_ms``, measured just before."""
    cpus, overs = [], []
    for r in range(rounds):
        gpu = gpu_ms if r == 0 else _gpu_time_ms(fn, reps, graph_calls)[0]
        cpu, over = _host_ms(fn, reps, gpu)
        cpus.append(cpu)
        overs.append(over)
    return cpus[0], statistics.median(overs), overs


def idle_per_call_us(spans, calls) -> float:
    """GPU idle us per call from the (start, end) spans (us) of every kernel of `calls`
    consecutive calls: from the first kernel's start to the last kernel's end, the time no
    kernel ran, over calls (overlapping kernels count once)."""
    spans = sorted(spans)
    busy, run_start, run_end = 0.0, spans[0][0], spans[0][1]
    for start, end in spans[1:]:
        if start > run_end:
            busy += run_end - run_start
            run_start = start
        run_end = max(run_end, end)
    busy += run_end - run_start
    return (max(end for _, end in spans) - spans[0][0] - busy) / calls


def _kernel_spans(prof):
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    return [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == cuda]


def _idle_us(fn, reps, graph_calls):
    """(GPU idle us per call over reps back-to-back eager calls, the same in CUDA-graph replays
    or None where fn cannot be captured), from the profiler's kernel timeline. Their difference
    is the host's share of an eager call's time that, unlike wall time minus a GPU time taken
    beside it, does not move with the GPU time's own drift (up to 10% between measurements on
    the ~1 ms rows: benchmarks/prefill.md v20). The profiler's tracing adds its own host time
    per launch, so the eager figure errs high."""
    import torch

    fn()
    eager = idle_per_call_us(_kernel_spans(_profiled(fn, reps)), reps)
    try:
        graph = _captured(fn, graph_calls)
        graph.replay()
        replays = max(1, reps // graph_calls)
        return eager, idle_per_call_us(_kernel_spans(_profiled(graph.replay, replays)), replays * graph_calls)
    except Exception:  # noqa: BLE001 - baselines that sync on the host cannot be captured
        torch.cuda.synchronize()
        return eager, None


def _host_ms(fn, reps, gpu_ms):
    """(CPU ms per eager call: enqueue only, no sync; wall ms per back-to-back eager call above
    gpu_ms, synchronised at the end)."""
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t) * 1e3 / reps
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e3 / reps
    return host, max(0.0, wall - gpu_ms)


def plan_label(plan) -> str:
    """The plan as the JSON records name it: "plain/vs1", "vsplit/vs4", "cp/vs2/L64"."""
    return f"{plan.strategy}/vs{plan.v_split}" + (f"/L{plan.segment_chunks}" if plan.strategy == "cp" else "")


def parse_plan_label(label: str) -> tuple[str, int, int]:
    """(strategy, v_split, segment_chunks) from :func:`plan_label`'s string (0 = no cut)."""
    strategy, vs, *cut = label.split("/")
    return strategy, int(vs[2:]), int(cut[0][1:]) if cut else 0


def _main_impl(plan) -> str:
    """Which Hopper stage-2 kernel this plan runs ("v8" or "vfirst"; "-" off Hopper)."""
    from qla_serve.kernels.hopper import prefill_api
    return prefill_api.main_impl_for(plan.v_split) if plan.arch == "sm90" else "-"


def _prep_heads(plan, hk: int, hv: int) -> int:
    """Stage 1's v-heads per CTA in this plan's launches (prefill_api.plan_prep_heads; 0 off
    Hopper)."""
    if plan.arch != "sm90":
        return 0
    from qla_serve.kernels.hopper import prefill_api
    return prefill_api.plan_prep_heads(plan, hv, hk, prefill_api.PREP_FORM[_main_impl(plan)])


def _cp_label(plan) -> str:
    """The plan's cp mode, "+warmup" where its cut segments may take the gate warmup (the
    switch read from prefill_api, whether --gate-warmup, QLA_SERVE_GATE_WARMUP or the default set it)."""
    from qla_serve.kernels.hopper import prefill_api
    warm = plan.strategy == "cp" and plan.cp == "auto" and plan.arch == "sm90" and prefill_api.GATE_WARMUP
    return plan.cp + ("+warmup" if warm else "")


# qla_serve's rows and the prefill_api switches each sets for its calls (A/Bs in one process).
QLA_SWITCHES = {"qla": {}, "qla16": {}, "qla16_units": {"PERSISTENT": False}, "qla16_wgmma": {"PREP_SOLVE": "wgmma"},
                "qla16_fused": {"FUSED": True}, "qla16_fused_pp": {"FUSED": True, "FUSED_PINGPONG": True}}
QLA_IMPLS = tuple(QLA_SWITCHES)


def _qla_data(impl, data):
    """The inputs qla_serve gets: the row's, or for "qla16" and its variants fp16 q/k beside the
    bf16 v (unit-norm bf16 values: exact in fp16 down to its normal range, 6e-5)."""
    if impl == "qla":
        return data
    q, k, *rest = data
    return (q.half(), k.half(), *rest)


def _qla_fn(lens, hk, hv, data, v_split, stages="prep,main", segment_chunks="auto", cp="auto", maps_v_split=None,
            switches=None):
    """switches: prefill_api attributes set for each of fn's calls (QLA_SWITCHES), e.g.
    {"PERSISTENT": False}; the others keep their values."""
    import contextlib
    from unittest import mock

    import torch

    import qla_serve
    from qla_serve import ops
    from qla_serve.kernels.hopper import prefill_api
    from qla_serve.plan import force_plan

    q, k, v, g, beta, h0 = data
    dev = q.device
    arch = ops.device_arch(dev)
    mod = ops.kernel_module(arch)
    plan = qla_serve.plan_prefill(lens, hv, hk, device=dev, cp=cp, supported_strategies=mod.SUPPORTED_STRATEGIES)
    if v_split != "auto" or segment_chunks != "auto":  # forced (sweeps for the cost model)
        vs = plan.v_split if v_split == "auto" else int(v_split)
        # a forced v_split alone means "no cut" (the v_split sweep that fit_costmodel.py reads)
        L = 0 if segment_chunks == "auto" else int(segment_chunks)
        strategy = "cp" if L else ("plain" if vs == 1 else "vsplit")
        plan = force_plan(plan, strategy, vs, L)
    if maps_v_split and plan.strategy == "cp":
        plan = force_plan(plan, "cp", plan.v_split, plan.segment_chunks, maps_v_split=maps_v_split)
    pool = torch.empty(len(lens), hv, 128, 128, device=dev)
    slots = torch.arange(len(lens), dtype=torch.int32, device=dev)
    out = torch.empty_like(v)

    def run(which):
        kw = {} if which == "prep,main" else {"_stages": which}
        with contextlib.ExitStack() as stack:
            for name, value in (switches or {}).items():
                stack.enter_context(mock.patch.object(prefill_api, name, value))
            mod.prefill(q, k, v, g, beta, pool, slots, plan, has_initial_state=None, scale=128**-0.5, out=out, **kw)

    def fn():
        # the pool's states evolve from call to call; they stay bounded (the update is contractive)
        run(stages)

    if stages == "main":
        # Stage 2 alone reads what stage 1 left in the plan's scratch: fill it once, so that it
        # times on this row's gates, P and M (the CP finder's warm starts follow the gates; on
        # never-written scratch its "main" figures were anyone's guess).
        run("prep")
    pool.copy_(h0)
    return fn, out, pool, plan


def _fla_fn(lens, data, which):
    import torch

    q, k, v, g, beta, h0 = data
    cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=q.device)
    h0k = h0.transpose(-1, -2).contiguous()  # K-first
    if which == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f
    else:
        from flash_qla import chunk_gated_delta_rule as f
    res = {}

    def fn():
        o, ht = f(q[None], k[None], v[None], g[None], beta[None], scale=128**-0.5, initial_state=h0k,
                  output_final_state=True, cu_seqlens=cu.long() if which == "fla" else cu)
        res["o"], res["ht"] = o, ht

    return fn, res


def _flashinfer_fn(lens, data):
    """FlashInfer's chunked GDN prefill on a pool in place (see the module docstring). Returns
    (fn, res) like _fla_fn: res["o"] [1, T, Hv, 128] and res["ht"] [N, Hv, K, V] (K-first, as
    FLA's) are views of its output and pool; res["from_h0"] resets the pool to h0 and runs."""
    import torch
    from flashinfer.gdn_prefill import chunk_gated_delta_rule as f

    q, k, v, g, beta, h0 = data
    cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.long, device=q.device)
    alpha = torch.exp(g)
    pool = h0.clone()  # [N, Hv, V, K]: vLLM's layout, V-first as qla_serve's pool
    ids = torch.arange(len(lens), dtype=torch.int32, device=q.device)
    out = torch.empty_like(v)
    res = {"o": out[None], "ht": pool.transpose(-1, -2)}

    def fn():
        f(q, k, v, g=alpha, beta=beta, scale=128**-0.5, initial_state=pool, output_final_state=True,
          cu_seqlens=cu, use_qk_l2norm_in_kernel=False, output=out, output_state=pool, state_indices=ids)

    def from_h0():
        pool.copy_(h0)
        fn()

    res["from_h0"] = from_h0
    return fn, res


BASELINES = {"fla": lambda lens, data: _fla_fn(lens, data, "fla"),
             "flashqla": lambda lens, data: _fla_fn(lens, data, "flashqla"),
             "flashinfer": _flashinfer_fn}


def _check_against(base, base_fn, res, qla_runs, h0) -> dict:
    """--check: each qla_serve form's o and final state against baseline ``base``, every one run
    once more from the row's initial states h0 (the timed calls leave qla_serve's pool at a later
    state, and the baselines start every call from h0). The baseline's state is K-first, the
    pool V-first. Keys "<qla impl>_vs_<base>_o_rel" and "..._state_rel"."""
    from qla_serve.kernels.reference import rel_l2

    res.get("from_h0", base_fn)()
    o_ref, s_ref = res["o"][0], res["ht"].transpose(-1, -2)
    rec = {}
    for impl, (fn, out, pool) in qla_runs.items():
        pool.copy_(h0)
        fn()
        rec[f"{impl}_vs_{base}_o_rel"] = round(rel_l2(out, o_ref), 6)
        rec[f"{impl}_vs_{base}_state_rel"] = round(rel_l2(pool, s_ref), 6)
    return rec


def _cumsum(xs):
    acc = 0
    for x in xs:
        acc += x
        yield acc


def run(args) -> int:
    unknown = [i for i in args.impls.split(",") if i not in QLA_IMPLS and i not in BASELINES]
    if unknown:
        print(f"bench prefill: --impls: unknown {unknown}; choose from {list(QLA_IMPLS) + list(BASELINES)}")
        return 2
    named = {**ROWS, **SMALL_ROWS}
    rows = list(ROWS) if args.rows == "all" else args.rows.split(",")
    if any(r not in named for r in rows):
        print(f"bench prefill: --rows: unknown {[r for r in rows if r not in named]}; choose from {list(named)}")
        return 2
    os.environ.setdefault("FLA_FLASH_QLA", "0")  # FLA's own Triton kernels; FlashQLA is timed directly
    import torch

    if not torch.cuda.is_available():
        print("bench prefill: needs a CUDA GPU")
        return 2
    if args.gate_warmup or args.main:
        from qla_serve.kernels.hopper import prefill_api
        if args.gate_warmup:
            prefill_api.GATE_WARMUP = args.gate_warmup == "on"
        prefill_api.MAIN_IMPL = args.main or prefill_api.MAIN_IMPL
    heads = HEAD_PAIRS if args.heads == "all" else [tuple(int(x) for x in p.split("/")) for p in args.heads.split(",")]
    impls = args.impls.split(",")
    results = []
    for hk, hv in heads:
        for row in rows:
            lens = named[row]
            data = _inputs(lens, hk, hv)
            rec = {"heads": f"{hk}/{hv}", "row": row, "tokens": sum(lens), "seqs": len(lens)}
            qla_runs = {}  # impl -> (fn, out, pool): rerun from the row's initial states by --check
            for impl in impls:
                try:
                    if impl in QLA_IMPLS:
                        qdata = _qla_data(impl, data)
                        fn, out, pool, plan = _qla_fn(lens, hk, hv, qdata, args.v_split,
                                                      segment_chunks=args.segment_chunks, cp=args.cp,
                                                      maps_v_split=args.maps_v_split,
                                                      switches=QLA_SWITCHES[impl])
                        qla_runs[impl] = (fn, out, pool)
                        if "qla_plan" not in rec:  # the row's plan: the same for every qla impl
                            rec["qla_plan"] = plan_label(plan)
                            rec["qla_maps_v_split"] = plan.maps_v_split
                            rec["qla_cp"] = _cp_label(plan)
                            rec["qla_main"] = _main_impl(plan)
                            rec["qla_prep_heads"] = _prep_heads(plan, hk, hv)
                        if args.breakdown:
                            for st in ("prep", "main"):
                                f2 = _qla_fn(lens, hk, hv, qdata, args.v_split, st, args.segment_chunks,
                                             args.cp, args.maps_v_split,
                                             switches=QLA_SWITCHES[impl])[0]
                                rec[f"{impl}_{st}_gpu_ms"] = round(_gpu_time_ms(f2, args.reps, args.graph_calls)[0], 4)
                        if args.kernels:
                            rec[f"{impl}_kernels"] = _kernel_timeline(fn, args.reps, args.graph_calls)
                    else:
                        fn, res = BASELINES[impl](lens, data)
                    gpu, how, eager = _gpu_time_ms(fn, args.reps, args.graph_calls)
                    host, over, rounds = _host_rounds_ms(fn, args.reps, args.graph_calls, gpu)
                    rec[f"{impl}_gpu_ms"] = round(gpu, 4)
                    rec[f"{impl}_timing"] = how
                    if eager is not None:
                        rec[f"{impl}_eager_ms"] = round(eager, 4)
                    rec[f"{impl}_host_ms"] = round(host, 4)
                    rec[f"{impl}_host_over_gpu_us"] = round(over * 1e3, 1)
                    rec[f"{impl}_host_over_gpu_rounds_us"] = [round(x * 1e3, 1) for x in rounds]
                    if args.idle:
                        eager_idle, graph_idle = _idle_us(fn, args.reps, args.graph_calls)
                        rec[f"{impl}_eager_idle_us"] = round(eager_idle, 1)
                        if graph_idle is not None:
                            rec[f"{impl}_graph_idle_us"] = round(graph_idle, 1)
                            rec[f"{impl}_host_idle_us"] = round(eager_idle - graph_idle, 1)
                    if args.check and impl not in QLA_IMPLS:
                        rec.update(_check_against(impl, fn, res, qla_runs, data[-1]))
                except Exception as e:  # noqa: BLE001 - a baseline failing must not hide the others
                    rec[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:300]
            for impl in QLA_IMPLS:
                for base in ("flashqla", "flashinfer"):
                    if f"{impl}_gpu_ms" in rec and f"{base}_gpu_ms" in rec:
                        rec[f"{impl}_over_{base}"] = round(rec[f"{impl}_gpu_ms"] / rec[f"{base}_gpu_ms"], 3)
            print(json.dumps(rec), flush=True)
            results.append(rec)
            del data
            torch.cuda.empty_cache()
    md = _markdown(results, impls)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "commit": source_commit(), "results": results}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.png:
        _plot(results, impls, args.png)
    return 0


def _markdown(results, impls):
    ratios = [f"{i}_over_{b}" for b in ("flashqla", "flashinfer") if b in impls for i in impls if i in QLA_IMPLS]
    cols = ["heads", "row", "qla_plan"] + [f"{i}_gpu_ms" for i in impls] + ratios + [
        f"{i}_host_over_gpu_us" for i in impls
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(str(r.get(c, r.get(c.replace("gpu_ms", "error"), "-"))) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def _plot(results, impls, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench prefill: matplotlib missing, no PNG")
        return
    labels = [f"{r['heads']} {r['row']}" for r in results]
    x = range(len(results))
    fig, ax = plt.subplots(figsize=(max(8, len(results) * 0.5), 4))
    w = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        ax.bar([i + j * w for i in x], [r.get(f"{impl}_gpu_ms", math.nan) for r in results], w, label=impl)
    ax.set_xticks([i + 0.4 for i in x], labels, rotation=90, fontsize=7)
    ax.set_ylabel("GPU ms per call")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="qla-serve bench prefill")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
