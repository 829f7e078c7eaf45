# Smoke test of the SGLang 0.5.23 GDN decode-ops bundle (make_sglang_ops_bundle.sh) on a CUDA GPU.
# Run from the repo root:
#   source .sglops/activate.sh && [ "$SGLANG_OPS_BUNDLE_READY" = 1 ] && python benchmarks/sglang_ops_smoke.py
# Each op is called the way SGLang 0.5.23's GDN layer / GDNAttnBackend.forward_decode calls it
# (bf16 activations and conv state, conv weight [dim, W] with W = 4, no conv bias, silu, int32 slot
# indices, PAD_SLOT_ID = -1) and compared with a torch reference.
import sys

import torch
import torch.nn.functional as F
import triton

from sglang.kernels.jit.utils import is_arch_support_pdl
from sglang.kernels.ops.attention.fla.fused_recurrent import fused_recurrent_gated_delta_rule_packed_decode
from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating
from sglang.kernels.ops.attention.triton_gdn_fused_proj import (
    fused_qkvzba_causal_conv1d_update_contiguous,
    fused_qkvzba_split_reshape_cat,
    fused_qkvzba_split_reshape_cat_contiguous,
)
from sglang.kernels.ops.mamba.causal_conv1d_triton import PAD_SLOT_ID, causal_conv1d_update
from smoke_check import Checks  # benchmarks/smoke_check.py, beside this script

print("torch", torch.__version__, torch.version.cuda, "triton", triton.__version__,
      torch.cuda.get_device_name(0), "pdl", is_arch_support_pdl(), "PAD_SLOT_ID", PAD_SLOT_ID,
      "packaging", sys.modules["packaging"].__file__)
torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
H, HV, K, V, W, S, B = 2, 4, 128, 128, 4, 8, 5   # TP-local k heads, v heads, dims, conv width, slots, batch
dim = 2 * H * K + HV * V                          # conv dim = qkv_dim


check = Checks()


def ref_conv_update(x, state, w, bias):
    """Causal conv1d update, one token: x [B, dim], state [B, dim, W-1] (oldest first), w [dim, W].
    Returns (silu(bias + sum_j w[:, j] * window[:, j]) with window = state ++ x, new state).
    fp32 math; the Triton kernels multiply bf16 x bf16 (rounded to bf16) into an fp32 sum."""
    window = torch.cat([state.float(), x.float().unsqueeze(-1)], dim=-1)   # [B, dim, W]
    acc = (window * w.float()).sum(-1)
    if bias is not None:
        acc = acc + bias.float()
    return F.silu(acc), window[..., 1:]


# ---- 1. causal_conv1d_update: the decode conv of GDNAttnBackend.forward_decode (Triton on CUDA)
#      mixed_qkv = causal_conv1d_update(mixed_qkv, conv_states, layer.conv_weights, layer.bias,
#                                       layer.activation, conv_state_indices=cache_indices)
w = torch.randn(dim, W, device=dev, dtype=bf) * 0.3                    # conv1d.weight viewed [dim, W]
conv0 = torch.randn(S, dim, W - 1, device=dev, dtype=bf)              # one layer's pool slice [S, dim, W-1]
idx = torch.tensor([3, 0, PAD_SLOT_ID, 7, 5], dtype=torch.int32, device=dev)
for bias in (None, torch.randn(dim, device=dev, dtype=bf)):
    tag = "bias" if bias is not None else "no bias"
    conv = conv0.clone()
    x = torch.randn(B, dim, device=dev, dtype=bf)
    x0 = x.clone()
    out = causal_conv1d_update(x, conv, w, bias, "silu", conv_state_indices=idx)
    print(f"conv_update ({tag}) out", tuple(out.shape), out.stride(), out.dtype,
          "new tensor:", out.data_ptr() != x.data_ptr())
    check(f"conv_update ({tag}) x not modified", x, x0, 0)
    for r, s in enumerate(idx.tolist()):
        if s == PAD_SLOT_ID:
            continue  # output row left uninitialised (torch.empty_like) by SGLang's Triton kernel
        ro, rs = ref_conv_update(x0[r:r + 1], conv0[s:s + 1], w, bias)
        check(f"conv_update ({tag}) row{r} slot{s} out", out[r], ro[0], 3e-2)
        check(f"conv_update ({tag}) row{r} slot{s} state shifted", conv[s], rs[0], 0)
    untouched = [s for s in range(S) if s not in idx.tolist()]
    check(f"conv_update ({tag}) other slots untouched", conv[untouched], conv0[untouched], 0)

