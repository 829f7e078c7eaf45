"""Speculative-verify kernels (`verify`, SGLang's intermediate layout; `verify_slots`, vLLM's per-token
slots) in several tiles, kernel alone, one GDN layer's inputs per call (H200).

What the engines hand the kernels in a target-verify step: N requests of D draft tokens, q | k | v
strided views of the conv output [N D, (2 Hk + Hv) 128] (bf16), raw a/b [N D, Hv] (bf16), A_log
fp32, dt_bias bf16, q/k L2 norm in the kernel; fp32 or bf16 states. `verify` reads pool[slot] and
writes the D states to intermediate[id, j]; `verify_slots` reads pool[ids[i, 0]] (one accepted
token) and writes pool[ids[i, j]].

GPU us per call: a CUDA graph of --layers calls on distinct pools (the states come from HBM, as
in a model's layer loop), replayed, median. Before timing, each tile's outputs and states are
compared with the first tile's (relative L2; a different tile sums in a different order). The
kernels' correctness against the float64 reference is the GPU tests' job
(tests/kernels/test_decode_gpu.py), not this script's.

    source .devbundle/activate.sh
    python benchmarks/verify_tiles.py --precompile sm_90a       # on a GPU-less machine: fill the cache
    python benchmarks/verify_tiles.py --tiles bv32,bv16l16-cs,bv4w1l32-cs --json OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch

from qla_serve.bench import decode as bdec
from qla_serve.kernels.reference import rel_l2

dec = bdec._dec()     # the decode module (the package exports a function of that name)

HD = 128
OPS = ("verify", "verify_slots")
TILES = "bv32,bv64,bv32p,bv16l16-cs,bv16l16p-cs,bv8w1l16-cs,bv8w1l16p-cs,bv4w1l32-cs,bv4w1l32p-cs,bv4w1-cs"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Layer:
    """One GDN layer's verify inputs on the device: N requests x D draft tokens."""

    def __init__(self, op, hk, hv, N, D, state, gen):
        dev, T = "cuda", N * D
        self.op, self.N, self.D = op, N, D
        proj = torch.randn(T, (2 * hk + hv) * HD, generator=gen).to(dev, torch.bfloat16)
        self.q = proj[:, :hk * HD].view(T, hk, HD)
        self.k = proj[:, hk * HD:2 * hk * HD].view(T, hk, HD)
        self.v = proj[:, 2 * hk * HD:].view(T, hv, HD)
        ab = torch.randn(T, 2 * hv, generator=gen).to(dev, torch.bfloat16)
        self.a, self.b = ab[:, :hv], ab[:, hv:]
        self.A_log = (torch.rand(hv, generator=gen) - 1.0).to(dev)
        self.dt_bias = (torch.randn(hv, generator=gen) * 0.1).to(dev, torch.bfloat16)
        self.cu = torch.arange(0, T + 1, D, dtype=torch.int32, device=dev)
        self.out = torch.empty(T, hv, HD, dtype=torch.bfloat16, device=dev)
        if op == "verify":
            self.pool = (torch.randn(N + 1, hv, HD, HD, generator=gen) * 0.1).to(dev, state)
            self.slots = torch.arange(1, N + 1, dtype=torch.int32, device=dev)
            self.inter = torch.zeros(N + 1, D, hv, HD, HD, dtype=state, device=dev)
            self.inter_ids = torch.arange(N, dtype=torch.int32, device=dev)
        else:   # vLLM: row i's slots 1 + i D .. (i + 1) D, the first holding the accepted state
            self.pool = (torch.randn(N * D + 1, hv, HD, HD, generator=gen) * 0.1).to(dev, state)
            self.slots = torch.arange(1, N * D + 1, dtype=torch.int32, device=dev).view(N, D)
            self.acc = torch.ones(N, dtype=torch.int32, device=dev)

    def __call__(self):
        gates = dict(a=self.a, b=self.b, A_log=self.A_log, dt_bias=self.dt_bias, use_qk_l2norm=True, scale=None,
                     out=self.out)
        if self.op == "verify":
            dec.verify(self.q, self.k, self.v, self.pool, self.slots, self.cu, self.inter, self.inter_ids,
                       g=None, beta=None, **gates)
        else:
            dec.verify_slots(self.q, self.k, self.v, self.pool, self.slots, self.acc, self.cu, **gates)

    def written(self):
        states = self.inter if self.op == "verify" else self.pool
        return self.out.clone(), states.clone()


def run_point(op, hk, hv, N, D, state, tiles, layers, reps):
    gen = torch.Generator().manual_seed(N * 131 + D)
    calls = [Layer(op, hk, hv, N, D, state, gen) for _ in range(layers)]
    pristine = calls[0].pool.clone()
    rec, first = {}, None
    for tile in tiles:
        dec.TILE_OVERRIDE = tile
        calls[0].pool.copy_(pristine)
        calls[0]()
        got = calls[0].written()
        if first is None:
            first = got
        diff = (rel_l2(got[0], first[0]), rel_l2(got[1], first[1]))
        rec[tile] = {"gpu_us": round(bdec._graph_time_us(torch, calls, reps), 2),
                     "o_rel": diff[0], "states_rel": diff[1]}
    dec.TILE_OVERRIDE = None
    return rec


def precompile(args):
    n = 0
    for op in args.ops.split(","):
        for heads in args.heads.split(","):
            hk, hv = map(int, heads.split("/"))
            for st in args.states.split(","):
                pdt = "float32" if st == "fp32" else "bfloat16"
                for tile in args.tiles.split(","):
                    v = dec._variant(op, hv, hk, "bfloat16", pdt, "ab", "bfloat16", "float32", True, tile,
                                     bias="bfloat16")
                    dec.build(v, args.precompile)
                    n += 1
    print(f"precompiled {n} verify variants for {args.precompile}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--heads", default="2/8,16/32")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--drafts", default="2,4")
    p.add_argument("--states", default="fp32,bf16")
    p.add_argument("--tiles", default=TILES, help="comma-separated tiles (decode.parse_tile); the first is "
                                                  "the reference of the check")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--precompile", metavar="TARGET", default=None,
                   help="only compile the variants this run would use for TARGET into TILELANG_CACHE_DIR")
    args = p.parse_args()
    if args.precompile:
        return precompile(args)
    tiles = args.tiles.split(",")
    print("| op | heads | requests | draft | state | " + " | ".join(tiles) + " | best | worst check o / states |")
    print("|---" * (7 + len(tiles)) + "|")
    rows = []
    for op in args.ops.split(","):
        for heads in args.heads.split(","):
            hk, hv = map(int, heads.split("/"))
            for N in map(int, args.batches.split(",")):
                for D in map(int, args.drafts.split(",")):
                    for st in args.states.split(","):
                        rec = run_point(op, hk, hv, N, D, _DTYPES[st], tiles, args.layers, args.reps)
                        best = min(tiles, key=lambda t: rec[t]["gpu_us"])
                        worst = (max(r["o_rel"] for r in rec.values()), max(r["states_rel"] for r in rec.values()))
                        rows.append({"op": op, "heads": heads, "requests": N, "draft": D, "state": st, "tiles": rec})
                        print(f"| {op} | {heads} | {N} | {D} | {st} | "
                              + " | ".join(f"{rec[t]['gpu_us']:.1f}" for t in tiles)
                              + f" | {best} | {worst[0]:.1e} / {worst[1]:.1e} |", flush=True)
    if args.json:
        from qla_serve.bench import source_commit
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "commit": source_commit(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
