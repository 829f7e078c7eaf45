"""SGLang 0.5.23's target-verify step: its own, and two routes with flashqla, one GDN layer per call (H200).

* ``sglang``: SGLang without qla_serve (its default ``--linear-attn-backend triton``; on SM90 its
  verify stays Triton, flashinfer_gdn_prefill_default covers prefill only): its conv as below,
  then its Triton backend's ``target_verify``, ``fused_sigmoid_gating_delta_rule_update`` with
  ``disable_state_update`` and the intermediate SSM cache (kernels/gdn_triton.py:217-257);

* ``sglang_qla``: SGLang's route (gdn_backend.py forward_extend, target verify: :1045-1062 and
  :1150-1172): its Triton ``causal_conv1d_update`` over the D draft tokens of every request with
  the intermediate conv window, the conv output's q | k | v as strided views (flashqla's kernel
  declares ``supports_strided_target_verify_qkv``), then the kernel class's ``target_verify``
  (slot ids mapped per layer, then ``gdn_verify``);
* ``qla``: the plugin's takeover (backends/sglang/verify_layer.py): qla_serve's verify conv and
  ``gdn_verify``, the step's ids derived once per forward batch (outside the timed calls, as
  for every layer after a step's first).

SGLang-shaped stand-ins for the backend and its pool (tests/backends/sglang_plugin/
test_verify_layer.py), fp32 or bf16 SSM states, bf16 activations and conv state, conv width 4
with bias, SiLU. GPU us per layer call: a CUDA graph of ``--layers`` calls on distinct caches,
replayed; host issue us per eager call. Checks the two routes agree (outputs, intermediate
states, windows) before timing.

    source .devbundle/activate.sh && source .sglops/activate.sh
    python benchmarks/sglang_verify.py --heads 2/8,16/32 --batches 1,8,32,128 --drafts 2,4
"""

from __future__ import annotations

import argparse
import json
import statistics
from types import SimpleNamespace
from unittest import mock

import torch

from qla_serve.backends.sglang import verify_layer
from qla_serve.backends.sglang.kernel import FlashQLAGDNKernel
from qla_serve.bench import decode as bdec
from qla_serve.bench import source_commit
from qla_serve.kernels.reference import rel_l2

HD, W = 128, 4


def _select_rows(default_indices, req_pool_indices, valid, pool_size):
    return default_indices      # SGLang's default (no pp_spec_stable_rows)


def make_layer(hk, hv, N, D, state_dtype, gen):
    dim, S = (2 * hk + hv) * HD, N + 2
    cache = SimpleNamespace(
        conv=[torch.randn(S, dim, W - 1, generator=gen).cuda().bfloat16()],
        temporal=(torch.randn(S, hv, HD, HD, generator=gen) * 0.1).cuda().to(state_dtype),
        intermediate_ssm=torch.zeros(S, D, hv, HD, HD, dtype=state_dtype, device="cuda"),
        intermediate_conv_window=[torch.zeros(S, D, dim, W - 1, dtype=torch.bfloat16, device="cuda")])
    layer = SimpleNamespace(layer_id=0, conv_weights=(torch.randn(dim, W, generator=gen) * 0.5).cuda().bfloat16(),
                            bias=(torch.randn(dim, generator=gen) * 0.1).cuda().bfloat16(), activation="silu",
                            num_k_heads=hk, head_k_dim=HD, A_log=(torch.rand(hv, generator=gen) - 1.0).cuda(),
                            dt_bias=(torch.randn(hv, generator=gen) * 0.1).cuda().bfloat16())
    return cache, layer


def make_batch(hk, hv, N, D, gen):
    dim = (2 * hk + hv) * HD
    x = torch.randn(N * D, dim, generator=gen).cuda().bfloat16()
    a, b = (torch.randn(N * D, hv, generator=gen).cuda().bfloat16() for _ in range(2))
    meta = SimpleNamespace(mamba_cache_indices=torch.arange(1, N + 1, dtype=torch.int32, device="cuda"),
                           query_start_loc=torch.arange(0, (N + 1) * D, D, dtype=torch.int32, device="cuda"))
    fb = SimpleNamespace(spec_info=SimpleNamespace(draft_token_num=D),
                         req_pool_indices=torch.arange(N, dtype=torch.int64, device="cuda"))
    return x, a, b, meta, fb


