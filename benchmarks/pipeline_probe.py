"""Probe (issue 28): can stage 1 of some sequences run beside stage 2 of others on the H200?

Stage 2 walks chunks one after another (latency bound, ~1.9 us per chunk on the chain); stage 1
is throughput work. FlashInfer's fused kernel overlaps the two inside one CTA. This probe asks
whether two streams do it for us: the batch cut into G groups of consecutive sequences, stage 1
of group g + 1 on one stream while stage 2 of group g runs on another (higher priority).

    python benchmarks/pipeline_probe.py [--rows ...] [--groups 1,2,4,8]

Prints, per row: the whole call, prep alone, main alone, prep beside main (two streams, each on
its own plan: timing only), and the G-group pipelines, GPU us per call from CUDA-graph replays
timed by events; and the pipelines' max |diff| against the whole call (out and pool).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROWS = {
    "2/8 64x512": (2, 8, [512] * 64),
    "16/64 4x8192": (16, 64, [8192] * 4),
    "16/64 2048x4": (16, 64, [2048] * 4),
    "16/64 1024x8": (16, 64, [1024] * 8),
    "2/8 1x32768": (2, 8, [32768]),
}


def _timed_us(fn, calls=4, reps=10):
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up / compile outside the capture
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
        times.append(a.elapsed_time(b) * 1000 / calls)
    times.sort()
    return round(times[len(times) // 2], 1)


def main() -> None:
    import torch

    import qla_serve
    from qla_serve import ops
    from qla_serve.bench import prefill as B

    p = argparse.ArgumentParser()
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--groups", default="2,4,8")
    args = p.parse_args()
    mod = ops.kernel_module(ops._arch_of(0))
    lo, hi = torch.cuda.Stream.priority_range()
    for name in args.rows.split(","):
        hk, hv, lens = ROWS[name]
        q, k, v, g, beta, h0 = B._inputs(lens, hk, hv)
        q, k = q.half(), k.half()
        dev = q.device
        slots = torch.arange(len(lens), dtype=torch.int32, device=dev)

        def plan_of(ls):
            return qla_serve.plan_prefill(ls, hv, hk, device=dev, supported_strategies=mod.SUPPORTED_STRATEGIES)

        whole = plan_of(lens)
        pool, out = h0.clone(), torch.empty_like(v)

        def call(plan, t0, t1, s0, s1, stages, pool_, out_):
            kw = {} if stages == "prep,main" else {"_stages": stages}
            mod.prefill(q[t0:t1], k[t0:t1], v[t0:t1], g[t0:t1], beta[t0:t1], pool_, slots[s0:s1], plan,
                        has_initial_state=None, scale=128**-0.5, out=out_[t0:t1], **kw)

        T, N = q.shape[0], len(lens)
        res = {"row": name, "plan": B.plan_label(whole)}
        res["whole"] = _timed_us(lambda: call(whole, 0, T, 0, N, "prep,main", pool, out))
        res["prep"] = _timed_us(lambda: call(whole, 0, T, 0, N, "prep", pool, out))
        res["main"] = _timed_us(lambda: call(whole, 0, T, 0, N, "main", pool, out))
        other = plan_of(lens)  # its own stage-1 buffers: main of `whole` beside prep of `other`
        pool2, out2 = h0.clone(), torch.empty_like(v)
        sa, sb = torch.cuda.Stream(priority=lo), torch.cuda.Stream(priority=hi)

        def beside():
            cur = torch.cuda.current_stream()
            sa.wait_stream(cur)
            sb.wait_stream(cur)
            with torch.cuda.stream(sa):
                call(other, 0, T, 0, N, "prep", pool2, out2)
            with torch.cuda.stream(sb):
                call(whole, 0, T, 0, N, "main", pool, out)
            cur.wait_stream(sa)
            cur.wait_stream(sb)

        res["prep|main"] = _timed_us(beside)
        # the reference result of one whole call from h0
        pool.copy_(h0)
        call(whole, 0, T, 0, N, "prep,main", pool, out)
        ref_out, ref_pool = out.clone(), pool.clone()
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        for G in (int(x) for x in args.groups.split(",")):
            if G > N or N % G:
                continue
            per = N // G
            groups = [(i * per, (i + 1) * per) for i in range(G)]
            plans = [plan_of(lens[s0:s1]) for s0, s1 in groups]
            for prio in ("hi", "same"):
                mains = [torch.cuda.Stream(priority=hi if prio == "hi" else lo) for _ in groups]
                prep_s = torch.cuda.Stream(priority=lo)

                def piped():
                    cur = torch.cuda.current_stream()
                    prep_s.wait_stream(cur)
                    for (s0, s1), plan, ms in zip(groups, plans, mains):
                        with torch.cuda.stream(prep_s):
                            call(plan, cu[s0], cu[s1], s0, s1, "prep", pool, out)
                        ms.wait_stream(prep_s)
                        with torch.cuda.stream(ms):
                            call(plan, cu[s0], cu[s1], s0, s1, "main", pool, out)
                    for ms in mains:
                        cur.wait_stream(ms)

                key = f"G{G}/{prio}"
                res[key] = _timed_us(piped)
                pool.copy_(h0)
                piped()
                torch.cuda.synchronize()
                res[key + " diff"] = [float((out.float() - ref_out.float()).abs().max()),
                                      float((pool - ref_pool).abs().max())]
            res[f"G{G} plans"] = [B.plan_label(pl) for pl in plans[:1]]
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
