"""The SGLang compositions of `qla-serve bench layer` (bench/layer_composed.py lists the others):

* ``sglang`` and ``sglang_qla`` (on SGLang's cache layout ``--pool sglang``; only where SGLang
  0.5.23's Triton ops import: on the lent H200 from benchmarks/make_sglang_ops_bundle.sh).
  Decode-only rows: SGLang's GDN decode step on CUDA from the split's ``mixed_qkv`` (Qwen3-Next's
  route; its srt/layers/attention/linear/gdn_backend.py, cited per line below): its Triton
  ``causal_conv1d_update`` over the conv state, then ``sglang``: its default backend's
  ``fused_recurrent_gated_delta_rule_packed_decode`` (what SGLang runs without qla_serve);
  ``sglang_qla``: qla_serve's SGLang kernel (backends/sglang/kernel.py, its ``decode``) on the conv
  output's q | k | v views (what SGLang ran with ``--linear-attn-backend flashqla`` before the
  plugin took this conv over; ``QLA_SERVE_SGLANG_DECODE_CONV=0``).
  Prefill-only rows: SGLang's extend (forward_extend, gdn_backend.py:948-1228): its Triton
  ``causal_conv1d_fn`` over the transposed rows (:919-941, has_initial_state = prefix > 0),
  ``fused_qkv_split_gdn_prefill`` (q, k, v [1, T, H, 128] copies; torch views where the qkv width
  exceeds 8192, :1078-1102), ``fused_gdn_gating`` (fp32 g, beta), new requests' SSM slots zeroed
  (SGLang zeroes them when it allocates them: the same bytes per layer), then ``sglang``: its
  SM90 default, FlashInfer's prefill through its wrapper (kernels/gdn_flashinfer.py:481-596: q/k
  L2 norm by its Triton prepare, alpha = exp(g), the slots' states gathered as fp32, final states
  copied back; only where FlashInfer 0.7.2 imports), or ``sglang_qla``: qla_serve's SGLang kernel
  ``extend`` (L2 norm, then gdn_prefill) on its batch plan (what flashqla ran before the plugin
  took the extend conv over; ``QLA_SERVE_SGLANG_EXTEND_CONV=0``). Mixed rows: SGLang runs decodes
  and extends as separate batches, so they are refused.
  Beside ``qla`` on the same layout (qla_serve's layer: what the plugin runs for flashqla's plain
  decode and extend steps now).
* ``sglang_fused``, ``sglang_fused_qla``, ``qla_split`` (the same, for Qwen3.5's decode route: the
  layer gets the projections, ``qkvz`` [T, dim + Hv 128] = [q | k | v | z] and ``ba`` [T, 2 Hv] =
  [b | a], as SGLang's Qwen3.5 model hands them to forward_decode, qwen3_5.py:1012-1027):
  ``sglang_fused``: SGLang's own, ``fused_qkvzba_causal_conv1d_update_contiguous`` (split and conv
  in one Triton kernel, gdn_backend.py:788-799), then its packed decode; ``sglang_fused_qla``: that
  kernel, then qla_serve's SGLang kernel ``decode`` (what flashqla runs for Qwen3.5); ``qla_split``:
  SGLang's split alone (``fused_qkvzba_split_reshape_cat_contiguous``, its fallback at :842), then
  qla_serve's layer (conv + decode): what taking this route's conv over would run.

"""

from __future__ import annotations

from .composed_common import HD, ComposedOps, ComposedStep, packed_decode_step, split_qkv


def sglang_ops() -> ComposedOps:
    """SGLang 0.5.23's own ops (benchmarks/make_sglang_ops_bundle.sh puts them on the path where
    SGLang is not installed): for decode its Triton conv update and its default backend's packed
    decode; for extend its Triton conv, split, gating and q/k norm, and FlashInfer's prefill (its
    default on SM90, gdn_backend.py:191-236) where FlashInfer imports (else None: the extend rows
    are refused by name)."""
    from sglang.kernels.ops.attention.fla.fused_recurrent import fused_recurrent_gated_delta_rule_packed_decode
    from sglang.kernels.ops.attention.fla.l2norm import gdn_prefill_qkv_prepare_fwd
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

    try:
        from flashinfer.gdn_prefill import chunk_gated_delta_rule
    except ImportError:
        chunk_gated_delta_rule = None
    extend = sglang_qla_ops()
    return ComposedOps(extend.causal_conv1d, causal_conv1d_update, fi_chunk_gated_delta_rule=chunk_gated_delta_rule,
                       packed_decode=fused_recurrent_gated_delta_rule_packed_decode, qkv_split=extend.qkv_split,
                       gating=extend.gating, qk_prepare=gdn_prefill_qkv_prepare_fwd)