# ---- 2. Qwen3-Next: fused_qkvzba_split_reshape_cat (interleaved per k-head group checkpoint layout)
#      mixed_qkv, z, b, a = fused_qkvzba_split_reshape_cat(qkvz, ba, Hk_tp, Hv_tp, Dk, Dv)
r_ = HV // H
qkvz = torch.randn(B, H * (2 * K + 2 * r_ * V), device=dev, dtype=bf)
ba = torch.randn(B, H * 2 * r_, device=dev, dtype=bf)
mq, z, b, a = fused_qkvzba_split_reshape_cat(qkvz, ba, H, HV, K, V)
g4 = qkvz.view(B, H, 2 * K + 2 * r_ * V)
rq, rk, rv, rz = torch.split(g4, [K, K, r_ * V, r_ * V], dim=2)
rb, ra = torch.split(ba.view(B, H, 2 * r_), [r_, r_], dim=2)
ref_mq = torch.cat([rq.reshape(B, -1), rk.reshape(B, -1), rv.reshape(B, -1)], dim=-1)
print("split (Qwen3-Next)", [(tuple(t.shape), t.stride()) for t in (mq, z, b, a)])
check("split (Qwen3-Next) mixed_qkv", mq, ref_mq, 0)
check("split (Qwen3-Next) z", z, rz.reshape(B, HV, V), 0)
check("split (Qwen3-Next) b", b, rb.reshape(B, HV), 0)
check("split (Qwen3-Next) a", a, ra.reshape(B, HV), 0)

# ---- 3. Qwen3.5: fused_qkvzba_split_reshape_cat_contiguous ([q|k|v|z], [b|a]), ratios 2 and 3
for hv in (HV, 3 * H):
    qkvz = torch.randn(B, 2 * H * K + 2 * hv * V, device=dev, dtype=bf)
    ba = torch.randn(B, 2 * hv, device=dev, dtype=bf)
    mq, z, b, a = fused_qkvzba_split_reshape_cat_contiguous(qkvz, ba, H, hv, K, V)
    d = 2 * H * K + hv * V
    check(f"split (Qwen3.5, Hv/Hk={hv // H}) mixed_qkv", mq, qkvz[:, :d], 0)
    check(f"split (Qwen3.5, Hv/Hk={hv // H}) z", z, qkvz[:, d:].view(B, hv, V), 0)
    check(f"split (Qwen3.5, Hv/Hk={hv // H}) b|a", torch.cat([b, a], -1), ba, 0)

# ---- 4. Qwen3.5 default CUDA decode (SGLANG_ENABLE_GDN_DECODE_FUSED_PROJ_CONV=1): split + conv in one
#      mixed_qkv, z, b, a = fused_qkvzba_causal_conv1d_update_contiguous(qkvz, ba, conv_states,
#          conv_weights, bias, cache_indices, qkv_dim=, v_dim=, num_v_heads=, head_v_dim=, activation="silu")
#      SGLang asserts this is bit-identical to split + causal_conv1d_update (its
#      SGLANG_GDN_DECODE_FUSION_VERIFY_REAL_TENSORS check); checked the same way here.
qkvz = torch.randn(B, dim + HV * V, device=dev, dtype=bf)
ba = torch.randn(B, 2 * HV, device=dev, dtype=bf)
c_fused, c_ref = conv0.clone(), conv0.clone()
mq, z, b, a = fused_qkvzba_causal_conv1d_update_contiguous(
    qkvz, ba, c_fused, w, None, idx, qkv_dim=dim, v_dim=HV * V, num_v_heads=HV, head_v_dim=V,
    activation="silu")
