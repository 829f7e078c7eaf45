"""`qla-serve bench decode`: qla_serve's decode kernel beside FLA's on the same inputs.

Implementations (one token per sequence, V-first states, pool fp32 or bf16):

* ``qla``        qla_serve kernel, precomputed g/beta (fp32), unit-norm q/k;
* ``qla-fused``  qla_serve kernel, raw a/b + A_log/dt_bias and q/k l2norm in the kernel,
                 q/k/v strided views of a fused projection (what the engines pass);
* ``fla``        FLA 0.6 ``fused_recurrent_gated_delta_rule`` with g/beta, initial state
                 [B, Hv, V, K] (state_v_first), final state returned (FLA writes fp32);
* ``fla-fused``  the same FLA op with its fused sigmoid gating (``use_gate_in_kernel``,
                 ``use_beta_sigmoid_in_kernel``) and ``use_qk_l2norm_in_kernel``: FLA 0.6's form
                 of the engines' fused sigmoid-gating recurrent update. FLA takes contiguous
                 q/k/v and a gathered state (it has no slot indirection), prepared untimed;
* ``flashinfer`` (opt-in) FlashInfer 0.7.2.post1's ``gated_delta_rule_decode_pretranspose``, what
                 vLLM 0.33 runs on Hopper: raw a/b + A_log/dt_bias, q/k l2norm in the kernel,
                 the pool read and written in place through ``initial_state_indices`` (contiguous
                 [B, 1, H, 128] q/k/v, made untimed).

With --check, each point also runs qla-fused and flashinfer once each from the same pool on slot
set 0 and records their outputs' and new states' relative L2 difference (``check``).

Per (heads, pool dtype, batch): GPU time per call under CUDA-graph replay (median over
replays of a graph of several calls; consecutive calls use disjoint slot sets so the states
come from HBM, not L2), host time per eager call (enqueue time, no sync), bytes moved per
second against the device copy bandwidth measured in the same run, and the memory floor
(state bytes / copy bandwidth). Writes results.json, results.md and (if matplotlib is
present) decode.png into --out.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import time

from . import source_commit

HD = 128
L2_FLUSH_BYTES = 256 << 20   # footprint between reuses of a slot set (H200 L2: 50 MB)
IMPLS = ("qla", "qla-fused", "fla", "fla-fused", "flashinfer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,8,32,128,256,512", help="comma-separated batch sizes")
    p.add_argument("--heads", default="2/8,16/32", help="comma-separated Hk/Hv pairs (TP-local)")
    p.add_argument("--pools", default="float32,bfloat16", help="pool dtypes")
    p.add_argument("--impls", default="qla,qla-fused,fla,fla-fused",
                   help="implementations, among " + ",".join(IMPLS))
    p.add_argument("--check", action="store_true",
                   help="also compare qla-fused with flashinfer (outputs, new states) on slot set 0")
    p.add_argument("--tiles", default="", help="also time qla-fused with these kernel tiles "
                   "(e.g. bv32,bv64,bv32s-mb8; see qla_serve.kernels.hopper.decode_tiles.parse_tile)")
    p.add_argument("--replays", type=int, default=15, help="graph replays (median taken)")
    p.add_argument("--host-calls", type=int, default=100, help="eager calls for host time")
    p.add_argument("--out", default="bench_out/decode", help="output directory")
    p.add_argument("--precompile", metavar="TARGET", default=None,
                   help="only compile the qla variants this run would use for TARGET "
                        "(sm_90a / sm_100a) into TILELANG_CACHE_DIR; no GPU needed")


def _dec():
    # The package exports a function named `decode`; the submodule comes from sys.modules.
    return importlib.import_module("qla_serve.kernels.hopper.decode")


def _parse(args):
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",") if h]
    batches = [int(b) for b in args.batches.split(",") if b]
    pools = [p for p in args.pools.split(",") if p]
    impls = [i for i in args.impls.split(",") if i]
    tiles = [t for t in args.tiles.split(",") if t]
    return heads, batches, pools, impls, tiles


def _precompile(args) -> int:
    dec = _dec()
    heads, batches, pools, impls, tiles = _parse(args)
    t0 = time.time()
    n = 0
    io = "bfloat16"
    for hk, hv in heads:
        for pdt in pools:
            for impl, gating, ab, prm, l2 in (("qla", "gb", None, None, False),
                                              ("qla-fused", "ab", io, "float32", True)):
                if impl not in impls:
                    continue
                # the tile the default path picks at each batch on any card (decode_tile), and the forced ones
                picked = {dec.decode_tile(pdt, B * hv, card=card) for B in batches for card in dec.CARDS}
                for tile in sorted(picked | (set(tiles) if impl == "qla-fused" else set())):
                    dec.build(dec._variant("decode", hv, hk, io, pdt, gating, ab, prm, l2, tile),
                              args.precompile)
                    n += 1
    print(f"precompiled {n} decode variants for {args.precompile} in {time.time() - t0:.1f} s")
    return 0


class _Case:
    """Inputs of one (heads, pool dtype, batch) point, with `nsets` disjoint slot sets."""

    def __init__(self, torch, hk, hv, B, pdt, gen):
        dev = "cuda"
        self.hk, self.hv, self.B = hk, hv, B
        self.pdt = getattr(torch, pdt)
        esize = 4 if pdt == "float32" else 2
        self.state_bytes = 2 * B * hv * HD * HD * esize        # read + write, once each
        io_bytes = B * (2 * hk + 2 * hv) * HD * 2 + B * hv * 2 * 4
        self.bytes = self.state_bytes + io_bytes
        self.nsets = max(2, min(256, math.ceil(L2_FLUSH_BYTES / self.state_bytes)))
        S = B * self.nsets
        self.pool = (torch.randn(S, hv, HD, HD, generator=gen, device=dev) * 0.3).to(self.pdt)
        perm = torch.randperm(S, generator=gen, device=dev).to(torch.int32)
        # each set its own allocation (FlashInfer's decode refuses index tensors that start
        # mid-way into a 16-byte unit, as a B = 1 slice of one permutation does)
        self.slot_sets = [perm[i * B:(i + 1) * B].clone() for i in range(self.nsets)]
        width = (2 * hk + hv) * HD
        proj = torch.randn(B, width, generator=gen, device=dev).to(torch.bfloat16)
        self.q = proj[:, :hk * HD].view(B, hk, HD)
        self.k = proj[:, hk * HD:2 * hk * HD].view(B, hk, HD)
        self.v = proj[:, 2 * hk * HD:].view(B, hv, HD)
        ab = (torch.randn(B, 2 * hv, generator=gen, device=dev) * 0.7).to(torch.bfloat16)
        self.a, self.b = ab[:, :hv], ab[:, hv:]
        self.A_log = torch.log(torch.rand(hv, generator=gen, device=dev) * 15 + 1)
        self.dt_bias = torch.log(torch.expm1(torch.rand(hv, generator=gen, device=dev) * 0.099 + 0.001))
        sp = torch.nn.functional.softplus(self.a.float() + self.dt_bias)
        self.g = (-torch.exp(self.A_log) * sp).contiguous()
        self.beta = torch.sigmoid(self.b.float()).contiguous()
        qn = torch.nn.functional.normalize(self.q.float(), dim=-1).to(torch.bfloat16)
        kn = torch.nn.functional.normalize(self.k.float(), dim=-1).to(torch.bfloat16)
        self.qn, self.kn = qn.contiguous(), kn.contiguous()
        self.out = torch.empty(B, hv, HD, dtype=torch.bfloat16, device=dev)
        # FLA: contiguous [B, 1, H, D] inputs and a gathered [B, Hv, V, K] state per slot set.
        # (copies, not .contiguous(): at B = 1 the views are contiguous already, and b's starts
        # 2 * Hv bytes into its row, which FlashInfer's decode refuses as misaligned)
        own = lambda t: t.clone(memory_format=torch.contiguous_format).unsqueeze(1)  # noqa: E731
        self.fla_q, self.fla_k = own(self.q), own(self.k)
        self.fla_qn, self.fla_kn = qn.unsqueeze(1), kn.unsqueeze(1)
        self.fla_v = own(self.v)
        self.fla_a, self.fla_b = own(self.a), own(self.b)
        self.fla_g, self.fla_beta = self.g.unsqueeze(1), self.beta.unsqueeze(1)
        self.fla_h0 = [self.pool[s.long()].contiguous() for s in self.slot_sets]
        self.fla_bytes = B * hv * HD * HD * (esize + 4) + io_bytes

    def call(self, impl, i, dec=None, fla=None, fi=None):
        """A zero-argument callable running `impl` on slot set i."""
        slots = self.slot_sets[i % self.nsets]
        if impl == "flashinfer":
            return lambda: fi(self.fla_q, self.fla_k, self.fla_v, None, self.A_log, self.fla_a, self.dt_bias,
                              self.fla_b, scale=HD ** -0.5, output=self.out.view(self.B, 1, self.hv, HD),
                              use_qk_l2norm=True, initial_state=self.pool, initial_state_indices=slots)
        if impl == "qla":
            return lambda: dec.decode(self.qn, self.kn, self.v, self.pool, slots, g=self.g,
                                      beta=self.beta, a=None, b=None, A_log=None, dt_bias=None,
                                      use_qk_l2norm=False, scale=None, out=self.out)
        if impl == "qla-fused":
            return lambda: dec.decode(self.q, self.k, self.v, self.pool, slots, g=None, beta=None,
                                      a=self.a, b=self.b, A_log=self.A_log, dt_bias=self.dt_bias,
                                      use_qk_l2norm=True, scale=None, out=self.out)
        if impl == "qla-ops":
            import qla_serve
            return lambda: qla_serve.gdn_decode(self.q, self.k, self.v, self.pool, slots, a=self.a,
                                                b=self.b, A_log=self.A_log, dt_bias=self.dt_bias,
                                                use_qk_l2norm=True, out=self.out)
        h0 = self.fla_h0[i % self.nsets]
        if impl == "fla":
            return lambda: fla(self.fla_qn, self.fla_kn, self.fla_v, g=self.fla_g, beta=self.fla_beta,
                               initial_state=h0, output_final_state=True, state_v_first=True)
        if impl == "fla-fused":
            return lambda: fla(self.fla_q, self.fla_k, self.fla_v, g=self.fla_a, beta=self.fla_b,
                               initial_state=h0, output_final_state=True, state_v_first=True,
                               use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                               use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
        raise ValueError(f"impl: unknown implementation {impl!r}")


def _graph_time_us(torch, fns, replays):
    """Median GPU time per call (µs): one graph holding every fn once, replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    # Untimed replays for >= 20 ms first: the first point of a run (after the case's setup,
    # with the GPU idle) read up to 14% slow without them (H100, session 55: 2/8 B=64 30.0 us
    # against 26.4 for the same tile timed later in the row).
    t_end = time.perf_counter() + 0.02
    while True:
        g.replay()
        torch.cuda.synchronize()
        if time.perf_counter() >= t_end:
            break
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / len(fns))
    del g
    return statistics.median(times)


