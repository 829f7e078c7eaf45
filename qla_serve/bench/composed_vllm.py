"""The ``vllm`` composition of `qla-serve bench layer` (bench/layer_composed.py lists the others):

* ``vllm`` (only where vLLM 0.33.0's ops import: on the lent H200, from the bundle
  benchmarks/make_vllm_ops_bundle.sh extracts from vLLM's wheel): what vLLM 0.33.0's stock Qwen GDN
  layer runs on Hopper, called as it calls them (its
  vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py, cited per line below): vLLM's
  Triton ``causal_conv1d_fn`` over every row in place on the conv cache (decodes are 1-token
  sequences), ``fused_post_conv_prep`` (split, l2norm, gating), the decodes of a mixed step through
  ``fused_sigmoid_gating_delta_rule_update``, the prefills through FlashInfer's
  ``chunk_gated_delta_rule`` as vLLM's wrapper calls it (initial states gathered from the pool and
  zeroed where new, final states scattered back); a decode-only step through
  ``causal_conv1d_update`` and ``fused_recurrent_gated_delta_rule_packed_decode``; a step with spec
  decodes (MTP) through its Triton spec path: ``causal_conv1d_update`` with ``num_accepted_tokens``
  (the sliding window) and ``fused_sigmoid_gating_delta_rule_update`` into each draft position's
  slot, beside prefills every input gathered by its token indices and both outputs scattered back
  (what Qwen3-Next runs; bf16 Qwen3.5 with its CUDA MTP kernel runs ``_C`` code the H200 cannot
  load without vLLM's GPU build). Without the prefix caching checkpoints vLLM's default adds (the
  qla rows write none either).
"""

from __future__ import annotations

from .composed_common import HD, ComposedOps, ComposedStep, packed_decode_step


def vllm_ops() -> ComposedOps:
    """vLLM 0.33.0's own GDN ops and FlashInfer's prefill (benchmarks/make_vllm_ops_bundle.sh puts
    vLLM's on the path where vLLM is not installed)."""
    from flashinfer.gdn_prefill import chunk_gated_delta_rule
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    from vllm.third_party.flash_linear_attention.ops import (
        fused_post_conv_prep, fused_recurrent_gated_delta_rule_packed_decode,
        fused_sigmoid_gating_delta_rule_update)

    return ComposedOps(causal_conv1d_fn, causal_conv1d_update, fi_chunk_gated_delta_rule=chunk_gated_delta_rule,
                       post_conv_prep=fused_post_conv_prep,
                       packed_decode=fused_recurrent_gated_delta_rule_packed_decode,
                       sigmoid_gating_update=fused_sigmoid_gating_delta_rule_update)


def step_fields(step: ComposedStep, case, ids, up) -> None:
    """A step without spec decodes: the decodes' int32 slots and, with prefills, what
    :func:`prefill_step_fields` makes (only what vLLM's builder makes: its "plan host us" is that
    work)."""
    import torch

    D = case.row.decodes
    if D:
        step.decode_ids32 = up(ids[:D], torch.int32)
    if case.row.prefill_lens:
        prefill_step_fields(step, case, ids, up)


def spec_step_fields(step: ComposedStep, case, ids, up) -> None:
    """The fields of a spec step that vLLM's metadata builder makes (gdn_attn.py ~395-470): the
    spec rows' slots [N, 1 + drafts], their query_start_loc and num_accepted_tokens; beside
    prefills, the token indices of both kinds (a stable argsort of the spec-token mask: the spec
    tokens lead the row, so [0, Ts) and [Ts, T)) and the prefills' fields
    (:func:`prefill_step_fields`)."""
    import torch

    row = case.row
    step.spec_ids32 = up(ids[:row.spec_tokens], torch.int32).view(row.spec, row.spec_len)
    step.spec_qsl32 = up(list(range(0, row.spec_tokens + 1, row.spec_len)), torch.int32)
    step.num_accepted32 = up(case.num_accepted, torch.int32)
    if row.prefill_lens:
        step.spec_token_indx = up(list(range(row.spec_tokens)))
        step.non_spec_token_indx = up(list(range(row.spec_tokens, row.tokens)))
        prefill_step_fields(step, case, ids[row.spec_tokens:], up)


def prefill_step_fields(step: ComposedStep, case, ids, up) -> None:
    """The fields of a step with prefills that vLLM's metadata builder makes for its layer
    (gdn_attn.py ~515-575): every non-spec row's slot, has_initial_state (context > 0: every
    decode and the resumed prefills) and query_start_loc, the causal conv's metadata from the host
    copy of it, and the prefill-only cu_seqlens, rebased past the decodes."""
    import torch

    D, lens = case.row.decodes, case.row.prefill_lens
    qsl = [0]
    for n in [1] * D + list(lens):
        qsl.append(qsl[-1] + n)
    step.rows_ids32 = up(ids, torch.int32)
    step.rows_has_init = up([True] * D + list(case.has_initial_state), torch.bool)
    qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
    step.rows_qsl = qsl_cpu.to(case.device, non_blocking=True)
    step.conv_meta = vllm_conv_metadata(qsl_cpu, case.device)
    step.prefill_qsl32 = up([x - D for x in qsl[D:]], torch.int32)
    step.prefill_has_init = step.rows_has_init[D:]


