"""The baselines of `qla-serve bench layer`: the same GDN layer composed from other libraries' ops.

Each composition is one engine GDN layer's core for one step on the bench's vLLM-shaped caches
(bench/layer.py's LayerCase), decodes first, then prefills:

* ``fla``: flash-linear-attention 0.6's Triton ops (``FLA_FLASH_QLA=0`` is set, so FLA runs its own
  kernels, not FlashQLA's): ``fla.modules.convolution.causal_conv1d`` (varlen prefill, the conv
  cache as initial state, the final state written back) and ``causal_conv1d_update`` (decode);
  gating in torch (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)) and
  ``chunk_gated_delta_rule`` for prefill (cu_seqlens, ``use_qk_l2norm_in_kernel``, V-first states
  gathered from the pool, final states scattered back); ``fused_recurrent_gated_delta_rule`` for
  decode (FLA 0.6's fused form: gating, beta sigmoid and l2norm in the kernel, V-first state
  gathered and scattered). FLA has no slot indirection and keeps W conv inputs per sequence where
  vLLM keeps W-1, so the gathers, scatters and column shifts are part of the call, as in any engine
  composing these ops. Its per-step host work (cu_seqlens and FLA's chunk indices, uploaded) is its
  "plan host us".
* ``flashinfer`` (only when ``flashinfer.gdn_prefill`` imports): FLA's conv as above, FlashInfer
  0.7's GDN ops on the pool in place: ``gdn_prefill.chunk_gated_delta_rule(q, k, v, g=exp(g), beta,
  initial_state=pool, output_state=pool, state_indices=ids, cu_seqlens, l2norm in kernel)`` after
  zeroing the slots of new prefills (FlashInfer has no has_initial_state), and
  ``gdn_decode.gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b,
  initial_state=pool, initial_state_indices=ids)``.
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

The compositions take their ops as a :class:`ComposedOps`, so tests/test_bench_layer.py runs them
on CPU tensors with torch stand-ins for the libraries' kernels.
"""

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


def fla_ops() -> ComposedOps:
    """FLA 0.6's ops (set FLA_FLASH_QLA=0 before the first import of fla)."""
    from fla.modules.convolution import causal_conv1d, causal_conv1d_update
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return ComposedOps(causal_conv1d, causal_conv1d_update, chunk_gated_delta_rule,
                       fused_recurrent_gated_delta_rule)


def flashinfer_ops() -> ComposedOps:
    """FLA's conv with FlashInfer's GDN prefill and decode."""
    from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    base = fla_ops()
    return ComposedOps(base.causal_conv1d, base.causal_conv1d_update,
                       fi_chunk_gated_delta_rule=chunk_gated_delta_rule,
                       fi_decode=gated_delta_rule_decode_pretranspose)


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


@dataclasses.dataclass(eq=False)
class ComposedStep:
    """What the composed layers share per step, built on the host from CPU lengths as an engine's
    metadata builder would. Device tensors: decode_ids [D] / prefill_ids [Np] (long; ``*_ids32``
    int32), has_init [Np, 1, 1] bool, cu_seqlens [Np+1] long (``cu_seqlens_cpu`` beside it),
    chunk_indices [chunks, 2] long ((sequence, chunk) per 64-token chunk: FLA's layout), fresh_ids
    (slots of prefills without an initial state, for FlashInfer to zero; None if none).
    vllm only (what vLLM's GDN metadata builder hands its layer, v1/attention/backends/gdn_attn.py):
    rows_ids32 [D+Np] int32 slots, rows_has_init [D+Np] bool, rows_qsl [D+Np+1] int32 (decodes
    1 token each), conv_meta (its causal-conv metadata, :func:`vllm_conv_metadata`), prefill_qsl32
    [Np+1] int32, prefill_has_init [Np] bool."""

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