def sglang_qla_ops() -> ComposedOps:
    """SGLang 0.5.23's Triton decode and extend convs, its prefill split and gating; the core is
    qla_serve's SGLang kernel."""
    from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating
    from sglang.kernels.ops.attention.triton_gdn_fused_proj import fused_qkv_split_gdn_prefill
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_fn, causal_conv1d_update

    return ComposedOps(causal_conv1d_fn, causal_conv1d_update, qkv_split=fused_qkv_split_gdn_prefill,
                       gating=fused_gdn_gating)


def sglang_fused_ops() -> ComposedOps:
    """SGLang 0.5.23's Qwen3.5 decode kernels: the fused split + conv, the split alone, its packed
    decode."""
    from sglang.kernels.ops.attention.fla.fused_recurrent import fused_recurrent_gated_delta_rule_packed_decode
    from sglang.kernels.ops.attention.triton_gdn_fused_proj import (
        fused_qkvzba_causal_conv1d_update_contiguous, fused_qkvzba_split_reshape_cat_contiguous)

    return ComposedOps(None, None, packed_decode=fused_recurrent_gated_delta_rule_packed_decode,
                       proj_conv=fused_qkvzba_causal_conv1d_update_contiguous,
                       proj_split=fused_qkvzba_split_reshape_cat_contiguous)


def qla_split_step_fields(step: ComposedStep, case, ids, up) -> None:
    """``qla_split``'s step: the decodes' int32 slots and qla_serve's step plan of them, its ids
    derived once per step, outside the layer call (as the qla rows' step)."""
    import torch

    from qla_serve.backends import gdn_layer

    D = case.row.decodes
    step.decode_ids32 = up(ids[:D], torch.int32)
    step.qla = gdn_layer.make_step_plan(num_actual_tokens=D, num_v_heads=case.hv, num_k_heads=case.hk,
                                        conv_width=case.conv_weight.shape[1], device=case.device,
                                        decode_slots=step.decode_ids32)
    step.qla.ids("decode")


def kernel_step_fields(step: ComposedStep, case, ids, up) -> None:
    """``sglang_qla`` / ``sglang_fused_qla``'s step: flashqla's SGLang kernel, with the decodes'
    ids bound as the plugin's forward_decode hook binds them (derived once per step) and the
    extend's batch as SGLang's metadata and the plugin's plan hook hand it over."""
    import torch

    from qla_serve import layer_ops
    from qla_serve.backends.sglang.kernel import ExtendBatch, FlashQLAGDNKernel

    D, lens = case.row.decodes, case.row.prefill_lens
    step.kernel = FlashQLAGDNKernel(("decode", "prefill"))
    if D:
        step.decode_ids32 = up(ids[:D], torch.int32)
        step.kernel.bind_decode_ids(step.decode_ids32, layer_ops.slot_ids(step.decode_ids32, 0))
    if lens:
        extend_step_fields(step, ids[D:], lens, case.has_initial_state, up)
        step.kernel.bind_batch(ExtendBatch(query_start_loc=step.prefill_qsl32, seq_lens=tuple(lens),
                                           num_tokens=sum(lens)))


def extend_step_fields(step: ComposedStep, ids, lens, has, up) -> None:
    """What SGLang's metadata hands an extend (slot ids, query_start_loc int32, extend_prefix_lens
    > 0, the host lengths its conv takes) and the slots of new requests, which SGLang zeroes when
    it allocates them (every layer's slot: the same bytes per layer as zeroing them here)."""
    import torch

    step.prefill_ids32 = up(ids, torch.int32)
    step.prefill_qsl32 = up([sum(lens[:i]) for i in range(len(lens) + 1)], torch.int32)
    step.prefill_has_init = up(has, torch.bool)
    step.seq_lens_cpu = list(lens)
    fresh = [s for s, h in zip(ids, has) if not h]
    step.fresh_ids = up(fresh) if fresh else None