def _host_time_us(torch, fn, calls):
    """Host time per eager call (µs): enqueue time of `calls` calls, no sync inside."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / calls


def _copy_bandwidth(torch):
    """Device-to-device copy bandwidth (bytes/s; read + write counted), 1 GiB buffers."""
    n = (1 << 30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(10):
        e0.record()
        dst.copy_(src)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    del src, dst
    return 2 * n * 4 / statistics.median(ts)


def run(args) -> int:
    if args.precompile:
        return _precompile(args)
    unknown = [i for i in _parse(args)[3] if i not in IMPLS]
    if unknown:
        raise ValueError(f"bench decode: --impls: unknown {unknown}; choose from {list(IMPLS)}")
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("bench decode: needs a CUDA GPU (use --precompile TARGET without one)")
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    dec = _dec()
    heads, batches, pools, impls, tiles = _parse(args)
    fla = fi = None
    if "flashinfer" in impls or args.check:
        try:
            from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose as fi
        except ImportError as exc:
            print(f"FlashInfer not importable ({exc}; pip install 'qla_serve[bench]'); skipping flashinfer and --check")
            impls = [i for i in impls if i != "flashinfer"]
    if any(i.startswith("fla") for i in impls):
        try:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla
        except ImportError as exc:
            print(f"FLA not importable ({exc}; pip install 'qla_serve[bench]'); skipping fla, fla-fused")
            impls = [i for i in impls if not i.startswith("fla")]
    os.makedirs(args.out, exist_ok=True)
    bw = _copy_bandwidth(torch)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; copy bandwidth {bw / 1e12:.3f} TB/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for hk, hv in heads:
        for pdt in pools:
            for B in batches:
                case = _Case(torch, hk, hv, B, pdt, gen)
                floor_us = case.state_bytes / bw * 1e6
                point = {"num_k_heads": hk, "num_v_heads": hv, "pool": pdt, "batch": B,
                         "state_bytes": case.state_bytes, "floor_us": floor_us, "impls": {}}
                # each listed tile forced, also the one the default path picks at this batch
                # (decode_tile): its column shows what the default would be without that choice
                variants = [(i, None) for i in impls] + [("qla-fused", t) for t in tiles]
                for impl, tile in variants:
                    key = impl if tile is None else f"{impl}@{tile}"
                    dec.TILE_OVERRIDE = tile
                    try:
                        nfn = max(4, case.nsets)
                        fns = [case.call(impl, i, dec, fla, fi) for i in range(nfn)]
                        gpu = _graph_time_us(torch, fns, args.replays)
                        host = _host_time_us(torch, fns[0], args.host_calls)
                        # in place on the pool (qla, flashinfer) / gathered state in, fp32 state out (FLA)
                        nbytes = case.fla_bytes if impl.startswith("fla-") or impl == "fla" else case.bytes
                        point["impls"][key] = {
                            "gpu_us": gpu, "host_us": host, "bytes": nbytes,
                            "tb_per_s": nbytes / gpu / 1e6,
                            "frac_copy_bw": nbytes / gpu / 1e-6 / bw}
                    except Exception as exc:  # recorded, not hidden: the table shows the error
                        point["impls"][key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    finally:
                        dec.TILE_OVERRIDE = None
                if args.check and fi is not None:
                    point["check"] = _check(torch, case, dec, fi)
                if "qla-fused" in impls:
                    try:
                        host = _host_time_us(torch, case.call("qla-ops", 0), args.host_calls)
                        point["qla_ops_host_us"] = host
                    except Exception as exc:
                        point["qla_ops_host_us"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(point)
                print(_fmt_point(point), flush=True)
                del case
                torch.cuda.empty_cache()
    result = {"device": dev, "commit": source_commit(), "copy_bandwidth_Bps": bw, "torch": torch.__version__,
              "rows": rows}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = _markdown(result)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    print(md)
    _plot(result, os.path.join(args.out, "decode.png"))
    return 0


def _check(torch, case, dec, fi) -> dict:
    """qla-fused against flashinfer on slot set 0, each from the same pool: rel. L2 of the
    outputs and of the set's new states (the pool is left as qla-fused wrote it)."""
    from qla_serve.kernels.reference import rel_l2

    ids = case.slot_sets[0].long()
    before = case.pool[ids].clone()
    case.call("flashinfer", 0, fi=fi)()
    o_fi, s_fi = case.out.clone(), case.pool[ids].clone()
    case.pool[ids] = before
    case.call("qla-fused", 0, dec)()
    return {"o_rel": rel_l2(case.out, o_fi), "state_rel": rel_l2(case.pool[ids], s_fi)}