smq, sz, sb, sa = fused_qkvzba_split_reshape_cat_contiguous(qkvz, ba, H, HV, K, V)
umq = causal_conv1d_update(smq, c_ref, w, None, "silu", conv_state_indices=idx)
valid = idx != PAD_SLOT_ID
check("fused split+conv vs split+conv_update: qkv (valid rows, exact)", mq[valid], umq[valid], 0)
check("fused split+conv: pad row passes x through", mq[~valid], qkvz[~valid, :dim], 0)
check("fused split+conv: conv state (exact)", c_fused, c_ref, 0)
check("fused split+conv: z, b, a", torch.cat([z.flatten(1), b, a], -1), torch.cat([sz.flatten(1), sb, sa], -1), 0)

# ---- 5. fused_gdn_gating (SGLang's separate g/beta kernel; its extend path)
A_log = torch.randn(HV, device=dev, dtype=torch.float32)
dt_bias = torch.randn(HV, device=dev, dtype=bf)
ag = torch.randn(B, HV, device=dev, dtype=bf)
bg = torch.randn(B, HV, device=dev, dtype=bf)
g, beta = fused_gdn_gating(A_log, ag, bg, dt_bias)
check("fused_gdn_gating g", g[0], -A_log.exp() * F.softplus(ag.float() + dt_bias.float()), 1e-4)
# beta is stored in fp32 but rounded to b's dtype first (.to(b.dtype.element_ty)): <= half a bf16 ulp
check("fused_gdn_gating beta (bf16-rounded)", beta[0], bg.float().sigmoid(), 2.5e-3)
print("fused_gdn_gating", tuple(g.shape), g.dtype, tuple(beta.shape), beta.dtype)

# ---- 6. fused_recurrent_gated_delta_rule_packed_decode (what --linear-attn-backend triton runs as
#      decode: TritonGDNKernel.packed_decode, gating + l2norm + recurrence fused), state [S, HV, V, K]
mqd = umq.clone()                                      # post-conv packed [B, qkv_dim]
ssm = torch.randn(S, HV, V, K, device=dev, dtype=torch.float32) * 0.1
ssm0 = ssm.clone()
out = mqd.new_empty(B, 1, HV, V)
scale = K ** -0.5
fused_recurrent_gated_delta_rule_packed_decode(
    mixed_qkv=mqd, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=ssm,
    out=out, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
for n, s in enumerate(idx.tolist()):
    if s < 0:
        check(f"packed_decode row{n} slot{s}: zero output", out[n], torch.zeros_like(out[n]), 0)
        continue
    qq = F.normalize(mqd[n, :H * K].float().view(H, K), dim=-1, eps=1e-6) * scale
    kk = F.normalize(mqd[n, H * K:2 * H * K].float().view(H, K), dim=-1, eps=1e-6)
    vv = mqd[n, 2 * H * K:].float().view(HV, V)
    gg = -A_log.exp() * F.softplus(a[n].float() + dt_bias.float())
    bb = b[n].float().sigmoid().to(b.dtype).float()  # the kernel rounds beta to b's dtype
    h = ssm0[s].clone()
    for j in range(HV):
        hh = h[j] * gg[j].exp()
        vn = (vv[j] - hh @ kk[j // r_]) * bb[j]
        h[j] = hh + torch.outer(vn, kk[j // r_])
    check(f"packed_decode row{n} slot{s} out", out[n, 0], torch.stack([h[j] @ qq[j // r_] for j in range(HV)]), 2e-2)
    check(f"packed_decode row{n} slot{s} state (in place)", ssm[s], h, 1e-4)
untouched = [s for s in range(S) if s not in idx.tolist()]
check("packed_decode other slots untouched", ssm[untouched], ssm0[untouched], 0)

torch.cuda.synchronize()
check.exit()