def qla_call(cache, layer, x, a, b, meta, fb, N):
    backend = SimpleNamespace(forward_metadata=meta,
                              verify_intermediate_state_indices=torch.arange(N + 2, dtype=torch.int32, device="cuda"),
                              req_to_token_pool=SimpleNamespace(size=N + 1))
    return lambda: verify_layer.forward_verify(backend, layer, fb, x, a, b, cache, select_rows=_select_rows)


def _sglang_route(cache, layer, x, meta, N, D, verify):
    """SGLang's forward_extend target-verify branch: its conv update over the D draft tokens with
    the intermediate conv window (:1045-1062), the output's strided q | k | v views, then
    ``verify(q, k, v, ids)`` (the kernel backend's target_verify; ids: the scratch rows)."""
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

    ids = torch.arange(N + 2, dtype=torch.int32, device="cuda")     # verify_intermediate_state_indices
    hv, hk = cache.temporal.shape[1], layer.num_k_heads
    kd, T = hk * HD, N * D

    def call():
        ci = meta.mamba_cache_indices
        y = causal_conv1d_update(x.view(N, D, -1).transpose(1, 2), cache.conv[0], layer.conv_weights, layer.bias,
                                 layer.activation, conv_state_indices=ci[:N],
                                 intermediate_conv_window=cache.intermediate_conv_window[0],
                                 intermediate_state_indices=ids[:N], retrieve_next_token=None,
                                 retrieve_next_sibling=None, retrieve_parent_token=None)
        y = y.transpose(1, 2).view(T, -1)
        q, k, v = torch.split(y, [kd, kd, hv * HD], dim=-1)
        return verify(q.view(1, T, hk, HD), k.view(1, T, hk, HD), v.view(1, T, hv, HD), ids)
    return call


def sglang_qla_call(cache, layer, x, a, b, meta, N, D, kernel):
    """SGLang's target verify with flashqla's kernel class (the route before the takeover)."""
    def verify(q, k, v, ids):
        return kernel.target_verify(layer.A_log, layer.dt_bias, q, k, v, a, b, ssm_states=cache.temporal,
                                    cache_indices=meta.mamba_cache_indices, query_start_loc=meta.query_start_loc,
                                    intermediate_states_buffer=cache.intermediate_ssm, intermediate_state_indices=ids,
                                    cache_steps=D, retrieve_parent_token=None)
    return _sglang_route(cache, layer, x, meta, N, D, verify)


def sglang_call(cache, layer, x, a, b, meta, N, D):
    """SGLang's target verify with its own Triton verify kernel (kernels/gdn_triton.py:236-257)."""
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update)

    def verify(q, k, v, ids):
        return fused_sigmoid_gating_delta_rule_update(
            A_log=layer.A_log, dt_bias=layer.dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=cache.temporal,
            initial_state_indices=meta.mamba_cache_indices, cu_seqlens=meta.query_start_loc,
            use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
            disable_state_update=True, intermediate_states_buffer=cache.intermediate_ssm,
            intermediate_state_indices=ids, cache_steps=D, retrieve_parent_token=None)
    return _sglang_route(cache, layer, x, meta, N, D, verify)


def check(hk, hv, N, D, state_dtype, kernel) -> dict:
    """Both routes from the same caches: outputs, intermediate states, windows, conv slots."""
    gen = torch.Generator().manual_seed(1)
    cache, layer = make_layer(hk, hv, N, D, state_dtype, gen)
    x, a, b, meta, fb = make_batch(hk, hv, N, D, gen)
    twin = SimpleNamespace(conv=[cache.conv[0].clone()], temporal=cache.temporal.clone(),
                           intermediate_ssm=cache.intermediate_ssm.clone(),
                           intermediate_conv_window=[cache.intermediate_conv_window[0].clone()])
    own = SimpleNamespace(conv=[twin.conv[0].clone()], temporal=twin.temporal.clone(),
                          intermediate_ssm=twin.intermediate_ssm.clone(),
                          intermediate_conv_window=[twin.intermediate_conv_window[0].clone()])
    o_q = qla_call(cache, layer, x, a, b, meta, fb, N)()
    o_s = sglang_qla_call(twin, layer, x, a, b, meta, N, D, kernel)()
    o_own = sglang_call(own, layer, x, a, b, meta, N, D)()
    torch.cuda.synchronize()
    return {"o_rel": rel_l2(o_q.view(-1), o_s.reshape(-1)),
            "states_rel": rel_l2(cache.intermediate_ssm[:N], twin.intermediate_ssm[:N]),   # rows 0..N-1: the table
            "windows_equal": bool(torch.equal(cache.intermediate_conv_window[0], twin.intermediate_conv_window[0])),
            "conv_equal": bool(torch.equal(cache.conv[0], twin.conv[0])),
            "own_o_rel": rel_l2(o_q.view(-1), o_own.reshape(-1)),
            "own_states_rel": rel_l2(cache.intermediate_ssm[:N], own.intermediate_ssm[:N])}


