"""GPU tests of the prefill-input kernel (kernels/hopper/prefill_inputs.py) against float64.

Fresh random inputs: q/k as strided views of one fused projection (as the engines pass them),
raw a, b in the io dtype with A_log, dt_bias in the dtype pairs the engines use (both fp32; both
bf16; SGLang's fp32 A_log beside a bf16 dt_bias), token counts that do not fill the last CTA.
The truth is reference.l2norm / reference.fused_gating in float64 on the same rounded inputs.
Bounds: q/k are stored in the output dtype (q's, or fp16 from bf16: what the engine layers ask
for), so their relative L2 error is that rounding's (bf16 unit roundoff 2^-9: <= 3e-3; fp16
2^-11: <= 1e-3); g and beta are fp32 (<= 1e-5). Every output
element is written (the outputs start as NaN) and nothing past T is (guard rows).
"""

import importlib

import pytest
import torch

from gdn_inputs import rel_err
from qla_serve.kernels import reference

pytestmark = pytest.mark.gpu
P = importlib.import_module("qla_serve.kernels.hopper.prefill_inputs")

BF, HF = torch.bfloat16, torch.float16
CASES = [  # Hk, Hv, T, io, q/k output dtype, A_log dtype, dt_bias dtype
    (2, 8, 1, BF, BF, torch.float32, torch.float32),
    (2, 8, 4099, BF, BF, torch.float32, BF),
    (2, 8, 4099, BF, HF, torch.float32, BF),
    (2, 8, 300, HF, HF, HF, HF),
    (16, 64, 37, BF, BF, BF, BF),
    (16, 64, 37, BF, HF, torch.float32, torch.float32),
    (1, 1, 17, BF, HF, torch.float32, torch.float32),
    (4, 16, 8192, BF, BF, torch.float32, BF),
]


def _inputs(Hk, Hv, T, io, pdt, bdt, gen):
    fused = torch.randn(T, (2 * Hk + Hv) * 128, generator=gen, device="cuda").mul_(3).to(io)
    q = fused[:, : Hk * 128].view(T, Hk, 128)
    k = fused[:, Hk * 128: 2 * Hk * 128].view(T, Hk, 128)
    ab = (torch.randn(T, 2 * Hv, generator=gen, device="cuda") * 4).to(io)  # softplus both sides of 20
    a, b = ab[:, :Hv], ab[:, Hv:]
    A_log = torch.log(torch.rand(Hv, generator=gen, device="cuda") * 15 + 1).to(pdt)
    dt_bias = (torch.rand(Hv, generator=gen, device="cuda") * 40 - 20).to(bdt)
    return q, k, a, b, A_log, dt_bias


def _outputs(T, Hk, Hv, out, guard=3):
    """NaN-filled outputs (q/k in `out`) with `guard` extra rows past T that must stay NaN."""
    bufs = [torch.full((T + guard, Hk, 128), float("nan"), dtype=out, device="cuda") for _ in range(2)]
    bufs += [torch.full((T + guard, Hv), float("nan"), device="cuda") for _ in range(2)]
    return bufs, [x[:T] for x in bufs]


@pytest.mark.parametrize("Hk,Hv,T,io,out,pdt,bdt", CASES)
def test_prefill_inputs_match_float64(Hk, Hv, T, io, out, pdt, bdt):
    gen = torch.Generator(device="cuda").manual_seed(7 * T + Hv + (out == HF))
    q, k, a, b, A_log, dt_bias = _inputs(Hk, Hv, T, io, pdt, bdt, gen)
    bufs, (qo, ko, go, bo) = _outputs(T, Hk, Hv, out)
    P.prefill_inputs(q, k, a, b, A_log, dt_bias, q_out=qo, k_out=ko, g_out=go, beta_out=bo)
    torch.cuda.synchronize()
    tol = 3e-3 if out == torch.bfloat16 else 1e-3
    assert rel_err(qo, reference.l2norm(q.double())) <= tol
    assert rel_err(ko, reference.l2norm(k.double())) <= tol
    g64 = -torch.exp(A_log.double()) * torch.nn.functional.softplus(a.double() + dt_bias.double())
    assert rel_err(go, g64) <= 1e-5
    assert rel_err(bo, torch.sigmoid(b.double())) <= 1e-5
    for full, x in zip(bufs, (qo, ko, go, bo)):
        assert not torch.isnan(x).any(), "an output element was not written"
        assert torch.isnan(full[T:]).all(), "a row past T was written"


def test_qk_only_and_the_public_op():
    """Without gates only q/k are made (SGLang's extend); the public op takes the TileLang path
    on the GPU and returns the kernel's results."""
    import qla_serve

    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, a, b, A_log, dt_bias = _inputs(2, 8, 777, torch.bfloat16, torch.float32, torch.bfloat16, gen)
    assert qla_serve.explain_path("prefill_inputs", q.device)[0] == "tilelang"
    qn, kn, g, beta = qla_serve.gdn_prefill_inputs(q, k, a, b, A_log, dt_bias)
    qn2, kn2, g2, beta2 = qla_serve.gdn_prefill_inputs(q, k)
    assert g2 is None and beta2 is None
    assert torch.equal(qn, qn2) and torch.equal(kn, kn2)
    assert rel_err(qn, reference.l2norm(q.double())) <= 3e-3
    # the layers' form: fp16 out of bf16 in, the same math rounded once to fp16
    qh, kh, _, _ = qla_serve.gdn_prefill_inputs(q, k, qk_dtype=torch.float16)
    assert qh.dtype == kh.dtype == torch.float16 and qh.is_contiguous()
    assert rel_err(qh, reference.l2norm(q.double())) <= 1e-3 and rel_err(kh, reference.l2norm(k.double())) <= 1e-3
    g_ref, beta_ref = reference.fused_gating(a, b, A_log, dt_bias)
    assert rel_err(g, g_ref) <= 1e-5 and rel_err(beta, beta_ref) <= 1e-5