def composed_step(case, i: int, impl: str = "fla") -> ComposedStep:
    """The ``impl`` composition's step for slot set i of ``case`` (a bench/layer.py LayerCase; host
    lists in, one upload per tensor)."""
    import torch

    dev, D = case.device, case.row.decodes
    lens, has = case.row.prefill_lens, case.has_initial_state
    ids = case.slot_sets[i]
    up = lambda xs, dt=torch.long: torch.tensor(xs, dtype=dt).to(dev, non_blocking=True)  # noqa: E731
    step = ComposedStep(num_decodes=D, num_prefill_tokens=sum(lens), num_spec_tokens=case.row.spec_tokens)
    if case.row.spec:           # vllm composes spec rows; the others refuse them when called
        if impl == "vllm":
            _vllm_spec_step(step, case, ids, up)
        return step
    if impl == "qla_split":
        from qla_serve.backends import gdn_layer

        step.decode_ids32 = up(ids[:D], torch.int32)
        step.qla = gdn_layer.make_step_plan(num_actual_tokens=D, num_v_heads=case.hv, num_k_heads=case.hk,
                                            conv_width=case.conv_weight.shape[1], device=dev,
                                            decode_slots=step.decode_ids32)
        step.qla.ids("decode")    # once per step, outside the layer call (as the qla rows' step)
        return step
    if impl == "sglang" and lens:   # SGLang's own extend: its metadata's ids, query_start_loc, lengths
        _sglang_extend_step(step, ids[D:], lens, has, up)
        step.decode_ids32 = up(ids[:D], torch.int32) if D else None
        return step
    if impl in ("sglang_qla", "sglang_fused_qla"):
        from qla_serve import layer_ops
        from qla_serve.backends.sglang.kernel import ExtendBatch, FlashQLAGDNKernel

        step.kernel = FlashQLAGDNKernel(("decode", "prefill"))
        if D:
            step.decode_ids32 = up(ids[:D], torch.int32)
            # the plugin's forward_decode hook binds the batch's ids, derived once per step
            step.kernel.bind_decode_ids(step.decode_ids32, layer_ops.slot_ids(step.decode_ids32, 0))
        if lens:                # what SGLang's metadata and the plugin's plan hook hand the extend
            _sglang_extend_step(step, ids[D:], lens, has, up)
            step.kernel.bind_batch(ExtendBatch(query_start_loc=step.prefill_qsl32, seq_lens=tuple(lens),
                                               num_tokens=sum(lens)))
        return step
    if impl == "vllm":          # only what vLLM's builder makes: its "plan host us" is that work
        if D:
            step.decode_ids32 = up(ids[:D], torch.int32)
        if lens:
            _vllm_step(step, case, ids, up)
        return step
    if D:
        step.decode_ids, step.decode_ids32 = up(ids[:D]), up(ids[:D], torch.int32)
    if lens:
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        step.prefill_ids, step.prefill_ids32 = up(ids[D:]), up(ids[D:], torch.int32)
        step.has_init = up(has, torch.bool).view(-1, 1, 1)
        step.cu_seqlens_cpu = torch.tensor(cu, dtype=torch.long)
        step.cu_seqlens = step.cu_seqlens_cpu.to(dev, non_blocking=True)
        step.chunk_indices = up(chunk_indices(lens)).view(-1, 2)
        fresh = [s for s, h in zip(ids[D:], has) if not h]
        step.fresh_ids = up(fresh) if fresh else None
    return step


def _sglang_extend_step(step: ComposedStep, ids, lens, has, up) -> None:
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


