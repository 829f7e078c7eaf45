# Smoke test of the vLLM 0.33 GDN ops bundle (make_vllm_ops_bundle.sh) on a CUDA GPU. From the repo root:
#   source .vllmops/activate.sh && [ "$VLLM_OPS_BUNDLE_READY" = 1 ] && python benchmarks/vllm_ops_smoke.py
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
import triton

from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from vllm.platforms import current_platform
from vllm.third_party.flash_linear_attention.ops import (
    fused_post_conv_prep,
    fused_recurrent_gated_delta_rule_packed_decode,
)
from vllm.third_party.flash_linear_attention.ops.chunk import l2norm_fwd
from vllm.third_party.flash_linear_attention.ops import utils as fla_utils
from smoke_check import Checks  # benchmarks/smoke_check.py, beside this script

print("torch", torch.__version__, torch.version.cuda, "triton", triton.__version__,
      torch.cuda.get_device_name(0), "pdl", current_platform.is_arch_support_pdl(),
      "is_nvidia_hopper", fla_utils.is_nvidia_hopper, "einops", sys.modules.get("einops"))
torch.manual_seed(0)
dev = "cuda"
bf = torch.bfloat16
H, HV, K, V, W, S = 2, 4, 128, 128, 4, 8
dim = 2 * H * K + HV * V


check = Checks()


def ref_conv(x, w, state, init):  # x [T, dim], w [dim, W], state [dim, W-1]
    pre = state.float() if init else torch.zeros(dim, W - 1, device=dev)
    xx = torch.cat([pre, x.float().T], dim=1)  # [dim, W-1+T]
    out = torch.stack([(xx[:, t:t + W] * w.float()).sum(1) for t in range(x.shape[0])], 0)
    return F.silu(out), xx[:, -(W - 1):]