def sglang_layer_forward(step: ComposedStep, mixed_qkv, a, b, *, ops: ComposedOps, conv_weight, conv_bias,
                         conv_state, ssm_state, A_log, dt_bias, num_k_heads, out, scale=None) -> None:
    """SGLang 0.5.23's own step (its default ``--linear-attn-backend triton``, Qwen3-Next's route):
    a decode step causal_conv1d_update, then its packed decode (supports_packed_decode,
    gdn_triton.py:43); an extend its conv, split and gating (forward_extend), then FlashInfer's
    prefill as its SM90 default runs it (kernels/gdn_flashinfer.py:481-596)."""
    if step.num_prefill_tokens:
        if step.num_decodes:
            raise NotImplementedError("sglang: decode-only or prefill-only rows (SGLang runs decodes and "
                                      "extends as separate batches)")
        q, k, v, g, beta = _sglang_extend_inputs(step, mixed_qkv, a, b, ops=ops, conv_weight=conv_weight,
                                                 conv_bias=conv_bias, conv_state=conv_state, ssm_state=ssm_state,
                                                 A_log=A_log, dt_bias=dt_bias, num_k_heads=num_k_heads)
        _sglang_flashinfer_extend(step, ops, q, k, v, g, beta, ssm_state, out)
        return
    D = step.num_decodes
    packed_decode_step(ops, step, mixed_qkv[:D], a[:D], b[:D], conv_state, conv_weight, conv_bias, ssm_state,
                       A_log, dt_bias, out[:D], scale)


def _sglang_flashinfer_extend(step: ComposedStep, ops: ComposedOps, q, k, v, g, beta, ssm_state, out) -> None:
    """SGLang's FlashInfer extend on SM90 (use_state_pool False there, gdn_flashinfer.py:207): q/k
    L2-normalised by its Triton prepare, alpha = exp(g), the slots' states gathered as fp32 (padding
    ids to the last slot), FlashInfer's chunk_gated_delta_rule into ``out``, the final states copied
    back with index_copy_."""
    import torch

    if ops.fi_chunk_gated_delta_rule is None:
        raise NotImplementedError("sglang on prefill rows: needs FlashInfer 0.7.2's gdn_prefill (SGLang's "
                                  "SM90 default; on the lent H200: source .fibundle/activate.sh)")
    T = step.num_prefill_tokens
    q_fi, k_fi, v_fi = ops.qk_prepare(q[0], k[0], v[0])
    ids = torch.where(step.prefill_ids32 >= 0, step.prefill_ids32, ssm_state.shape[0] - 1).to(torch.int64)
    initial = ssm_state[ids].to(torch.float32)
    final = torch.empty_like(initial)
    ops.fi_chunk_gated_delta_rule(q=q_fi, k=k_fi, v=v_fi, g=torch.exp(g[0].to(torch.float32)),
                                  beta=beta[0].to(torch.float32), scale=None, initial_state=initial,
                                  output_final_state=True, cu_seqlens=step.prefill_qsl32.to(torch.int64),
                                  use_qk_l2norm_in_kernel=False, output=out[:T], output_state=final,
                                  state_checkpoints=None, checkpoint_cu_starts=None, checkpoint_every_n_tokens=0)
    ssm_state.index_copy_(0, ids, final.to(ssm_state.dtype))


