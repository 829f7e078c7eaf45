"""What the compositions of `qla-serve bench layer` share (bench/layer_composed.py lists them):
the ops a composition calls (:class:`ComposedOps`), the step metadata built once per step
(:class:`ComposedStep`), and the pieces more than one engine's composition runs (the q/k/v views
of a conv output, the packed decode step vLLM and SGLang both run)."""

from __future__ import annotations

import dataclasses
from typing import Callable

HD = 128
CHUNK = 64                      # FLA's chunk size (its conv and GDN chunk indices)


@dataclasses.dataclass(frozen=True)
class ComposedOps:
    """The library ops a composed layer calls (FLA's, FlashInfer's, or torch stand-ins on CPU).

    causal_conv1d, causal_conv1d_update: FLA's conv (conv state [N, dim, W], column c the input at
    relative time c - W). chunk_gated_delta_rule, fused_recurrent_gated_delta_rule: FLA's GDN.
    fi_chunk_gated_delta_rule, fi_decode: FlashInfer's gdn_prefill.chunk_gated_delta_rule and
    gdn_decode.gated_delta_rule_decode_pretranspose (None for the fla composition).
    For the vllm composition: causal_conv1d, causal_conv1d_update are vLLM's (conv state [S, dim,
    W-1]); post_conv_prep, packed_decode, sigmoid_gating_update its fused_post_conv_prep,
    fused_recurrent_gated_delta_rule_packed_decode and fused_sigmoid_gating_delta_rule_update.
    For the sglang compositions: causal_conv1d_update and packed_decode are SGLang's (the same
    contracts), proj_conv / proj_split its Qwen3.5 projection kernels.
    """

    causal_conv1d: Callable
    causal_conv1d_update: Callable
    chunk_gated_delta_rule: Callable | None = None
    fused_recurrent_gated_delta_rule: Callable | None = None
    fi_chunk_gated_delta_rule: Callable | None = None
    fi_decode: Callable | None = None
    post_conv_prep: Callable | None = None
    packed_decode: Callable | None = None
    sigmoid_gating_update: Callable | None = None
    proj_conv: Callable | None = None       # SGLang: fused_qkvzba_causal_conv1d_update_contiguous
    proj_split: Callable | None = None      # SGLang: fused_qkvzba_split_reshape_cat_contiguous
    qkv_split: Callable | None = None       # SGLang: fused_qkv_split_gdn_prefill
    gating: Callable | None = None          # SGLang: fused_gdn_gating
    qk_prepare: Callable | None = None      # SGLang: gdn_prefill_qkv_prepare_fwd (FlashInfer extend's l2norm)


@dataclasses.dataclass(eq=False)
class ComposedStep:
    """What the composed layers share per step, built on the host from CPU lengths as an engine's
    metadata builder would. Device tensors: decode_ids [D] / prefill_ids [Np] (long; ``*_ids32``
    int32), has_init [Np, 1, 1] bool, cu_seqlens [Np+1] long (``cu_seqlens_cpu`` beside it),
    chunk_indices [chunks, 2] long ((sequence, chunk) per 64-token chunk: FLA's layout), fresh_ids
    (slots of prefills without an initial state, for FlashInfer to zero; None if none).
    vllm only (what vLLM's GDN metadata builder hands its layer, v1/attention/backends/gdn_attn.py):
    rows_ids32 [D+Np] int32 slots, rows_has_init [D+Np] bool, rows_qsl [D+Np+1] int32 (decodes
    1 token each), conv_meta (its causal-conv metadata, composed_vllm.vllm_conv_metadata),
    prefill_qsl32 [Np+1] int32, prefill_has_init [Np] bool."""

    num_decodes: int
    num_prefill_tokens: int
    decode_ids: object = None
    decode_ids32: object = None
    prefill_ids: object = None
    prefill_ids32: object = None
    has_init: object = None
    cu_seqlens: object = None
    cu_seqlens_cpu: object = None
    chunk_indices: object = None
    fresh_ids: object = None
    rows_ids32: object = None
    rows_has_init: object = None
    rows_qsl: object = None
    conv_meta: object = None
    prefill_qsl32: object = None
    prefill_has_init: object = None
    num_spec_tokens: int = 0    # vllm's spec rows (vLLM's metadata for them):
    spec_ids32: object = None   # [N, 1 + drafts] int32 slots, one per draft position
    spec_qsl32: object = None   # [N + 1] int32 spec query_start_loc
    num_accepted32: object = None   # [N] int32
    spec_token_indx: object = None      # [Ts] / [T - Ts] long token indices (steps with prefills)
    non_spec_token_indx: object = None
    qla: object = None          # qla_split: the gdn_layer StepPlan of the decodes (ids derived)
    kernel: object = None       # sglang_qla, sglang_fused_qla: flashqla's SGLang kernel, its ids bound
    seq_lens_cpu: object = None  # sglang_qla extend: the host lengths SGLang's conv takes


def split_qkv(y, hk, hv, lead=()):
    """q, k [*, Hk, 128], v [*, Hv, 128] views of the conv output y [*, dim] (``lead``: extra dims)."""
    kd = hk * HD
    shape = tuple(y.shape[:-1]) + tuple(lead)
    return (y[..., :kd].reshape(*shape, hk, HD), y[..., kd:2 * kd].reshape(*shape, hk, HD),
            y[..., 2 * kd:].reshape(*shape, hv, HD))


def packed_decode_step(ops, step, x, a, b, conv_state, conv_weight, conv_bias, ssm_state, A_log, dt_bias, out,
                       scale) -> None:
    """A decode-only step as vLLM 0.33 (qwen_gdn_linear_attn.py ~1981-2031) and SGLang 0.5.23
    (gdn_backend.py forward_decode, :854-862 and :866-887) both run it: the Triton
    ``causal_conv1d_update`` on the conv state, then ``fused_recurrent_gated_delta_rule_packed_decode``
    from the conv output (split, l2norm and gating in the kernel)."""
    y = ops.causal_conv1d_update(x, conv_state, conv_weight, conv_bias, "silu",
                                 conv_state_indices=step.decode_ids32, validate_data=False)
    ops.packed_decode(mixed_qkv=y, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                      scale=HD ** -0.5 if scale is None else scale, initial_state=ssm_state,
                      out=out.unsqueeze(1), ssm_state_indices=step.decode_ids32, use_qk_l2norm_in_kernel=True)