def _vllm_spec_step(step: ComposedStep, case, ids, up) -> None:
    """The fields of a spec step that vLLM's metadata builder makes (gdn_attn.py ~395-470): the
    spec rows' slots [N, 1 + drafts], their query_start_loc and num_accepted_tokens; beside
    prefills, the token indices of both kinds (a stable argsort of the spec-token mask: the spec
    tokens lead the row, so [0, Ts) and [Ts, T)) and the prefills' fields (:func:`_vllm_step`)."""
    import torch

    row = case.row
    step.spec_ids32 = up(ids[:row.spec_tokens], torch.int32).view(row.spec, row.spec_len)
    step.spec_qsl32 = up(list(range(0, row.spec_tokens + 1, row.spec_len)), torch.int32)
    step.num_accepted32 = up(case.num_accepted, torch.int32)
    if row.prefill_lens:
        step.spec_token_indx = up(list(range(row.spec_tokens)))
        step.non_spec_token_indx = up(list(range(row.spec_tokens, row.tokens)))
        _vllm_step(step, case, ids[row.spec_tokens:], up)


def _vllm_step(step: ComposedStep, case, ids, up) -> None:
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


def chunk_indices(lens, chunk=CHUNK) -> list[int]:
    """FLA's chunk indices, flattened: (sequence i, chunk j of it) for every ``chunk``-token chunk."""
    return [x for i, n in enumerate(lens) for j in range(-(-n // chunk)) for x in (i, j)]


def _split(y, hk, hv, lead=()):
    """q, k [*, Hk, 128], v [*, Hv, 128] views of the conv output y [*, dim] (``lead``: extra dims)."""
    kd = hk * HD
    shape = tuple(y.shape[:-1]) + tuple(lead)
    return (y[..., :kd].reshape(*shape, hk, HD), y[..., kd:2 * kd].reshape(*shape, hk, HD),
            y[..., 2 * kd:].reshape(*shape, hv, HD))


def _conv_decode(ops, ids, x, conv_state, weight, bias):
    """FLA's decode conv on the engine's cache: gather the W-1 history columns of each slot, prepend
    the column FLA keeps (unused by a width-W conv), update, write the last W-1 columns back."""
    import torch.nn.functional as F

    cache = F.pad(conv_state[ids], (1, 0))                       # [B, dim, W], contiguous
    y, cache = ops.causal_conv1d_update(x=x, cache=cache, weight=weight, bias=bias, activation="silu")
    conv_state[ids] = cache[..., 1:].to(conv_state.dtype)
    return y


def _conv_prefill(ops, step, x, conv_state, weight, bias):
    """FLA's varlen conv with each sequence's history (zero for new sequences) as initial state;
    the final states' last W-1 columns go back to the cache."""
    import torch
    import torch.nn.functional as F

    ids = step.prefill_ids
    hist = torch.where(step.has_init, conv_state[ids], _zero(conv_state))
    y, final = ops.causal_conv1d(x=x[None], weight=weight, bias=bias, initial_state=F.pad(hist, (1, 0)),
                                 output_final_state=True, activation="silu", cu_seqlens=step.cu_seqlens,
                                 chunk_indices=step.chunk_indices)
    conv_state[ids] = final[..., 1:].to(conv_state.dtype)
    return y[0]


def _zero(like):
    """A 0-dim zero of ``like``'s dtype and device (torch.where's other operand)."""
    import torch

    return torch.zeros((), dtype=like.dtype, device=like.device)


def _torch_gating(a, b, A_log, dt_bias):
    """fp32 g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), in torch."""
    import torch
    import torch.nn.functional as F

    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def fla_layer_forward(step: ComposedStep, mixed_qkv, a, b, *, ops: ComposedOps, conv_weight, conv_bias,
                      conv_state, ssm_state, A_log, dt_bias, num_k_heads, out, scale=None) -> None:
    """The GDN layer from FLA's ops: decodes ``[0, D)``, then prefills; caches updated in place."""
    D, Tp = step.num_decodes, step.num_prefill_tokens
    conv = (conv_state, conv_weight, conv_bias)
    if D:
        _fla_decode(ops, step, mixed_qkv[:D], a[:D], b[:D], conv, ssm_state, A_log, dt_bias,
                    num_k_heads, out[:D], scale)
    if Tp:
        sl = slice(D, D + Tp)
        _fla_prefill(ops, step, mixed_qkv[sl], a[sl], b[sl], conv, ssm_state, A_log, dt_bias,
                     num_k_heads, out[sl], scale)


def _fla_decode(ops, step, x, a, b, conv, ssm_state, A_log, dt_bias, hk, out, scale):
    """FLA decode: conv update, then fused_recurrent_gated_delta_rule with the gating, beta sigmoid
    and l2norm in the kernel on the gathered V-first states; final states scattered back."""
    ids = step.decode_ids
    y = _conv_decode(ops, ids, x, *conv)
    q, k, v = _split(y, hk, ssm_state.shape[1], lead=(1,))          # [B, 1, H, 128]
    o, ht = ops.fused_recurrent_gated_delta_rule(
        q, k, v, g=a[:, None], beta=b[:, None], scale=scale, initial_state=ssm_state[ids],
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=True)
    ssm_state[ids] = ht.to(ssm_state.dtype)
    out.copy_(o[:, 0])


def _fla_prefill(ops, step, x, a, b, conv, ssm_state, A_log, dt_bias, hk, out, scale):
    """FLA prefill: varlen conv, torch gating, chunk_gated_delta_rule from the gathered V-first
    states (zero for new sequences); final states scattered back."""
    import torch

    ids = step.prefill_ids
    y = _conv_prefill(ops, step, x, *conv)
    q, k, v = _split(y, hk, ssm_state.shape[1])
    g, beta = _torch_gating(a, b, A_log, dt_bias)
    h0 = torch.where(step.has_init[..., None], ssm_state[ids], _zero(ssm_state))
    o, ht = ops.chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=h0,
        output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True,
        cu_seqlens=step.cu_seqlens, cu_seqlens_cpu=step.cu_seqlens_cpu, chunk_indices=step.chunk_indices)
    ssm_state[ids] = ht.to(ssm_state.dtype)
    out.copy_(o[0])


def flashinfer_layer_forward(step: ComposedStep, mixed_qkv, a, b, *, ops: ComposedOps, conv_weight,
                             conv_bias, conv_state, ssm_state, A_log, dt_bias, num_k_heads, out,
                             scale=None) -> None:
    """The GDN layer from FLA's conv and FlashInfer's GDN ops (states read and written in the pool
    through slot indices, in place)."""
    import torch

    D, Tp = step.num_decodes, step.num_prefill_tokens
    hk, hv = num_k_heads, ssm_state.shape[1]
    if D:
        y = _conv_decode(ops, step.decode_ids, mixed_qkv[:D], conv_state, conv_weight, conv_bias)
        q, k, v = (t.contiguous() for t in _split(y, hk, hv, lead=(1,)))
        ops.fi_decode(q, k, v, None, A_log, a[:D, None], dt_bias, b[:D, None], scale=scale,
                      output=out[:D].view(D, 1, hv, HD), use_qk_l2norm=True, initial_state=ssm_state,
                      initial_state_indices=step.decode_ids32)
    if Tp:
        sl = slice(D, D + Tp)
        y = _conv_prefill(ops, step, mixed_qkv[sl], conv_state, conv_weight, conv_bias)
        q, k, v = (t.contiguous() for t in _split(y, hk, hv))
        g, beta = _torch_gating(a[sl], b[sl], A_log, dt_bias)
        if step.fresh_ids is not None:                             # it has no has_initial_state
            ssm_state.index_fill_(0, step.fresh_ids, 0)
        ops.fi_chunk_gated_delta_rule(
            q, k, v, g=torch.exp(g), beta=beta, scale=scale, initial_state=ssm_state,
            output_final_state=True, cu_seqlens=step.cu_seqlens, use_qk_l2norm_in_kernel=True,
            output=out[sl], output_state=ssm_state, state_indices=step.prefill_ids32)


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
        _packed_decode_step(ops, step, x, a, b, conv_state, conv_weight, conv_bias, ssm_state, A_log, dt_bias,
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


def _packed_decode_step(ops, step, x, a, b, conv_state, conv_weight, conv_bias, ssm_state, A_log, dt_bias, out,
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


def _decode_only(step: ComposedStep, impl: str) -> int:
    """The step's decode count; a step with prefills is refused (``impl`` composes decodes only)."""
    if step.num_prefill_tokens:
        raise NotImplementedError(f"{impl}: decode-only rows (SGLang's prefill is not composed here)")
    return step.num_decodes


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
    _packed_decode_step(ops, step, mixed_qkv[:D], a[:D], b[:D], conv_state, conv_weight, conv_bias, ssm_state,
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
    q, k, v = _split(y, num_k_heads, ssm_state.shape[1])
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
    q, k, v = _split(y, num_k_heads, ssm_state.shape[1])
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


COMPOSED = {"fla": fla_layer_forward, "flashinfer": flashinfer_layer_forward, "vllm": vllm_layer_forward,
            "sglang": sglang_layer_forward, "sglang_qla": sglang_qla_layer_forward,
            "sglang_fused": sglang_fused_layer_forward, "sglang_fused_qla": sglang_fused_qla_layer_forward,
            "qla_split": qla_split_layer_forward}
LOADERS = {"fla": fla_ops, "flashinfer": flashinfer_ops, "vllm": vllm_ops, "sglang": sglang_ops,
           "sglang_qla": sglang_qla_ops, "sglang_fused": sglang_fused_ops, "sglang_fused_qla": sglang_fused_ops,
           "qla_split": sglang_fused_ops}   # the same keys: each one's ops
PROJECTION_IMPLS = ("sglang_fused", "sglang_fused_qla", "qla_split")   # take Qwen3.5's (qkvz, ba)
# they run on SGLang's cache layout only (--pool sglang)
SGLANG_LAYOUT_IMPLS = ("sglang", "sglang_qla", *PROJECTION_IMPLS)


def composed_call(impl: str, case, step: ComposedStep, ops: ComposedOps) -> Callable[[], None]:
    """One layer call of the ``impl`` composition (a COMPOSED key) on the case's tensors."""
    fwd, kw = COMPOSED[impl], case.layer_kwargs()
    if impl in SGLANG_LAYOUT_IMPLS and case.layout != "sglang":
        raise ValueError(f"{impl}: runs on SGLang's cache layout (--pool sglang), got --pool {case.layout}")
    if case.row.spec and impl != "vllm":
        def refused():
            raise NotImplementedError(f"{impl}: composes no speculative (MTP) step; rows with spec decodes "
                                      "run qla and vllm")
        return refused
    # vLLM's causal_conv1d_update writes its output over its input (the layer's projection, which
    # vLLM then drops): its composition gets its own copy, so the case's inputs stay the other
    # impls' (later calls of the same composition convolve the copy again: same work, other values)
    x = case.mixed_qkv.clone() if impl == "vllm" else case.mixed_qkv
    if impl in PROJECTION_IMPLS:
        proj = qwen35_projections(case)
        return lambda: fwd(step, proj, None, None, ops=ops, scale=None, **kw)
    return lambda: fwd(step, x, case.a, case.b, ops=ops, scale=None, **kw)


def qwen35_projections(case):
    """Qwen3.5's decode inputs as SGLang's model hands them over: qkvz = [q | k | v | z] (the case's
    mixed_qkv and a random z of Hv * 128 channels) and ba = [b | a], each one contiguous tensor."""
    import torch

    gen = torch.Generator(device=case.device).manual_seed(7)
    T = case.mixed_qkv.shape[0]
    z = torch.randn(T, case.hv * HD, generator=gen, device=case.device).to(case.mixed_qkv.dtype)
    return torch.cat([case.mixed_qkv, z], 1), torch.cat([case.b, case.a], 1)
