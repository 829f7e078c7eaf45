"""SGLang's GDN decode step, conv included, on qla_serve's layer (backends/gdn_layer.py).

SGLang 0.5.23's ``GDNAttnBackend.forward_decode`` (srt/layers/attention/linear/gdn_backend.py:
678-917) runs its own Triton ``causal_conv1d_update`` over the conv state (:854-862), then the
kernel backend's ``decode`` on the conv output's q | k | v views (:889-911). When flashqla runs the
decode, the plugin's hook (plugin.py, AROUND ``forward_decode``) hands a step whose ``mixed_qkv``
is one tensor to :func:`forward_decode` here instead: qla_serve's conv kernel with the window
shift in place, then gdn_decode launched as its programmatic dependent (the vLLM adapter's
decode), with the step's slot ids derived once per forward batch instead of once per layer.

Why (H200, GPU us per layer call in a CUDA graph, SGLang's cache layout, one process;
benchmarks/layer.md "SGLang's decode step" (full write-up: ``git show af9803e:benchmarks/layer.md``)):
SGLang's conv + qla_serve's decode kernel, the route
before this hook, took 8.9-10.1 us at one request where qla_serve's conv + decode take 3.4-4.2,
14.8-18.6 at 32 requests against 9.5-13.2, and 1-6% more at 64-256 requests.

Qwen3.5's decode hands ``mixed_qkv`` as the projections' ``(qkvz, ba)`` tuple (SGLang's default
there, ``SGLANG_ENABLE_GDN_DECODE_FUSED_PROJ_CONV``): SGLang splits and convolves them in one
Triton kernel (``fused_qkvzba_causal_conv1d_update_contiguous``). Those steps stay on SGLang's
forward_decode (its fused conv, then flashqla's ``decode`` with the slot ids of :func:`step_ids`):
SGLang's split alone, then qla_serve's conv and decode, measured faster only at one request (2/8
fp32 5.8 against 6.6 us) and 1-2% slower from 32 requests on (benchmarks/layer.md).
"""

from __future__ import annotations

import torch

from qla_serve.backends import gdn_layer


def forward_decode(backend, layer, forward_batch, mixed_qkv: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor) -> torch.Tensor:
    """One decode step of one GDN layer, as SGLang's ``forward_decode`` returns it.

    Args:
        backend: SGLang's ``GDNAttnBackend`` (its pool, per-batch metadata and track-save).
        layer: the ``RadixLinearAttention`` (conv_weights [dim, W], bias, activation, A_log,
            dt_bias, head counts and dims).
        mixed_qkv: [B, dim] projected q | k | v before the conv; a, b: [B, Hv] raw gate logits.
    Returns:
        [1, B, Hv, 128] in mixed_qkv's dtype (rows of padding slots zero).
    """
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    conv_states, ssm_states = cache.conv[0], cache.temporal
    step = _decode_step(backend, layer, mixed_qkv.shape[0])
    Hv = ssm_states.shape[1]
    out = torch.empty(1, step.num_actual_tokens, Hv, gdn_layer.HEAD_DIM, dtype=mixed_qkv.dtype,
                      device=mixed_qkv.device)
    gdn_layer.gdn_layer_forward(step, mixed_qkv, a, b, conv_weight=layer.conv_weights, conv_bias=layer.bias,
                                activation=layer.activation, conv_state=conv_states, ssm_state=ssm_states,
                                A_log=layer.A_log, dt_bias=layer.dt_bias, num_k_heads=layer.num_k_heads,
                                out=out[0], scale=layer.head_k_dim ** -0.5)
    backend._track_mamba_state_decode(forward_batch, conv_states, ssm_states, step.decode_slots, layer.layer_id)
    return out


def step_ids(backend, layer) -> tuple:
    """(SGLang's cache_indices of this forward batch, qla_serve's int32 ids of them: 0 and -1 ->
    -1), from the batch's decode StepPlan (derived once per batch, as in :func:`forward_decode`)."""
    step = _decode_step(backend, layer, backend.forward_metadata.mamba_cache_indices.shape[0])
    return step.decode_slots, step.ids("decode")


def _decode_step(backend, layer, B: int) -> gdn_layer.StepPlan:
    """The forward pass's decode StepPlan for ``B`` rows over SGLang's ``mamba_cache_indices``
    (``decode_slots``): made by its first GDN layer, kept on SGLang's per-batch metadata, so every
    later layer reuses its slot ids. SGLang's slot 0 (a reserved dummy) and -1 (graph padding) are
    both padding: never read or written.

    One metadata object can serve several forward passes: SGLang 0.5.23 captures a decode (or
    target-verify) graph by setting the metadata once (runner/decode_cuda_graph_runner.py:1400,
    ``init_forward_metadata_out_graph(in_capture=True)``), then running two warmup passes and the
    captured one over it (runner_backend/full_cuda_graph_backend.py:162-182). So a call from the
    layer that made the step starts a new pass and makes a new one: the captured pass derives its
    slot ids inside the graph, which then re-reads SGLang's persistent index buffer at every
    replay (a step kept from a warmup would replay the capture-time slots)."""
    meta = backend.forward_metadata
    cache_indices = meta.mamba_cache_indices
    step = getattr(meta, "qla_decode", None)
    if step is None or step.decode_slots is not cache_indices or step.num_actual_tokens != B \
            or step.info.get("first_layer") == layer.layer_id:
        Hv = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id).temporal.shape[1]
        step = gdn_layer.make_step_plan(num_actual_tokens=B, num_v_heads=Hv, num_k_heads=layer.num_k_heads,
                                        conv_width=layer.conv_weights.shape[1], device=cache_indices.device,
                                        decode_slots=cache_indices, null_slot=0)
        step.info["first_layer"] = layer.layer_id
        meta.qla_decode = step
    return step