def sglang_qla_layer_forward(step: ComposedStep, mixed_qkv, a, b, *, ops: ComposedOps, conv_weight, conv_bias,
                             conv_state, ssm_state, A_log, dt_bias, num_k_heads, out, scale=None) -> None:
    """SGLang 0.5.23's decode step with ``--linear-attn-backend flashqla``: its Triton
    causal_conv1d_update (gdn_backend.py:854-862), the conv output split into [1, B, H, 128] q | k | v
    views (:889-911, the backend's supports_packed_decode False), then qla_serve's SGLang kernel's
    ``decode`` (raw a, b; l2norm and gating in gdn_decode) with the step's slot ids bound once, as
    the plugin's hook binds them (``QLA_SERVE_SGLANG_DECODE_CONV=0``)."""
    if step.num_prefill_tokens:
        _sglang_qla_extend(step, mixed_qkv, a, b, ops=ops, conv_weight=conv_weight, conv_bias=conv_bias,
                           conv_state=conv_state, ssm_state=ssm_state, A_log=A_log, dt_bias=dt_bias,
                           num_k_heads=num_k_heads, out=out)
        return
    D = step.num_decodes
    y = ops.causal_conv1d_update(mixed_qkv[:D], conv_state, conv_weight, conv_bias, "silu",
                                 conv_state_indices=step.decode_ids32, validate_data=False)
    q, k, v = split_qkv(y, num_k_heads, ssm_state.shape[1])
    o = step.kernel.decode(q[None], k[None], v[None], a[:D], b[:D], A_log=A_log, dt_bias=dt_bias,
                           ssm_states=ssm_state, cache_indices=step.decode_ids32, query_start_loc=None)
    out[:D] = o[0]


def _sglang_extend_inputs(step: ComposedStep, mixed_qkv, a, b, *, ops: ComposedOps, conv_weight, conv_bias,
                          conv_state, ssm_state, A_log, dt_bias, num_k_heads):
    """SGLang's forward_extend up to its kernel backend's ``extend`` (the line numbers of
    gdn_backend.py): its Triton conv over the transposed rows in place on the conv state, the fused
    q/k/v split, its gating kernel; new requests' SSM slots zeroed (SGLang: at allocation).
    Returns q, k [1, T, Hk, 128], v [1, T, Hv, 128], g, beta [1, T, Hv]."""
    import torch

    T, hk, hv = step.num_prefill_tokens, num_k_heads, ssm_state.shape[1]
    x = mixed_qkv[:T]
    y = ops.causal_conv1d(x.transpose(0, 1), conv_weight, conv_bias, conv_state, step.prefill_qsl32,
                          step.seq_lens_cpu, cache_indices=step.prefill_ids32,
                          has_initial_state=step.prefill_has_init, activation="silu").transpose(0, 1)[:T]  # :919-941
    if y.shape[1] <= 8192:                                                                          # :1078-1102
        q, k, v = ops.qkv_split(y, hk, hk, hv, HD, HD, HD)
    else:
        q, k, v = (t.view(1, T, -1, HD) for t in torch.split(y, [hk * HD, hk * HD, hv * HD], dim=-1))
    g, beta = ops.gating(A_log, a[:T], b[:T], dt_bias)                                              # :943-946
    if step.fresh_ids is not None:
        ssm_state.index_fill_(0, step.fresh_ids, 0)
    return q, k, v, g, beta


def _sglang_qla_extend(step: ComposedStep, mixed_qkv, a, b, *, ops: ComposedOps, conv_weight, conv_bias, conv_state,
                       ssm_state, A_log, dt_bias, num_k_heads, out) -> None:
    """SGLang's extend with flashqla (before the plugin's forward_extend hook, or with
    QLA_SERVE_SGLANG_EXTEND_CONV=0): SGLang's conv, split and gating, then qla_serve's SGLang
    kernel ``extend``."""
    if step.num_decodes:
        raise NotImplementedError("sglang_qla: decode-only or prefill-only rows (SGLang runs decodes and "
                                  "extends as separate batches)")
    T = step.num_prefill_tokens
    q, k, v, g, beta = _sglang_extend_inputs(step, mixed_qkv, a, b, ops=ops, conv_weight=conv_weight,
                                             conv_bias=conv_bias, conv_state=conv_state, ssm_state=ssm_state,
                                             A_log=A_log, dt_bias=dt_bias, num_k_heads=num_k_heads)
    o, _, _ = step.kernel.extend(q, k, v, g, beta, ssm_states=ssm_state, cache_indices=step.prefill_ids32,
                                 query_start_loc=step.prefill_qsl32, output=out[:T].unsqueeze(0))
    if o.data_ptr() != out.data_ptr():          # (the kernel writes into ``output`` where it can)
        out[:T] = o[0]


