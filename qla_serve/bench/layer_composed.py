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
* ``vllm``: vLLM 0.33.0's own layer on Hopper, called as its Qwen GDN layer calls its ops
  (bench/composed_vllm.py, which cites each line).
* ``sglang``, ``sglang_qla`` (SGLang 0.5.23's decode and extend routes) and ``sglang_fused``,
  ``sglang_fused_qla``, ``qla_split`` (its Qwen3.5 decode route from the projections), on SGLang's
  cache layout (bench/composed_sglang.py).

The compositions take their ops as a :class:`ComposedOps`, so tests/test_bench_layer.py runs them
on CPU tensors with torch stand-ins for the libraries' kernels. What they share:
bench/composed_common.py.
"""

from __future__ import annotations

from typing import Callable

from . import composed_sglang, composed_vllm
from .composed_common import CHUNK, HD, ComposedOps, ComposedStep, split_qkv
from .composed_sglang import qwen35_projections

__all__ = ["CHUNK", "COMPOSED", "HD", "LOADERS", "PROJECTION_IMPLS", "SGLANG_LAYOUT_IMPLS", "ComposedOps",
           "ComposedStep", "chunk_indices", "composed_call", "composed_step", "qwen35_projections"]


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
            composed_vllm.spec_step_fields(step, case, ids, up)
        return step
    if impl == "qla_split":
        composed_sglang.qla_split_step_fields(step, case, ids, up)
        return step
    if impl == "sglang" and lens:   # SGLang's own extend: its metadata's ids, query_start_loc, lengths
        composed_sglang.extend_step_fields(step, ids[D:], lens, has, up)
        step.decode_ids32 = up(ids[:D], torch.int32) if D else None
        return step
    if impl in ("sglang_qla", "sglang_fused_qla"):
        composed_sglang.kernel_step_fields(step, case, ids, up)
        return step
    if impl == "vllm":          # only what vLLM's builder makes: its "plan host us" is that work
        composed_vllm.step_fields(step, case, ids, up)
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


def chunk_indices(lens, chunk=CHUNK) -> list[int]:
    """FLA's chunk indices, flattened: (sequence i, chunk j of it) for every ``chunk``-token chunk."""
    return [x for i, n in enumerate(lens) for j in range(-(-n // chunk)) for x in (i, j)]


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
    q, k, v = split_qkv(y, hk, ssm_state.shape[1], lead=(1,))          # [B, 1, H, 128]
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
    q, k, v = split_qkv(y, hk, ssm_state.shape[1])
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
        q, k, v = (t.contiguous() for t in split_qkv(y, hk, hv, lead=(1,)))
        ops.fi_decode(q, k, v, None, A_log, a[:D, None], dt_bias, b[:D, None], scale=scale,
                      output=out[:D].view(D, 1, hv, HD), use_qk_l2norm=True, initial_state=ssm_state,
                      initial_state_indices=step.decode_ids32)
    if Tp:
        sl = slice(D, D + Tp)
        y = _conv_prefill(ops, step, mixed_qkv[sl], conv_state, conv_weight, conv_bias)
        q, k, v = (t.contiguous() for t in split_qkv(y, hk, hv))
        g, beta = _torch_gating(a[sl], b[sl], A_log, dt_bias)
        if step.fresh_ids is not None:                             # it has no has_initial_state
            ssm_state.index_fill_(0, step.fresh_ids, 0)
        ops.fi_chunk_gated_delta_rule(
            q, k, v, g=torch.exp(g), beta=beta, scale=scale, initial_state=ssm_state,
            output_final_state=True, cu_seqlens=step.cu_seqlens, use_qk_l2norm_in_kernel=True,
            output=out[sl], output_state=ssm_state, state_indices=step.prefill_ids32)


COMPOSED = {"fla": fla_layer_forward, "flashinfer": flashinfer_layer_forward,
            "vllm": composed_vllm.vllm_layer_forward,
            "sglang": composed_sglang.sglang_layer_forward, "sglang_qla": composed_sglang.sglang_qla_layer_forward,
            "sglang_fused": composed_sglang.sglang_fused_layer_forward,
            "sglang_fused_qla": composed_sglang.sglang_fused_qla_layer_forward,
            "qla_split": composed_sglang.qla_split_layer_forward}
LOADERS = {"fla": fla_ops, "flashinfer": flashinfer_ops, "vllm": composed_vllm.vllm_ops,
           "sglang": composed_sglang.sglang_ops, "sglang_qla": composed_sglang.sglang_qla_ops,
           "sglang_fused": composed_sglang.sglang_fused_ops, "sglang_fused_qla": composed_sglang.sglang_fused_ops,
           "qla_split": composed_sglang.sglang_fused_ops}   # the same keys: each one's ops
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
