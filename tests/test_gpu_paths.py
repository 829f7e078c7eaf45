"""Every dispatch path on a CUDA GPU against the float64 recurrence (marker gpu).

Runs the public ops with the path forced (QLA_SERVE_OP_PATH) so the FLA fallback and the
reference-on-GPU are checked too, not only whatever `auto` picks on this machine.
"""

import pytest
import torch

import qla_serve
from qla_serve.kernels import reference as R

from gdn_inputs import make_inputs, rel_err

pytestmark = pytest.mark.gpu


def _available(path):
    try:
        import os
        old = os.environ.get("QLA_SERVE_OP_PATH")
        os.environ["QLA_SERVE_OP_PATH"] = path
        qla_serve.explain_path("prefill", "cuda")
        return True
    except RuntimeError:
        return False
    finally:
        if old is None:
            os.environ.pop("QLA_SERVE_OP_PATH", None)
        else:
            os.environ["QLA_SERVE_OP_PATH"] = old


@pytest.mark.parametrize("path", ["auto", "tilelang", "fla", "reference"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_decode_per_path(path, pool_dtype, monkeypatch):
    if path != "auto" and not _available(path):
        pytest.skip(f"path {path} not available on this GPU")
    monkeypatch.setenv("QLA_SERVE_OP_PATH", path)
    lens, Hk, Hv = [300, 1, 0, 64, 129], 2, 8
    q, k, v, g, beta = make_inputs(lens, Hk, Hv, seed=101)
    pool = (torch.randn(8, Hv, 128, 128, dtype=torch.float64) * 0.05).to("cuda", pool_dtype)
    before = pool.clone()
    slots = torch.tensor([6, 2, 3, -1, 0], dtype=torch.int32)
    has_init = torch.tensor([True, False, True, True, True], device="cuda")
    plan = qla_serve.plan_prefill(lens, Hv, Hk, device="cuda")
    dev = lambda x, dt: x.to("cuda", dt)  # noqa: E731
    o = qla_serve.gdn_prefill(dev(q, torch.bfloat16), dev(k, torch.bfloat16), dev(v, torch.bfloat16),
                              dev(g, torch.float32), dev(beta, torch.float32), pool, slots.cuda(), plan,
                              has_initial_state=has_init)
    init = before.double()[slots.clamp(min=0).long().cuda()]
    init[~(has_init & (slots.cuda() >= 0))] = 0
    qb, kb, vb = (x.to(torch.bfloat16).double() for x in (q, k, v))
    o_ref, s_ref = R.recurrent_gdn(qb.cuda(), kb.cuda(), vb.cuda(), g.cuda(), beta.cuda(),
                                   plan.cu_seqlens_cpu, init)
    tol_o, tol_s = (2e-3, 2e-3) if pool_dtype == torch.float32 else (1e-2, 1e-2)
    if path == "fla":  # FLA keeps bf16 intermediates: ~3.5-4.5e-3 on o (benchmarks/prefill.md)
        tol_o, tol_s = max(tol_o, 6e-3), max(tol_s, 6e-3)
    assert torch.isfinite(o).all()
    cu = plan.cu_seqlens_cpu
    pad_rows = slice(cu[3], cu[4])                     # sequence 3 (64 tokens) is padding
    if qla_serve.explain_path("prefill", "cuda", torch.bfloat16)[0] != "tilelang":
        assert torch.count_nonzero(o[pad_rows]) == 0   # zeros on the reference / FLA paths (README)
        o_ref[pad_rows] = 0
    assert rel_err(o, o_ref) < tol_o
    live = [0, 1, 2, 4]
    assert rel_err(pool[slots[live].long().cuda()], s_ref[live]) < tol_s
    assert torch.equal(pool[[1, 4, 5, 7]], before[[1, 4, 5, 7]])   # untouched slots, bit-identical

    # then one decode step with raw gating and in-kernel l2norm
    B = 3
    gen = torch.Generator().manual_seed(7)
    qd = torch.randn(B, Hk, 128, generator=gen).cuda().bfloat16()
    kd = torch.randn(B, Hk, 128, generator=gen).cuda().bfloat16()
    vd = torch.randn(B, Hv, 128, generator=gen).cuda().bfloat16()
    # as the engines pass them: a, b in the activation dtype, A_log and dt_bias in fp32
    a, b = torch.randn(B, Hv, generator=gen).cuda().bfloat16(), torch.randn(B, Hv, generator=gen).cuda().bfloat16()
    A_log, dt_bias = torch.randn(Hv, generator=gen).cuda() * 0.3, torch.randn(Hv, generator=gen).cuda()
    ids = torch.tensor([6, -1, 0], dtype=torch.int32, device="cuda")
    state0 = pool.double()[ids.clamp(min=0).long()]
    state0[1] = 0
    od = qla_serve.gdn_decode(qd, kd, vd, pool, ids, a=a, b=b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True)
    gg, bb = R.fused_gating(a.double(), b.double(), A_log.double(), dt_bias.double())
    od_ref, sd_ref = R.recurrent_gdn(R.l2norm(qd.double()), R.l2norm(kd.double()), vd.double(), gg, bb,
                                     list(range(B + 1)), state0)
    od_ref[1] = 0
    assert rel_err(od, od_ref) < tol_o
    assert rel_err(pool[[6, 0]], sd_ref[[0, 2]]) < tol_s
