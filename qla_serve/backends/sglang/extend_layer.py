"""SGLang's GDN extend (prefill) step, conv included, on qla_serve's layer (backends/gdn_layer.py).

SGLang 0.5.23's ``GDNAttnBackend.forward_extend`` (srt/layers/attention/linear/gdn_backend.py:
948-1228) runs its own Triton ``causal_conv1d_fn`` over the batch with each request's history
from the conv state (:1086-1092, ``_convolve_prefill`` :919-941), splits q | k | v
(``fused_qkv_split_gdn_prefill``, :1098-1107), computes g and beta (``fused_gdn_gating``,
:1178), and only then calls the kernel backend's ``extend`` (:1190-1211), where flashqla
L2-normalises q and k in one more launch before ``gdn_prefill``. When flashqla runs the extend,
the plugin's hook (plugin.py, AROUND ``forward_extend``) hands a plain extend step to
:func:`forward_extend` here instead: the vLLM adapter's prefill layer, i.e. qla_serve's conv
prefill kernel with the conv-state write-back, split, L2 norm and gates in one launch, then
``gdn_prefill`` on the batch's plan.

Why (H200, GPU us per layer call, SGLang's cache layout, fp32 states, one process;
benchmarks/layer.md "SGLang's extend step" (full write-up: ``git show af9803e:benchmarks/layer.md``)):
SGLang's conv, split and gating before flashqla's
kernel took 132 us at 2/8 heads 1 x 8192 tokens where this takes 99, 105 against 67 at 16 x 512,
403 against 286 at 1 x 32768, and 1995 against 1478 at 16/64 heads 4 x 8192 (0.64-0.78x), with
3-5x less host time per call (166-242 us against 506-795).

Steps the hook leaves to SGLang's forward_extend (its conv and gating, then flashqla's kernel
class): target verify, multi-item scoring, a batch the metadata hook could not plan from host
lengths, the extra_buffer radix cache's tracked batches (SGLang copies conv windows before its
conv and reads a state snapshot from the kernel), and page-major (non-contiguous) state pools.
"""

from __future__ import annotations

import torch

from qla_serve.backends import gdn_layer

from .kernel import ExtendBatch


def forward_extend(backend, layer, forward_batch, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   batch: ExtendBatch, cache, output: torch.Tensor | None = None) -> torch.Tensor:
    """One extend step of one GDN layer, as SGLang's ``forward_extend`` returns it.

    Args:
        backend: SGLang's ``GDNAttnBackend`` (its pool and per-batch metadata).
        layer: the ``RadixLinearAttention`` (conv_weights [dim, W], bias, activation, A_log,
            dt_bias, head counts and dims).
        forward_batch: SGLang's ``ForwardBatch`` (``extend_prefix_lens`` [N] device: a request
            with a prefix continues from its conv and SSM slots, a new one starts from zeros).
        mixed_qkv: [T, dim] projected q | k | v before the conv; a, b: [T, Hv] raw gate logits.
            Rows past the batch's ``num_tokens`` are SGLang's physical padding.
        batch: the forward batch's :class:`~.kernel.ExtendBatch` (plugin.plan_extend_batch).
        cache: this layer's slice of SGLang's mamba pool (``mamba2_layer_cache(layer_id)``, which
            builds a new object per call: the hook fetches it once and hands it over).
        output: SGLang's ``linear_attn_output`` [1, T, Hv, 128] to write into, when it is one.
    Returns:
        [1, T, Hv, 128] in mixed_qkv's dtype (padding rows zero).
    """
    conv_states, ssm_states = cache.conv[0], cache.temporal
    T, Hv = mixed_qkv.shape[0], ssm_states.shape[1]
    step = _extend_step(backend, forward_batch, layer, batch, Hv)
    shape = (1, T, Hv, gdn_layer.HEAD_DIM)
    if output is not None and tuple(output.shape) == shape and output.dtype == mixed_qkv.dtype \
            and output.is_contiguous():
        out = output
    else:
        out = torch.empty(shape, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if step.num_actual_tokens < T:   # physical padding: finite and defined, as SGLang's kernels leave it
        out[0, step.num_actual_tokens:].zero_()
    gdn_layer.gdn_layer_forward(step, mixed_qkv, a, b, conv_weight=layer.conv_weights, conv_bias=layer.bias,
                                activation=layer.activation, conv_state=conv_states, ssm_state=ssm_states,
                                A_log=layer.A_log, dt_bias=layer.dt_bias, num_k_heads=layer.num_k_heads,
                                out=out[0], scale=layer.head_k_dim ** -0.5)
    return out


def _extend_step(backend, forward_batch, layer, batch: ExtendBatch, Hv: int) -> gdn_layer.StepPlan:
    """The forward batch's prefill StepPlan: made by its first GDN layer on the batch's
    PrefillPlan (one per batch, shared with the kernel class), kept on the ExtendBatch (which
    lives on SGLang's per-batch metadata), so every later layer reuses it and its slot ids.
    SGLang's slot 0 (a reserved dummy) and -1 are padding: never read or written."""
    step = batch.step
    Hk = layer.num_k_heads
    if step is None or (step.prefill_plan.num_v_heads, step.prefill_plan.num_k_heads) != (Hv, Hk):
        n = len(batch.seq_lens)
        slots = backend.forward_metadata.mamba_cache_indices
        step = batch.step = gdn_layer.make_step_plan(
            num_actual_tokens=batch.num_tokens, num_v_heads=Hv, num_k_heads=Hk,
            conv_width=layer.conv_weights.shape[1], device=slots.device, prefill_lens=batch.seq_lens,
            prefill_slots=slots[:n], prefill_has_initial_state=forward_batch.extend_prefix_lens[:n] > 0,
            null_slot=0, prefill_plan=batch.plan_for(Hv, Hk))
    return step