def time_point(hk, hv, N, D, state_dtype, layers, reps, kernel, ab=False) -> dict:
    """GPU and host us of each route; ``ab``: also ``qla_pdl`` and ``qla_plain``, the takeover with
    the verify launched as the conv's dependent at every batch and never
    (verify_layer.AFTER_CONV_MAX_ROWS; ``qla`` takes its default)."""
    gen = torch.Generator().manual_seed(2)
    x, a, b, meta, fb = make_batch(hk, hv, N, D, gen)
    rec = {}
    for impl in ("qla", "qla_pdl", "qla_plain", "sglang_qla", "sglang") if ab else ("qla", "sglang_qla", "sglang"):
        fns = []
        for _ in range(layers):
            cache, layer = make_layer(hk, hv, N, D, state_dtype, gen)
            fns.append(qla_call(cache, layer, x, a, b, meta, fb, N) if impl.startswith("qla")
                       else sglang_qla_call(cache, layer, x, a, b, meta, N, D, kernel) if impl == "sglang_qla"
                       else sglang_call(cache, layer, x, a, b, meta, N, D))
        bound = {"qla_pdl": 1 << 30, "qla_plain": 0}.get(impl, verify_layer.AFTER_CONV_MAX_ROWS)
        with mock.patch.object(verify_layer, "AFTER_CONV_MAX_ROWS", bound):
            fns[0]()          # the step's first layer: qla derives the batch's ids here (once per step)
            gpu = bdec._graph_time_us(torch, fns, reps)
            host = statistics.median(bdec._host_time_us(torch, fns[1], 20) for _ in range(3))
        rec[impl] = {"gpu_us": round(gpu, 2), "host_issue_us": round(host, 1)}
    for impl in ("sglang_qla", "sglang"):
        rec[f"qla_over_{impl}"] = round(rec["qla"]["gpu_us"] / rec[impl]["gpu_us"], 3)
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", default="2/8,16/32")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--drafts", default="2,4")
    p.add_argument("--states", default="fp32,bf16")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", default=None)
    p.add_argument("--ab", action="store_true", help="also time the takeover with its verify launched as the "
                                                     "conv's dependent always (qla_pdl) and never (qla_plain)")
    args = p.parse_args()
    kernel = FlashQLAGDNKernel(("verify",))
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    print("| heads | requests | draft | state | qla GPU us | SGLang conv + flashqla GPU us | SGLang's own GPU us | "
          "qla / before | qla / own | host issue us qla / before / own | check o / states / windows / conv | "
          "own o / states |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for heads in args.heads.split(","):
        hk, hv = map(int, heads.split("/"))
        for N in map(int, args.batches.split(",")):
            for D in map(int, args.drafts.split(",")):
                for st in args.states.split(","):
                    ck = check(hk, hv, N, D, dtypes[st], kernel)
                    t = time_point(hk, hv, N, D, dtypes[st], args.layers, args.reps, kernel, args.ab)
                    rows.append({"heads": heads, "requests": N, "draft": D, "state": st, **t, "check": ck})
                    print(f"| {heads} | {N} | {D} | {st} | {t['qla']['gpu_us']:.1f} | {t['sglang_qla']['gpu_us']:.1f} | "
                          f"{t['sglang']['gpu_us']:.1f} | {t['qla_over_sglang_qla']:.2f} | {t['qla_over_sglang']:.2f} | "
                          f"{t['qla']['host_issue_us']:.0f} / {t['sglang_qla']['host_issue_us']:.0f} / "
                          f"{t['sglang']['host_issue_us']:.0f} | {ck['o_rel']:.1e} / {ck['states_rel']:.1e} / "
                          f"{ck['windows_equal']} / {ck['conv_equal']} | {ck['own_o_rel']:.1e} / "
                          f"{ck['own_states_rel']:.1e} |" + (f" qla_pdl {t['qla_pdl']['gpu_us']:.1f} qla_plain "
                                                              f"{t['qla_plain']['gpu_us']:.1f}" if args.ab else ""),
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "commit": source_commit(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