PAD_SLOT_ID = -1              # vLLM 0.33.0's (v1/attention/backends/utils.py:54)



def vllm_conv_metadata(query_start_loc_cpu, device):
    """What vLLM 0.33.0's compute_causal_conv1d_metadata (v1/attention/backends/utils.py:1117-1163)
    builds once per step for its causal_conv1d_fn (BLOCK_M 8): per sequence its 8-token blocks,
    the sequence and block of each Triton program, padded with PAD_SLOT_ID. An object with its
    attributes nums_dict, batch_ptr, token_chunk_offset_ptr (those causal_conv1d_fn reads)."""
    import types

    import numpy as np
    import torch

    seqlens = query_start_loc_cpu.diff()
    nums = -(-seqlens // 8)
    mlist = torch.from_numpy(np.repeat(np.arange(len(nums)), nums.numpy()))
    offsets = torch.tensor([j for n in nums.tolist() for j in range(n)], dtype=torch.int32)
    programs = max(1024, len(mlist)) * 2
    batch_ptr = torch.full((programs,), PAD_SLOT_ID, dtype=torch.int32, device=device)
    chunk_ptr = torch.full((programs,), PAD_SLOT_ID, dtype=torch.int32, device=device)
    batch_ptr[:len(mlist)].copy_(mlist, non_blocking=True)
    chunk_ptr[:len(mlist)].copy_(offsets, non_blocking=True)
    block = {"nums": nums, "tot": int(nums.sum()), "mlist": mlist, "mlist_len": len(mlist),
             "offsetlist": offsets, "batch_ptr": batch_ptr, "token_chunk_offset_ptr": chunk_ptr}
    return types.SimpleNamespace(nums_dict={8: block}, batch_ptr=batch_ptr, token_chunk_offset_ptr=chunk_ptr)


def vllm_layer_forward(step: ComposedStep, mixed_qkv, a, b, *, ops: ComposedOps, conv_weight, conv_bias,
                       conv_state, ssm_state, A_log, dt_bias, num_k_heads, out, scale=None) -> None:
    """vLLM 0.33.0's stock GDN core on Hopper's Triton path, as its qwen_gdn_linear_attn.py runs
    it (line numbers of that file): a decode-only step in _forward_core_decode_non_spec
    (~1981-2031), any step with prefills or spec decodes in _forward_core (~1556-1914). Spec
    decodes take its Triton spec path, the one Qwen3-Next (interleaved projections) and any model
    without its CUDA MTP kernel run (``_C.fused_gdn_decode_post_conv_mtp``, bf16 Qwen3.5 with
    VLLM_GDN_DECODE_KERNEL=cuda, ~1150-1166: not loadable without vLLM's GPU build). ``scale``:
    None (vLLM's head_k_dim ** -0.5 where it passes one)."""
    Ts, D, Tp = step.num_spec_tokens, step.num_decodes, step.num_prefill_tokens
    T = Ts + D + Tp
    x, a, b = mixed_qkv[:T], a[:T], b[:T]                                                    # ~1614-1616
    layer = dict(conv_weight=conv_weight, conv_bias=conv_bias, conv_state=conv_state, ssm_state=ssm_state,
                 A_log=A_log, dt_bias=dt_bias, hk=num_k_heads)
    if Ts:
        _vllm_spec(ops, step, x, a, b, out, **layer)
    elif not Tp:
        packed_decode_step(ops, step, x, a, b, conv_state, conv_weight, conv_bias, ssm_state, A_log, dt_bias,
                           out[:T], scale)
    else:
        out[:T] = _vllm_non_spec(ops, step, x, a, b, **layer).squeeze(0)                     # ~1911-1912


def _vllm_non_spec(ops, step, x, a, b, *, conv_weight, conv_bias, conv_state, ssm_state, A_log, dt_bias, hk):
    """vLLM's non-spec rows of a step with prefills (decodes first): the varlen conv over every
    row, fused_post_conv_prep of the prefills, the decodes' recurrence, FlashInfer's prefill on
    gathered initial states; the output [1, rows, Hv, 128]."""
    import torch

    D = step.num_decodes
    y = ops.causal_conv1d(x.transpose(0, 1), conv_weight, conv_bias, activation="silu", conv_states=conv_state,
                          has_initial_state=step.rows_has_init, cache_indices=step.rows_ids32,
                          query_start_loc=step.rows_qsl, metadata=step.conv_meta).transpose(0, 1)  # ~1657-1670
    q, k, v, g, beta = ops.post_conv_prep(conv_output=y[D:], a=a[D:], b=b[D:], A_log=A_log, dt_bias=dt_bias,
                                          num_k_heads=hk, head_k_dim=HD, head_v_dim=HD, apply_l2norm=True,
                                          output_g_exp=False)                                   # ~1724-1745
    o_decode = None
    if D:                                                                                       # ~1777-1799
        qd, kd, vd = _vllm_rearrange(y[:D], hk)
        o_decode, _ = ops.sigmoid_gating_update(A_log=A_log, a=a[:D], b=b[:D], dt_bias=dt_bias, q=qd, k=kd,
                                                v=vd, initial_state=ssm_state, inplace_final_state=True,
                                                cu_seqlens=step.rows_qsl[:D + 1], ssm_state_indices=step.rows_ids32,
                                                use_qk_l2norm_in_kernel=True)
    ids = step.rows_ids32[D:]                                                                  # ~1811-1880
    initial_state = ssm_state[ids]
    initial_state[~step.prefill_has_init, ...] = 0
    o_prefill, final = _vllm_flashinfer_prefill(ops, q, k, v, g, beta, initial_state, step.prefill_qsl32)
    ssm_state[ids] = final.to(ssm_state.dtype)
    return o_prefill if o_decode is None else torch.cat([o_decode, o_prefill], dim=1)


def _vllm_spec(ops, step, x, a, b, out, *, conv_weight, conv_bias, conv_state, ssm_state, A_log, dt_bias, hk):
    """vLLM's step with spec decodes: beside prefills, every input gathered by the token indices
    (~1633-1637, a and b of the prefills at ~1692-1694) and both outputs scattered back
    (~1903-1908); the spec rows' sliding-window conv (causal_conv1d_update with
    num_accepted_tokens, ~1643-1660) and their recurrence from slot num_accepted - 1, each draft
    token's state into its own slot (fused_sigmoid_gating_delta_rule_update, ~1748-1768)."""
    prefills = step.num_prefill_tokens > 0
    if prefills:
        xs, as_, bs = (t.index_select(0, step.spec_token_indx) for t in (x, a, b))
        xn = x.index_select(0, step.non_spec_token_indx)
    else:
        xs, as_, bs = x, a, b
    ys = ops.causal_conv1d_update(xs, conv_state, conv_weight, conv_bias, "silu",
                                  conv_state_indices=step.spec_ids32[:, 0], num_accepted_tokens=step.num_accepted32,
                                  query_start_loc=step.spec_qsl32, max_query_len=step.spec_ids32.shape[1],
                                  validate_data=False)
    o_non = None
    if prefills:
        an, bn = (t.index_select(0, step.non_spec_token_indx) for t in (a, b))
        o_non = _vllm_non_spec(ops, step, xn, an, bn, conv_weight=conv_weight, conv_bias=conv_bias,
                               conv_state=conv_state, ssm_state=ssm_state, A_log=A_log, dt_bias=dt_bias, hk=hk)
    qs, ks, vs = _vllm_rearrange(ys, hk)
    o_spec, _ = ops.sigmoid_gating_update(A_log=A_log, a=as_, b=bs, dt_bias=dt_bias, q=qs, k=ks, v=vs,
                                          initial_state=ssm_state, inplace_final_state=True,
                                          cu_seqlens=step.spec_qsl32, ssm_state_indices=step.spec_ids32,
                                          num_accepted_tokens=step.num_accepted32, use_qk_l2norm_in_kernel=True)
    if o_non is None:
        out[:x.shape[0]] = o_spec.squeeze(0)                                                   # ~1909-1910
    else:
        out.index_copy_(0, step.spec_token_indx, o_spec.squeeze(0))
        out.index_copy_(0, step.non_spec_token_indx, o_non.squeeze(0))


def _vllm_rearrange(y, hk):
    """vLLM's rearrange_mixed_qkv (~1042-1076): q, k, v [1, L, H, 128] contiguous, through one cat."""
    import torch

    L, kd = y.shape[0], hk * HD
    q, k, v = torch.split(y, [kd, kd, y.shape[1] - 2 * kd], dim=-1)
    fused = torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)], dim=0)
    return (fused[:L * kd].view(1, L, -1, HD), fused[L * kd:2 * L * kd].view(1, L, -1, HD),
            fused[2 * L * kd:].view(1, L, -1, HD))


def _vllm_flashinfer_prefill(ops, q, k, v, g, beta, initial_state, cu_seqlens):
    """vLLM's FlashInfer prefill wrapper (~313-370), l2norm already applied (use_qk_l2norm_in_kernel
    False, ~1828): contiguous inputs, fp32 state / g / beta, int64 cu_seqlens, alpha = exp(g)."""
    import torch

    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    output, final_state = ops.fi_chunk_gated_delta_rule(
        q=q, k=k, v=v, g=torch.exp(g.to(torch.float32)), beta=beta.to(torch.float32),
        initial_state=initial_state.to(torch.float32), output_final_state=True,
        cu_seqlens=cu_seqlens.to(torch.int64), state_checkpoints=None, checkpoint_cu_starts=None,
        checkpoint_every_n_tokens=0, use_cp="auto", backend="flashinfer")
    return output.unsqueeze(0), final_state