def _fmt_point(p):
    parts = [f"{p['num_k_heads']}/{p['num_v_heads']} {p['pool']:>8} B={p['batch']:<4} floor {p['floor_us']:.1f}us"]
    for k, r in p["impls"].items():
        parts.append(f"{k} " + (f"{r['gpu_us']:.1f}us ({100 * r['frac_copy_bw']:.0f}%) host {r['host_us']:.1f}us"
                                if "gpu_us" in r else r["error"]))
    if "check" in p:
        parts.append(f"vs flashinfer: o {p['check']['o_rel']:.2e} state {p['check']['state_rel']:.2e}")
    return " | ".join(parts)


def _markdown(res):
    impls = []
    for p in res["rows"]:
        for k in p["impls"]:
            if k not in impls:
                impls.append(k)
    head = ["Hk/Hv", "pool", "B", "floor µs"] + [f"{i} µs (% copy BW)" for i in impls] + \
           ["qla-fused host µs", "gdn_decode host µs"]
    lines = [f"Device: {res['device']}, copy bandwidth {res['copy_bandwidth_Bps'] / 1e12:.2f} TB/s. "
             "GPU time per call under CUDA-graph replay (median); host = eager enqueue time per call.",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in res["rows"]:
        cells = [f"{p['num_k_heads']}/{p['num_v_heads']}", p["pool"], str(p["batch"]), f"{p['floor_us']:.1f}"]
        for i in impls:
            r = p["impls"].get(i)
            if r is None:
                cells.append("")
            elif "gpu_us" in r:
                cells.append(f"{r['gpu_us']:.1f} ({100 * r['frac_copy_bw']:.0f}%)")
            else:
                cells.append("error")
        qf = p["impls"].get("qla-fused", {})
        cells.append(f"{qf['host_us']:.1f}" if "host_us" in qf else "")
        oh = p.get("qla_ops_host_us")
        cells.append(f"{oh:.1f}" if isinstance(oh, float) else ("error" if oh else ""))
        lines.append("| " + " | ".join(cells) + " |")
    errs = [f"- {p['num_k_heads']}/{p['num_v_heads']} {p['pool']} B={p['batch']} {k}: {r['error']}"
            for p in res["rows"] for k, r in p["impls"].items() if "error" in r]
    if errs:
        lines += ["", "Errors:"] + errs
    return "\n".join(lines) + "\n"


def _plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: no plot written ({path}); results.json/results.md have the data")
        return
    groups = sorted({(p["num_k_heads"], p["num_v_heads"], p["pool"]) for p in res["rows"]})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (hk, hv, pool) in zip(axes[0], groups):
        pts = [p for p in res["rows"] if (p["num_k_heads"], p["num_v_heads"], p["pool"]) == (hk, hv, pool)]
        bs = [p["batch"] for p in pts]
        ax.plot(bs, [p["floor_us"] for p in pts], "k--", label="memory floor")
        for impl in sorted({k for p in pts for k in p["impls"]}):
            ys = [p["impls"].get(impl, {}).get("gpu_us", float("nan")) for p in pts]
            ax.plot(bs, ys, marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"decode {hk}/{hv} heads, {pool} pool")
        ax.set_xlabel("batch")
        ax.set_ylabel("GPU µs per call (graph replay)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
