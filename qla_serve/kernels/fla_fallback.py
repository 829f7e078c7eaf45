"""flash-linear-attention (Triton) fallback for CUDA GPUs without qla_serve TileLang kernels.

Same contracts as kernels/reference.py, computed by FLA 0.6's chunk_gated_delta_rule (prefill)
and fused_recurrent_gated_delta_rule (decode) with ``state_v_first=True`` (the pool layout).
FLA has no in-place pool indexing, so states are gathered out of the pool and scattered back;
masking the padding slots syncs the host once per call. A compatibility path, not a fast one.
"""

from __future__ import annotations

import torch


def _gather(pool, slot_ids, has_initial_state):
    ids = slot_ids.long()
    use = ids >= 0
    if has_initial_state is not None:
        use = use & has_initial_state
    init = pool[ids.clamp(min=0)].float()
    return init * use[:, None, None, None].to(init.dtype)


def _scatter(pool, slot_ids, final):
    live = slot_ids.long() >= 0
    pool[slot_ids.long()[live]] = final[live].to(pool.dtype)


def _nonempty(plan):
    """(indices [M], cu_seqlens [M+1]) of the plan's non-empty sequences, on the device, built
    once per plan from host lengths: FLA 0.6 (which hands prefill to FlashQLA when installed)
    rejects 0-length sequences."""
    def make():
        idx = [i for i, n in enumerate(plan.seq_lens) if n > 0]
        cu = plan.cu_seqlens_cpu
        return (torch.tensor(idx, dtype=torch.long).to(plan.device),
                torch.tensor([0] + [cu[i + 1] for i in idx], dtype=torch.long).to(plan.device))
    return plan.scratch("fla_nonempty", make)


def prefill(q, k, v, g, beta, pool, slot_ids, plan, *, has_initial_state, scale, out, checkpoints=None):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if checkpoints is not None:  # (an engine adapter asks for them only where the path writes them)
        raise ValueError("checkpoints: the FLA path does not write prefill checkpoints; use the TileLang "
                         "or the reference path (QLA_SERVE_OP_PATH)")

    if q.dtype != v.dtype:  # fp16 q/k beside bf16 v (gdn_prefill_inputs' qk_dtype): FLA takes one dtype
        q, k = q.to(v.dtype), k.to(v.dtype)
    init = _gather(pool, slot_ids, has_initial_state)
    final = init.clone()  # an empty sequence ends where it started
    idx, cu = _nonempty(plan)
    if idx.numel():
        o, final_live = chunk_gated_delta_rule(
            q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=init[idx],
            output_final_state=True, state_v_first=True, cu_seqlens=cu)
        out.copy_(o[0])
        final[idx] = final_live
    _scatter(pool, slot_ids, final)


def decode(q, k, v, pool, slot_ids, *, g, beta, a, b, A_log, dt_bias, use_qk_l2norm, scale, out,
           after_conv=False):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    if g is None:
        from qla_serve.kernels.reference import fused_gating
        g, beta = fused_gating(a, b, A_log, dt_bias)
    init = _gather(pool, slot_ids, None)
    o, final = fused_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], scale=scale,
        initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
        state_v_first=True)
    out.copy_(o[:, 0] * (slot_ids >= 0)[:, None, None].to(out.dtype))
    _scatter(pool, slot_ids, final)
