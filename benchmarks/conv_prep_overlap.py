"""Would the prefill layer gain from running the v channels' conv beside stage 1 (prep)?

Stage 1 of gdn_prefill reads q, k, g and beta, never v; the layer's conv writes all of q, k, v
in one launch before it. This probe times, in CUDA graphs on one process (GPU us per layer's
worth of work):

  today      conv (all channels) ; prep
  split      conv_qk ; prep || conv_v      (conv_v on a second stream, joined after)

with stand-ins for the split convs: the layer's conv at other head counts whose channels match
the q/k part (2 Hk x 128, plus gates) and the v part (Hv x 128) of the real heads, e.g. 2/8 ->
1/2 (512 channels) and 2/4 (1024). It also times each launch alone and conv || prep (the whole
conv beside prep). A benchmark, not a test; nothing here is checked for values.

    python benchmarks/conv_prep_overlap.py --heads 2/8,4/16 --rows 1x8192,16x512,mixed,1x32768
"""

import argparse
import statistics

import torch

from qla_serve import layer_ops
from qla_serve.bench import layer as L
from qla_serve.kernels.hopper import prefill_api

# (real heads) -> (q/k stand-in heads, v stand-in heads): channels 2 Hk and Hv (in 128s)
STAND_INS = {(2, 8): ((1, 2), (2, 4)), (4, 16): ((2, 4), (4, 8)), (2, 4): ((1, 2), (1, 2))}


def conv_fn(case, step):
    plan, kw = step.prefill_plan, case.layer_kwargs()
    ids, has_init = step.ids("prefill"), step.prefill_has_initial_state
    bufs = layer_ops.prefill_step_buffers(case.mixed_qkv, plan, num_k_heads=case.hk)

    def fn():
        layer_ops.gdn_layer_prefill_inputs(case.mixed_qkv, case.a, case.b, kw["conv_state"], ids, plan,
                                           has_initial_state=has_init, num_k_heads=case.hk,
                                           qk_dtype=bufs[0].dtype, _outputs=bufs, conv_weight=kw["conv_weight"],
                                           conv_bias=kw["conv_bias"], A_log=kw["A_log"], dt_bias=kw["dt_bias"])
    return fn, bufs


def prep_fn(case, step, bufs):
    q, k, v, g, beta = (t.clone() for t in bufs)
    plan, ids = step.prefill_plan, step.ids("prefill")

    def fn():
        prefill_api.prefill(q, k, v, g, beta, case.ssm_state, ids, plan, has_initial_state=None, scale=None,
                            out=case.out, _stages="prep")
    return fn


def side_by_side(first, beside, after=None, priority=0):
    """first (and ``after``) on the current stream, ``beside`` on a second stream forked after
    ``first`` (priority ``priority``) and joined at the end."""
    side = torch.cuda.Stream(priority=priority)

    def fn():
        if first is not None:
            first()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            beside()
        if after is not None:
            after()
        torch.cuda.current_stream().wait_stream(side)
    return fn


def graph_us(fn, reps=15, calls=8) -> float:
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="2/8")
    ap.add_argument("--rows", default="1x8192,16x512,mixed,1x32768")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for hk, hv in L.parse_heads(args.heads):
        (qk_h, v_h) = STAND_INS[(hk, hv)]
        for text in args.rows.split(","):
            row = L.parse_row(text)
            cases = {name: L.LayerCase(h[0], h[1], row, torch.float32, "cuda", seed=i)
                     for i, (name, h) in enumerate((("full", (hk, hv)), ("qk", qk_h), ("v", v_h)))}
            steps = {n: L.qla_step(c, 0) for n, c in cases.items()}
            convs = {n: conv_fn(cases[n], steps[n]) for n in cases}
            for n, (fn, _) in convs.items():
                fn()
            torch.cuda.synchronize()
            prep = prep_fn(cases["full"], steps["full"], convs["full"][1])
            conv, conv_qk, conv_v = (convs[n][0] for n in ("full", "qk", "v"))
            forms = {
                "conv": conv, "conv_qk": conv_qk, "conv_v": conv_v, "prep": prep,
                "today: conv;prep": lambda: (conv(), prep()),
                "conv||prep": side_by_side(None, conv, prep),
                "split: qk;prep||v": side_by_side(conv_qk, conv_v, prep),
                "split, v high prio": side_by_side(conv_qk, conv_v, prep, priority=-1),
                "split serial: qk;v;prep": lambda: (conv_qk(), conv_v(), prep()),
            }
            got = {k: [] for k in forms}
            for _ in range(args.rounds):
                for k, fn in forms.items():
                    got[k].append(graph_us(fn))
            cells = "  ".join(f"{k} {'/'.join(f'{x:.1f}' for x in v)}" for k, v in got.items())
            print(f"{hk}/{hv} {text:>8}: {cells}", flush=True)


if __name__ == "__main__":
    main()