# ---- causal_conv1d_fn (prefill), SD conv-state layout as vLLM allocates it by default
seqlens = [5, 17, 1]
slots = [3, 1, 6]
init = [True, False, True]
T = sum(seqlens)
qsl_cpu = torch.tensor(np.concatenate([[0], np.cumsum(seqlens)]), dtype=torch.int32)
qsl = qsl_cpu.to(dev)
w = torch.randn(dim, W, device=dev, dtype=bf) * 0.3
conv_cache = torch.randn(S, W - 1, dim, device=dev, dtype=bf)  # SD storage
qkvz = torch.randn(T, dim + HV * V, device=dev, dtype=bf)
mixed_qkv = qkvz[:, :dim]  # strided view, as Qwen3.5 splits qkvz
for use_meta in (False, True):
    cs = conv_cache.clone()
    conv_state = cs.transpose(-1, -2)  # [S, dim, W-1], dim contiguous
    meta = None
    if use_meta:  # what compute_causal_conv1d_metadata builds (BLOCK_M=8 only)
        sl = qsl_cpu.diff()
        nums = -(-sl // 8)
        mlist = torch.from_numpy(np.repeat(np.arange(len(nums)), nums))
        offs = torch.tensor([i for n in nums.tolist() for i in range(n)], dtype=torch.int32)
        n_max = max(1024, len(mlist)) * 2
        bp = torch.full((n_max,), -1, dtype=torch.int32, device=dev)
        tp = torch.full((n_max,), -1, dtype=torch.int32, device=dev)
        bp[: len(mlist)].copy_(mlist)
        tp[: len(mlist)].copy_(offs)
        meta = SimpleNamespace(
            nums_dict={8: dict(nums=nums, tot=int(nums.sum()), mlist=mlist, mlist_len=len(mlist),
                               offsetlist=offs, batch_ptr=bp, token_chunk_offset_ptr=tp)},
            batch_ptr=bp, token_chunk_offset_ptr=tp)
    out = causal_conv1d_fn(
        mixed_qkv.transpose(0, 1), w, None, activation="silu", conv_states=conv_state,
        has_initial_state=torch.tensor(init, device=dev),
        cache_indices=torch.tensor(slots, dtype=torch.int32, device=dev),
        query_start_loc=qsl, metadata=meta).transpose(0, 1)
    print("conv_fn out", tuple(out.shape), out.stride(), out.dtype)
    for i, (s, n) in enumerate(zip(slots, seqlens)):
        a0, a1 = int(qsl_cpu[i]), int(qsl_cpu[i + 1])
        r, rs = ref_conv(mixed_qkv[a0:a1], w, conv_cache[s].T, init[i])
        check(f"conv_fn meta={use_meta} seq{i} out", out[a0:a1], r, 3e-2)
        check(f"conv_fn meta={use_meta} seq{i} state", conv_state[s], rs, 1e-2)

# ---- causal_conv1d_update (decode, in place on x when out=None)
B = 3
dslots = torch.tensor([2, 0, 5], dtype=torch.int32, device=dev)  # 0 = NULL_BLOCK_ID: skipped
cs = conv_cache.clone()
conv_state = cs.transpose(-1, -2)
xd_full = torch.randn(B, dim + HV * V, device=dev, dtype=bf)
xd = xd_full[:, :dim]
xd0 = xd.clone()
o = causal_conv1d_update(xd, conv_state, w, None, "silu", conv_state_indices=dslots, validate_data=False)
print("conv_update returns x itself:", o.data_ptr() == xd.data_ptr())
for i, s in enumerate(dslots.tolist()):
    if s == 0:
        check("conv_update null slot left x untouched", xd[i], xd0[i], 0)
        continue
    r, rs = ref_conv(xd0[i:i + 1], w, conv_cache[s].T, True)
    check(f"conv_update row{i} out", xd[i], r[0], 3e-2)
    check(f"conv_update row{i} state", conv_state[s], rs, 1e-2)

# ---- fused_post_conv_prep
L = 37
conv_out = torch.randn(L, dim, device=dev, dtype=bf)
a = torch.randn(L, HV, device=dev, dtype=bf)
b = torch.randn(L, HV, device=dev, dtype=bf)
A_log = torch.randn(HV, device=dev, dtype=torch.float32)
dt_bias = torch.randn(HV, device=dev, dtype=bf)
q, k, v, g, beta = fused_post_conv_prep(conv_out, a, b, A_log, dt_bias, num_k_heads=H, head_k_dim=K,
                                        head_v_dim=V, apply_l2norm=True, output_g_exp=False)
for n, t in zip("q k v g beta".split(), (q, k, v, g, beta)):
    print("post_conv", n, tuple(t.shape), t.dtype, t.is_contiguous())
rq = F.normalize(conv_out[:, :H * K].float().view(L, H, K), dim=-1, eps=1e-6)
rk = F.normalize(conv_out[:, H * K:2 * H * K].float().view(L, H, K), dim=-1, eps=1e-6)
rg = -A_log.exp() * F.softplus(a.float() + dt_bias.float())
check("post_conv q", q, rq, 1e-2)
check("post_conv k", k, rk, 1e-2)
check("post_conv v", v, conv_out[:, 2 * H * K:].view(L, HV, V), 0)
check("post_conv g (log space)", g, rg, 1e-4)
check("post_conv beta", beta, b.float().sigmoid(), 1e-5)
check("l2norm_fwd", l2norm_fwd(conv_out[:, :H * K].contiguous().view(L, H, K)), rq, 1e-2)

# ---- fused_recurrent_gated_delta_rule_packed_decode, V-first state [S, HV, V, K]
B = 4
mq_full = torch.randn(B, dim + HV * V, device=dev, dtype=bf)
mq = mq_full[:, :dim]
ad = torch.randn(B, HV, device=dev, dtype=bf)
bd = torch.randn(B, HV, device=dev, dtype=bf)
ssm = torch.randn(S, HV, V, K, device=dev, dtype=torch.float32) * 0.1
ssm0 = ssm.clone()
idx = torch.tensor([3, 0, 7, -1], dtype=torch.int32, device=dev)
out = torch.full((B, 1, HV, V), 7.0, device=dev, dtype=bf)
scale = K ** -0.5
r_o, r_s = fused_recurrent_gated_delta_rule_packed_decode(
    mixed_qkv=mq, a=ad, b=bd, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=ssm,
    out=out, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
print("packed_decode returns (out, initial_state):", r_o is out, r_s is ssm)
for n, s in enumerate(idx.tolist()):
    if s <= 0:
        check(f"decode row{n} idx={s}: zero output", out[n], torch.zeros_like(out[n]), 0)
        continue
    qq = F.normalize(mq[n, :H * K].float().view(H, K), dim=-1, eps=1e-6) * scale
    kk = F.normalize(mq[n, H * K:2 * H * K].float().view(H, K), dim=-1, eps=1e-6)
    vv = mq[n, 2 * H * K:].float().view(HV, V)
    gg = -A_log.exp() * F.softplus(ad[n].float() + dt_bias.float())
    bb = bd[n].float().sigmoid()
    h = ssm0[s].clone()
    rep = HV // H
    for hv in range(HV):
        hh = h[hv] * gg[hv].exp()
        vn = (vv[hv] - hh @ kk[hv // rep]) * bb[hv]
        hh = hh + torch.outer(vn, kk[hv // rep])
        h[hv] = hh
        check(f"decode row{n} hv{hv} o", out[n, 0, hv], hh @ qq[hv // rep], 2e-2)
    check(f"decode row{n} state slot {s} (in place)", ssm[s], h, 1e-4)
untouched = [s for s in range(S) if s not in idx.tolist()]
check("decode other slots untouched", ssm[untouched], ssm0[untouched], 0)
torch.cuda.synchronize()
check.exit()
