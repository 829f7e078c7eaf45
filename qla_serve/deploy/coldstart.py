"""Cold start on a GPU: first-call latency of every op, and how many kernels it compiled.

The proof that a precompiled cache means no compilation at serve time::

    # 1. without a GPU (CUDA hidden), fill a cache for the deployment
    CUDA_VISIBLE_DEVICES= TILELANG_CACHE_DIR=$PWD/.devbundle/tlcache \
        qla-serve precompile --config configs/deploy/qwen3.5-397b-a17b-tp8.yaml --arch sm_90a
    # 2. on the GPU, with that cache: expect "compilations": 0
    TILELANG_CACHE_DIR=$PWD/.devbundle/tlcache python -m qla_serve.deploy.coldstart \
        --config configs/deploy/qwen3.5-397b-a17b-tp8.yaml
    # 3. "before": the same with an empty cache (every first call compiles)
    TILELANG_CACHE_DIR=$(mktemp -d) python -m qla_serve.deploy.coldstart --config ...

It runs, in one fresh process, the ops a deployment calls with its TP-local heads and
dtypes: prefill under each strategy the kernels support (plain, vsplit, cp: each a
different kernel variant), decode with g/beta and with fused a/b gating (l2norm on and
off), and verify. Compilations are counted as new entries in TileLang's cache directory
(the same measure `qla-serve precompile` uses). Prints JSON; exit 1 if any op compiled.
Needs CUDA; this module is not imported by anything else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _ms(fn, torch) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def run(config_path: str, long_len: int = 16384, seed: int = 0) -> dict:
    import torch

    import qla_serve
    from qla_serve.deploy import load_config
    from qla_serve.deploy.precompile import _cache_entries, cache_dir

    if not torch.cuda.is_available():
        raise RuntimeError("coldstart: needs a CUDA GPU")
    cfg = load_config(config_path)
    hk, hv = cfg.local_k_heads, cfg.local_v_heads
    dev = torch.device("cuda")
    io = getattr(torch, cfg.model.dtype)
    sdt = getattr(torch, cfg.qla.state_dtype)
    gen = torch.Generator(device=dev).manual_seed(seed)
    root = cache_dir()
    before = _cache_entries(root)
    results: dict[str, dict] = {}

    def qkv(T):
        q = torch.nn.functional.normalize(torch.randn(T, hk, 128, device=dev, generator=gen), dim=-1).to(io)
        k = torch.nn.functional.normalize(torch.randn(T, hk, 128, device=dev, generator=gen), dim=-1).to(io)
        v = torch.randn(T, hv, 128, device=dev, generator=gen).to(io)
        g = -torch.rand(T, hv, device=dev, generator=gen) * 0.2
        beta = torch.rand(T, hv, device=dev, generator=gen) * 0.9 + 0.05
        return q, k, v, g, beta

    def record(name, fn):
        n0 = len(_cache_entries(root))
        first = _ms(fn, torch)
        second = _ms(fn, torch)
        results[name] = {"first_ms": round(first, 3), "second_ms": round(second, 3),
                         "compiled": len(_cache_entries(root)) - n0}

    pool = torch.zeros(9, hv, 128, 128, device=dev, dtype=sdt)
    from qla_serve.ops import supported_prefill_strategies

    supported = sorted(supported_prefill_strategies(dev))
    shapes = {"plain": [512] * 8, "vsplit": [4096, 4096], "cp": [long_len]}
    for strategy in supported:
        lens = shapes.get(strategy, [1024])
        plan = qla_serve.plan_prefill(lens, hv, hk, device=dev, cp=cfg.qla.cp if strategy == "cp" else "auto",
                                      supported_strategies={strategy})
        q, k, v, g, beta = qkv(sum(lens))
        slots = torch.arange(1, len(lens) + 1, dtype=torch.int32, device=dev)
        record(f"prefill[{plan.strategy}]",
               lambda: qla_serve.gdn_prefill(q, k, v, g, beta, pool, slots, plan))
        if io != torch.float16:  # the engine layers' form: fp16 q/k (gdn_prefill_inputs' qk_dtype)
            q16, k16 = q.half(), k.half()
            record(f"prefill[{plan.strategy},qk-fp16]",
                   lambda: qla_serve.gdn_prefill(q16, k16, v, g, beta, pool, slots, plan))

    B = 8
    slots = torch.arange(1, B + 1, dtype=torch.int32, device=dev)
    q, k, v, g, beta = qkv(B)
    record("decode[g,beta]", lambda: qla_serve.gdn_decode(q, k, v, pool, slots, g=g, beta=beta))
    a = torch.randn(B, hv, device=dev, generator=gen).to(io)
    b = torch.randn(B, hv, device=dev, generator=gen).to(io)
    A_log = torch.randn(hv, device=dev, generator=gen) * 0.5
    dt_bias = torch.randn(hv, device=dev, generator=gen) * 0.5
    for l2 in (False, True):
        record(f"decode[a,b,l2norm={l2}]", lambda: qla_serve.gdn_decode(
            q, k, v, pool, slots, a=a, b=b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=l2))

    # the layers' prefill preamble: A_log / dt_bias as each engine holds them (both fp32, both in
    # the model dtype: vLLM, fp32 beside the model dtype: SGLang), and q/k only (SGLang's extend);
    # fp16 q/k out, as the layers ask, and once in q's dtype (the default)
    for name, pdt, bdt in (("fp32", torch.float32, torch.float32), ("model", io, io), ("sglang", torch.float32, io)):
        record(f"prefill_inputs[a,b,{name}]", lambda: qla_serve.gdn_prefill_inputs(
            q, k, a, b, A_log.to(pdt), dt_bias.to(bdt), qk_dtype=torch.float16))
    record("prefill_inputs[q,k]", lambda: qla_serve.gdn_prefill_inputs(q, k, qk_dtype=torch.float16))
    record("prefill_inputs[q,k,q's dtype]", lambda: qla_serve.gdn_prefill_inputs(q, k))

    D = 4
    qv, kv, vv, gv, bv = qkv(B * D)
    cu = torch.arange(0, B * D + 1, D, dtype=torch.int32, device=dev)
    inter = torch.zeros(B, D, hv, 128, 128, device=dev, dtype=sdt)
    ids = torch.arange(B, dtype=torch.int32, device=dev)
    record("verify[g,beta]", lambda: qla_serve.gdn_verify(qv, kv, vv, pool, slots, cu, inter, ids, g=gv, beta=bv))

    return {"config": cfg.name, "heads": cfg.heads, "state_dtype": cfg.qla.state_dtype,
            "gpu": torch.cuda.get_device_name(0), "cache_dir": root,
            "compilations": len(_cache_entries(root) - before), "ops": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qla_serve.deploy.coldstart", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--long-len", type=int, default=16384, help="tokens of the context-parallel prefill")
    a = ap.parse_args(argv)
    out = run(a.config, a.long_len)
    print(json.dumps(out, indent=2))
    return 0 if out["compilations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
