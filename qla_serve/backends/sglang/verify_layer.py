"""SGLang's GDN target-verify step (speculative decoding, linear drafts), conv included.

SGLang 0.5.23's ``GDNAttnBackend.forward_extend`` in target-verify mode (srt/layers/attention/
linear/gdn_backend.py:986-1017, 1045-1062, 1150-1172) runs its own Triton
``causal_conv1d_update`` over the D draft tokens of every request with an intermediate conv
window (the window after each draft token goes to ``intermediate_conv_window[0][ids[i], j]``, from
which SGLang commits the accepted one; the slot's window becomes the one after the last draft
token), then the kernel backend's ``target_verify`` on the conv output's q | k | v views. When
flashqla runs the verify, the plugin's hook (plugin.py, AROUND ``forward_extend``) hands a plain
verify step to :func:`forward_verify` here instead: qla_serve's verify conv
(``layer_ops.causal_conv_verify``, the same windows) and ``gdn_verify`` into SGLang's
intermediate SSM cache, with the step's slot ids and scratch ids derived once per forward batch
(kept on SGLang's per-batch metadata; under a captured verify graph, re-derived inside it).
"""

from __future__ import annotations

import dataclasses

import torch

import qla_serve
from qla_serve import layer_ops
from qla_serve.backends.gdn_layer import HEAD_DIM

# The verify launched as the conv's programmatic dependent (kernels/hopper/decode.verify's
# after_conv: its blocks load their ids and states while the conv runs) where requests x v-heads
# <= this; above, two plain launches. Measured on the H200 (benchmarks/layer.md, "SGLang's
# target-verify step" (full write-up: `git show af9803e:benchmarks/layer.md`),
# `sglang_verify.py --ab`): up to 64 rows 0.1-0.6 us faster per layer call
# (2/8, one request x 2 drafts: 4.6 against 5.2 us), from 256 rows level with fp32 states and
# 6-15% slower with bf16 states (2/8, 128 x 4: 65.2 against 57.1 us).
AFTER_CONV_MAX_ROWS = 64


@dataclasses.dataclass(eq=False)
class VerifyStep:
    """What every GDN layer of one verify forward batch shares (made by its first GDN layer)."""
    cache_indices: torch.Tensor      # SGLang's mamba_cache_indices (identity-matched)
    num_seqs: int                    # N = tokens // draft
    draft: int                       # D, SGLang's draft_token_num
    slot_ids: torch.Tensor           # [N] int32, SGLang's 0 and -1 -> -1
    window_ids: torch.Tensor         # [N] int32 rows of the intermediate caches
    cu_seqlens: torch.Tensor         # [N + 1] int32
    first_layer: int                 # the layer_id of the GDN layer that made it


def forward_verify(backend, layer, forward_batch, mixed_qkv: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor, cache, *, select_rows=None) -> torch.Tensor:
    """One target-verify step of one GDN layer, as SGLang's ``forward_extend`` returns it.

    Args:
        backend: SGLang's ``GDNAttnBackend`` (its pool and per-batch metadata).
        layer: the ``RadixLinearAttention``.
        forward_batch: SGLang's ``ForwardBatch`` (``spec_info.draft_token_num``).
        mixed_qkv: [N * D, dim] projected q | k | v before the conv; a, b: [N * D, Hv] raw gates.
        cache: this layer's ``SpeculativeState`` (``mamba2_layer_cache(layer_id)``, fetched once by
            the hook: SGLang builds a new object per call).
        select_rows: SGLang's ``select_verify_intermediate_state_indices`` (None: imported from
            SGLang; tests on a machine without SGLang pass a stand-in).
    Returns:
        [1, N * D, Hv, 128] in mixed_qkv's dtype (rows of padding requests zero).
    """
    step = _verify_step(backend, layer, forward_batch, mixed_qkv.shape[0], select_rows)
    N, D, Hk = step.num_seqs, step.draft, layer.num_k_heads
    Hv = cache.temporal.shape[1]
    y = layer_ops.causal_conv_verify(mixed_qkv, cache.conv[0], step.slot_ids, cache.intermediate_conv_window[0],
                                     step.window_ids, conv_weight=layer.conv_weights, conv_bias=layer.bias,
                                     activation=layer.activation, num_v_heads=Hv, draft=D)
    heads = y.view(N * D, 2 * Hk + Hv, HEAD_DIM)
    out = torch.empty(1, N * D, Hv, HEAD_DIM, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    qla_serve.gdn_verify(heads[:, :Hk], heads[:, Hk:2 * Hk], heads[:, 2 * Hk:], cache.temporal, step.slot_ids,
                         step.cu_seqlens, cache.intermediate_ssm, step.window_ids, a=a, b=b, A_log=layer.A_log,
                         dt_bias=layer.dt_bias, use_qk_l2norm=True, scale=layer.head_k_dim ** -0.5, out=out[0],
                         _after_conv=N * Hv <= AFTER_CONV_MAX_ROWS)
    return out


def _verify_step(backend, layer, forward_batch, T: int, select_rows) -> VerifyStep:
    """The forward pass's VerifyStep, kept on SGLang's per-batch metadata, so that every later
    layer reuses its ids; a call from the layer that made it starts a new pass over the same
    metadata (SGLang's graph capture: two warmup passes and the captured one over one metadata
    object, decode_layer._decode_step) and makes a new one, whose ids the captured pass derives
    inside the graph. The scratch rows are SGLang's own choice
    (``select_verify_intermediate_state_indices``, as its forward_extend takes them, :1000-1005:
    its per-position table, or the requests' pool rows under ``pp_spec_stable_rows``)."""
    meta = backend.forward_metadata
    cache_indices = meta.mamba_cache_indices
    step = getattr(meta, "qla_verify", None)
    if step is None or step.cache_indices is not cache_indices or step.num_seqs * step.draft != T \
            or step.first_layer == layer.layer_id:
        D = int(forward_batch.spec_info.draft_token_num)
        N = T // D
        if N * D != T:
            raise ValueError(f"mixed_qkv: expected draft_token_num ({D}) rows per request, got {T} rows")
        if select_rows is None:
            from sglang.srt.layers.attention.linear.utils import select_verify_intermediate_state_indices
            select_rows = select_verify_intermediate_state_indices
        qsl = meta.query_start_loc
        window_ids = select_rows(
            backend.verify_intermediate_state_indices, forward_batch.req_pool_indices,
            cache_indices[:qsl.shape[0] - 1] >= 0, backend.req_to_token_pool.size)
        step = meta.qla_verify = VerifyStep(
            cache_indices=cache_indices, num_seqs=N, draft=D, slot_ids=layer_ops.slot_ids(cache_indices[:N], 0),
            window_ids=_int32(window_ids[:N]), cu_seqlens=_int32(qsl[:N + 1]), first_layer=layer.layer_id)
    return step


def _int32(x: torch.Tensor) -> torch.Tensor:
    """x as int32, contiguous (no launch where it already is)."""
    return x if x.dtype is torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()
