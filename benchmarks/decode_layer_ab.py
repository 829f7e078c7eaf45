"""A GDN layer's decode step, one launch (kernels/hopper/decode_fused.py, per tile) against the two
it fuses (conv_decode, then decode), side by side: GPU us per layer call from CUDA-graph replay
over disjoint slot sets (states from HBM, as `qla-serve bench layer`), each form checked bit for
bit against the two launches on the same caches first.

    python benchmarks/decode_layer_ab.py --heads 2/8,16/32 --batches 1,32,256 \
        --forms two,fused,fused:bv32-mb3,fused:bv32-mb4

A form is "two" or "fused[:tile]" (decode.parse_tile; the tile applies to fp32 pools with bv32
tiles and to bf16 pools with bv64 ones, else the pool's default). A benchmark, not a test.
"""

import argparse

import torch

from qla_serve import layer_ops
from qla_serve.bench import decode as bdec
from qla_serve.bench import layer as L
from qla_serve.kernels.hopper import decode_fused

HD = 128


def call(case, i, form):
    """One layer decode call of slot set i in ``form``."""
    ds, _ = case.slots(i)
    x, a, b, B = case.mixed_qkv, case.a, case.b, case.row.decodes
    kw = dict(conv_weight=case.conv_weight, conv_bias=case.conv_bias, A_log=case.A_log, dt_bias=case.dt_bias)
    if form == "two":
        def run():
            y = layer_ops.causal_conv_decode(x, case.conv_state, ds, conv_weight=case.conv_weight,
                                             conv_bias=case.conv_bias, num_v_heads=case.hv)
            kd = case.hk * HD
            q, k = y[:, :kd].view(B, case.hk, HD), y[:, kd:2 * kd].view(B, case.hk, HD)
            import qla_serve
            qla_serve.gdn_decode(q, k, y[:, 2 * kd:].view(B, case.hv, HD), case.ssm_state, ds, a=a, b=b,
                                 A_log=case.A_log, dt_bias=case.dt_bias, use_qk_l2norm=True, out=case.out)
        return run
    return lambda: layer_ops.gdn_layer_decode(x, a, b, case.conv_state, case.ssm_state, ds, num_k_heads=case.hk,
                                              out=case.out, **kw)


def set_tile(form, pool_dtype):
    tile = form.split(":", 1)[1] if ":" in form else None
    key = "float32" if pool_dtype == torch.float32 else "bfloat16"
    ok = tile is None or tile.startswith("bv32" if key == "float32" else "bv64")
    decode_fused.TILES[key] = tile if ok else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="2/8,16/32")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--states", default="fp32,bf16")
    ap.add_argument("--forms", default="two,fused")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    forms = args.forms.split(",")
    for hk, hv in L.parse_heads(args.heads):
        for state in args.states.split(","):
            sdt = torch.float32 if state == "fp32" else torch.bfloat16
            for B in map(int, args.batches.split(",")):
                row = L.parse_row(f"d{B}")
                nsets = L.slot_sets_for(row, hv, sdt, bdec.L2_FLUSH_BYTES)
                case = L.LayerCase(hk, hv, row, sdt, "cuda", nsets=nsets)
                snap = case.snapshot()
                results = {}
                want = None
                for form in forms:
                    set_tile(form, sdt)
                    case.restore(snap)
                    case.out.fill_(float("nan"))
                    call(case, 0, form)()
                    got = (case.out.clone(), *[b.clone() for b in case.buffers])
                    if want is None:
                        want = got
                    same = all(torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0)) for g, w in zip(got, want))
                    fns = [call(case, i, form) for i in range(nsets)]
                    results[form] = (bdec._graph_time_us(torch, fns, args.reps), same)
                case.restore(snap)
                cells = "  ".join(f"{f} {t:.2f}{'' if ok else ' DIFFERS'}" for f, (t, ok) in results.items())
                print(f"{hk}/{hv} {state} B={B:>3} ({nsets} sets): {cells}", flush=True)
                del case
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