def _proj_conv(ops, step, proj, conv_state, conv_weight, conv_bias, hv):
    """SGLang's fused Qwen3.5 split + conv over the decode rows: (mixed_qkv, z, b, a)."""
    qkvz, ba = proj
    D = step.num_decodes
    return ops.proj_conv(qkvz[:D], ba[:D], conv_state, conv_weight, conv_bias, step.decode_ids32,
                         qkv_dim=conv_weight.shape[0], v_dim=hv * HD, num_v_heads=hv, head_v_dim=HD,
                         activation="silu")


def _decode_only(step: ComposedStep, impl: str) -> int:
    """The step's decode count; a step with prefills is refused (``impl`` composes decodes only)."""
    if step.num_prefill_tokens:
        raise NotImplementedError(f"{impl}: decode-only rows (SGLang's prefill is not composed here)")
    return step.num_decodes


def sglang_fused_layer_forward(step: ComposedStep, proj, _a, _b, *, ops: ComposedOps, conv_weight, conv_bias,
                               conv_state, ssm_state, A_log, dt_bias, num_k_heads, out, scale=None) -> None:
    """SGLang 0.5.23's own Qwen3.5 decode step: the fused split + conv, then its packed decode.
    ``proj``: (qkvz, ba) (a and b come out of the split)."""
    D = _decode_only(step, "sglang_fused")
    y, _z, b, a = _proj_conv(ops, step, proj, conv_state, conv_weight, conv_bias, ssm_state.shape[1])
    ops.packed_decode(mixed_qkv=y, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=HD ** -0.5 if scale is None else scale,
                      initial_state=ssm_state, out=out[:D].unsqueeze(1), ssm_state_indices=step.decode_ids32,
                      use_qk_l2norm_in_kernel=True)


def sglang_fused_qla_layer_forward(step: ComposedStep, proj, _a, _b, *, ops: ComposedOps, conv_weight, conv_bias,
                                   conv_state, ssm_state, A_log, dt_bias, num_k_heads, out, scale=None) -> None:
    """SGLang's Qwen3.5 decode step with flashqla: the fused split + conv, then qla_serve's SGLang
    kernel ``decode`` on the conv output's views, the step's slot ids bound once (the route
    backends/sglang/decode_layer.py leaves to SGLang)."""
    D = _decode_only(step, "sglang_fused_qla")
    y, _z, b, a = _proj_conv(ops, step, proj, conv_state, conv_weight, conv_bias, ssm_state.shape[1])
    q, k, v = split_qkv(y, num_k_heads, ssm_state.shape[1])
    o = step.kernel.decode(q[None], k[None], v[None], a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_state,
                           cache_indices=step.decode_ids32, query_start_loc=None)
    out[:D] = o[0]


def qla_split_layer_forward(step: ComposedStep, proj, _a, _b, *, ops: ComposedOps, conv_weight, conv_bias,
                            conv_state, ssm_state, A_log, dt_bias, num_k_heads, out, scale=None) -> None:
    """Qwen3.5's decode step with the conv taken over: SGLang's split alone, then qla_serve's layer
    (gdn_layer_forward: conv, then the dependent decode) on the step's plan."""
    from qla_serve.backends import gdn_layer

    D = _decode_only(step, "qla_split")
    qkvz, ba = proj
    hv = ssm_state.shape[1]
    y, _z, b, a = ops.proj_split(qkvz[:D], ba[:D], num_k_heads, hv, HD, HD)
    gdn_layer.gdn_layer_forward(step.qla, y, a, b, conv_weight=conv_weight, conv_bias=conv_bias, activation="silu",
                                conv_state=conv_state, ssm_state=ssm_state, A_log=A_log, dt_bias=dt_bias,
                                num_k_heads=num_k_heads, out=out[:D], scale=scale)


def qwen35_projections(case):
    """Qwen3.5's decode inputs as SGLang's model hands them over: qkvz = [q | k | v | z] (the case's
    mixed_qkv and a random z of Hv * 128 channels) and ba = [b | a], each one contiguous tensor."""
    import torch

    gen = torch.Generator(device=case.device).manual_seed(7)
    T = case.mixed_qkv.shape[0]
    z = torch.randn(T, case.hv * HD, generator=gen, device=case.device).to(case.mixed_qkv.dtype)
    return torch.cat([case.mixed_qkv, z], 1), torch.cat([case.b, case.a], 1)
