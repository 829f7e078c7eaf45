"""The GDN layer's ops around the core: the causal conv over an engine's conv state, fused with
what the core reads, and speculative verify straight into per-token state slots.

An engine's GDN layer hands over ``mixed_qkv`` [T, (2 Hk + Hv) 128] (q | k | v before the
conv), raw gate logits a, b [T, Hv], and its caches: a conv state [S, dim, L] and the SSM state
pool [S, Hv, 128, 128]. These ops turn that into the core's inputs in one or two launches on
the TileLang path (kernels/hopper/conv.py; math in its docstring), instead of the ~30 torch
launches and a float32 copy of the whole conv input a torch layer spends:

    q, k, v, g, beta = gdn_layer_prefill_inputs(...)   conv + split + L2 norm + gates and the
                                                       conv-state write-back (1 launch)
    y = causal_conv_decode(...)                        one token per sequence (1 launch), for
                                                       gdn_decode(..., use_qk_l2norm=True)
    y = causal_conv_spec(...)                          vLLM's speculative window (1 launch)
    y = causal_conv_verify(...)                        SGLang's target verify: D drafts over
                                                       the slot's window, each token's window
                                                       kept for its commit (1 launch)
    causal_conv_checkpoints(...)                       vLLM's prefix-cache checkpoints: the W-1
                                                       inputs before each checkpoint into its
                                                       conv slot (1 launch)
    o = gdn_verify_slots(...)                          verify, each draft token's state into
                                                       its own pool slot (1 launch, no scratch)
    ids = slot_ids(engine_slots, null_slot, ...)       once per step: the engine's slot ids as
                                                       the ops take them (1 launch)

Paths as in ops.py: ``tilelang`` (Hopper/Blackwell), else the torch reference
(kernels/reference_conv.py; CPU tensors, and any GPU without qla_serve kernels, where it syncs
once per call). Slot ids < 0 are padding: never read or written. Arguments are checked from
host metadata once per metadata set (as ops.py's decode/verify; prefill per plan), never by
reading the GPU.
"""

from __future__ import annotations

import torch

from qla_serve import _validate as V
from qla_serve.kernels import reference_conv
from qla_serve.launch_record import note_dispatch
from qla_serve.ops import (_checked_key, _checks_due, _passed, _path, _same_dtype, _scale, path_module,
                           prefill_qk_dtype)
from qla_serve.plan import PrefillPlan

CONV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# slot_ids through its TileLang kernel (kernels/hopper/slot_ids.py: one launch instead of 2-5
# torch ops and ~20 us of host time each per step). H200 (2026-12-02): its GPU tests pass
# against the torch form, the layer's float64 GPU tests pass with it; bench layer at 2/8: the
# step's "plan host us" 168 -> 129 (1 x 32768), 150 -> 103 (16 x 512), 32 -> 20 (1 decode),
# the derivation's GPU time 5.5 -> 1.3 us. False: the torch form (reference_conv.slot_ids).
SLOT_IDS_KERNEL = True


def _run(op: str, device: torch.device, io_dtype, *args, **kwargs):
    """ops._run with the layer ops' reference module (FLA has none of these ops: paths.py);
    returns what the op returns."""
    path = _path(op, device, io_dtype)
    note_dispatch(op, path)
    return getattr(path_module(path, device, reference_conv), op)(*args, **kwargs)


def _activation(activation) -> str:
    if activation in ("silu", "swish", True):
        return "silu"
    if activation in (None, False, "none", "identity"):
        return "none"
    raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")


def _check_conv(x, conv_state, conv_weight, conv_bias, dim: int, extra_cols: int = 0) -> int:
    """x [T, dim] (unit channel stride), conv_state [S, dim, L >= W - 1 + extra_cols],
    conv_weight [dim, W], conv_bias [dim] or None. Returns W."""
    V.check_dtype("mixed_qkv", x, (torch.bfloat16, torch.float16, torch.float32))
    V.check_shape("mixed_qkv", x, (None, dim))
    if x.shape[0] and x.stride(1) != 1:
        raise ValueError(f"mixed_qkv: expected unit stride along the channels, got strides {tuple(x.stride())}")
    V.check_dtype("conv_weight", conv_weight, CONV_DTYPES)
    if conv_weight.dim() != 2 or conv_weight.shape[0] != dim or not 2 <= conv_weight.shape[1] <= 8:
        raise ValueError(f"conv_weight: expected [{dim}, W] with width W in 2..8, got {list(conv_weight.shape)}")
    W = conv_weight.shape[1]
    if conv_bias is not None:
        V.check_dtype("conv_bias", conv_bias, (conv_weight.dtype,))
        V.check_shape("conv_bias", conv_bias, (dim,))
        if not conv_bias.is_contiguous():
            raise ValueError("conv_bias: expected a contiguous vector")
    V.check_dtype("conv_state", conv_state, CONV_DTYPES)
    V.check_shape("conv_state", conv_state, (None, dim, None))
    min_cols = W - 1 + extra_cols
    if conv_state.shape[2] < min_cols:
        raise ValueError(f"conv_state: expected at least {min_cols} columns (conv width {W}), "
                         f"got {conv_state.shape[2]}")
    V.check_device(x.device, conv_state=conv_state, conv_weight=conv_weight, conv_bias=conv_bias)
    return W


def _check_draft(draft) -> None:
    """The speculative convs' draft depth D (conv_spec, conv_verify): 1..16 tokens per sequence."""
    if not (isinstance(draft, int) and 1 <= draft <= 16):
        raise ValueError(f"draft: expected 1..16 tokens per sequence, got {draft!r}")


def _check_conv_out(out, x) -> None:
    """A conv output buffer: x's dtype, shape and device, unit stride along the channels."""
    V.check_dtype("out", out, (x.dtype,))
    V.check_shape("out", out, tuple(x.shape))
    V.check_device(x.device, out=out)
    if out.shape[0] and out.stride(1) != 1:
        raise ValueError(f"out: expected unit stride along the channels, got strides {tuple(out.stride())}")


def _int32(x: torch.Tensor, device) -> torch.Tensor:
    """Counts and offsets (num_accepted, cu_seqlens) as the kernels take them (as they are where
    they already are: no torch call, which a launch replay's watcher would refuse)."""
    if x.dtype is torch.int32 and x.device == device:
        return x
    return x.to(device, torch.int32, non_blocking=True)


def gdn_layer_prefill_inputs(mixed_qkv, a, b, conv_state, slot_ids, plan, *, conv_weight,
                             conv_bias=None, activation="silu", has_initial_state=None, A_log,
                             dt_bias, num_k_heads: int, qk_dtype=None, _trusted=False, _outputs=None,
                             _decodes=None):
    """A varlen prefill's conv over the conv state, and what :func:`qla_serve.gdn_prefill` reads.

    Args:
        mixed_qkv: [T, (2 Hk + Hv) 128] bf16/fp16 (fp32: reference path), unit channel stride
            (a row-strided view of a fused projection is fine); T == plan.total_tokens.
        a, b: [T, Hv] raw gate logits; A_log, dt_bias: [Hv] (each in its own dtype).
        conv_state: [S, dim, L] (either memory layout), L >= W - 1, updated in place: each
            live slot's first W - 1 columns end holding its sequence's last W - 1 inputs.
        slot_ids: [N] (one per plan sequence; < 0 padding: zero history, nothing written).
        plan: :func:`qla_serve.plan_prefill` for the batch (its device cu_seqlens are used).
        conv_weight: [dim, W]; conv_bias: [dim] or None; activation: "silu" or None.
        has_initial_state: [N] bool or None (all True): False reads no history (zeros).
        num_k_heads: Hk (Hv comes from the plan).
        qk_dtype: q/k's dtype; None: what gdn_prefill reads best here (:func:`prefill_qk_dtype`).
        _trusted, _outputs, _decodes: internal (backends/gdn_layer). _trusted: metadata already
            checked this step (ops.gdn_prefill's). _outputs: the five output tensors, from
            :func:`prefill_step_buffers` (qk_dtype: their q's dtype). _decodes: a mixed step's
            decode rows (x [B, dim], int32 slot ids [B], out [B, dim]: what
            :func:`causal_conv_decode` takes, checked by the caller with
            :func:`check_conv_decode_args`), convolved in the same launch.
    Returns:
        (q, k, v, g, beta): q, k [T, Hk, 128] L2-normalised (from the fp32 conv output);
        v [T, Hv, 128] in mixed_qkv's dtype; g, beta [T, Hv] fp32 (contiguous).
    """
    if not _trusted:
        check_layer_prefill_args(mixed_qkv, a, b, conv_state, slot_ids, plan, conv_weight=conv_weight,
                                 conv_bias=conv_bias, activation=activation, has_initial_state=has_initial_state,
                                 A_log=A_log, dt_bias=dt_bias, num_k_heads=num_k_heads, qk_dtype=qk_dtype)
    act = _activation(activation)
    Hv, Hk = plan.num_v_heads, num_k_heads
    qk_dtype = _layer_qk_dtype(mixed_qkv, qk_dtype)
    dev, T = mixed_qkv.device, mixed_qkv.shape[0]
    if has_initial_state is None:
        has_init = plan.scratch(("ones_int8", dev), lambda: torch.ones(plan.num_seqs, dtype=torch.int8, device=dev))
    else:
        has_init = has_initial_state.view(torch.int8)
    a, b = _same_dtype(a, b)
    if _outputs is not None:
        q, k, v, g, beta = _outputs
    else:
        q, k, v, g, beta = _prefill_outputs(T, Hk, Hv, qk_dtype, mixed_qkv.dtype, dev)
    extra = {} if _decodes is None else {"decodes": _decodes}
    _run("conv_prefill", dev, mixed_qkv.dtype, mixed_qkv, conv_state, conv_weight, conv_bias,
         V.int32_index(slot_ids, dev), has_init, plan.cu_seqlens, a, b, A_log, dt_bias, activation=act,
         q_out=q, k_out=k, v_out=v, g_out=g, beta_out=beta, **extra)
    return q, k, v, g, beta


def check_layer_prefill_args(mixed_qkv, a, b, conv_state, slot_ids, plan, *, conv_weight, conv_bias=None,
                             activation="silu", has_initial_state=None, A_log, dt_bias, num_k_heads: int,
                             qk_dtype=None) -> None:
    """:func:`gdn_layer_prefill_inputs`' argument checks, without its launches: from host
    metadata, once per plan and metadata set (kept in the plan). backends/gdn_layer runs every
    op's checks of a layer call before its first launch (ops.check_prefill_args)."""
    act = _activation(activation)
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan: expected a PrefillPlan from qla_serve.plan_prefill, got {type(plan).__name__}")
    Hv, Hk = plan.num_v_heads, num_k_heads
    dim = (2 * Hk + Hv) * V.HEAD_DIM
    qk_dtype = _layer_qk_dtype(mixed_qkv, qk_dtype)
    args = (mixed_qkv, a, b, conv_state, slot_ids, conv_weight, conv_bias, has_initial_state, A_log, dt_bias)
    seen = _checked_key(("layer_prefill", act, qk_dtype, Hk), args, (slot_ids,))
    if seen is not None and seen in plan.kernel_cache:
        return
    if Hk != plan.num_k_heads:
        raise ValueError(f"num_k_heads: expected the plan's {plan.num_k_heads}, got {Hk}")
    T = plan.total_tokens
    _check_conv(mixed_qkv, conv_state, conv_weight, conv_bias, dim)
    if mixed_qkv.shape[0] != T:
        raise ValueError(f"mixed_qkv: expected the plan's {T} tokens, got {mixed_qkv.shape[0]}")
    if T and (mixed_qkv.stride(0) * mixed_qkv.element_size() % 16 or mixed_qkv.data_ptr() % 16):
        raise ValueError(f"mixed_qkv: the prefill conv kernel reads rows in 16-byte vectors: expected a row "
                         f"stride of whole 16 bytes and a 16-byte aligned base, got stride(0) "
                         f"{mixed_qkv.stride(0)}")
    V.check_gates(T, Hv, None, None, a, b, A_log, dt_bias, allow_raw=True)
    V.check_qk_dtype(qk_dtype if qk_dtype != mixed_qkv.dtype else None, mixed_qkv)
    V.check_index("slot_ids", slot_ids, plan.num_seqs, conv_state.shape[0], "conv_state's slot count",
                  unique_live=True)
    if has_initial_state is not None:
        V.check_dtype("has_initial_state", has_initial_state, (torch.bool,))
        V.check_shape("has_initial_state", has_initial_state, (plan.num_seqs,))
    if plan.device != mixed_qkv.device:
        raise ValueError(f"plan: expected index tensors on {mixed_qkv.device}, got {plan.device}")
    V.check_device(mixed_qkv.device, a=a, b=b, A_log=A_log, dt_bias=dt_bias, slot_ids=slot_ids,
                   has_initial_state=has_initial_state)
    if seen is not None:
        plan.kernel_cache[seen] = True


def _layer_qk_dtype(mixed_qkv, qk_dtype):
    """The prefill inputs' q/k dtype: ``qk_dtype``, or what gdn_prefill reads best here."""
    return qk_dtype if qk_dtype is not None else (prefill_qk_dtype(mixed_qkv) or mixed_qkv.dtype)


def prefill_step_buffers(mixed_qkv, plan, *, num_k_heads: int, qk_dtype=None) -> tuple:
    """(q, k, v, g, beta) output buffers for :func:`gdn_layer_prefill_inputs` (its
    ``_outputs``) kept in the plan: the same tensors for every call with this plan, these dtypes
    and ``num_k_heads``. backends/gdn_layer's layers share them: a layer's gdn_prefill reads them
    before the next layer's conv writes them (one stream), and a step saves five allocations per
    layer."""
    dev, T = mixed_qkv.device, mixed_qkv.shape[0]
    qk_dtype = _layer_qk_dtype(mixed_qkv, qk_dtype)
    return plan.scratch(("layer_prefill_outputs", dev, qk_dtype, mixed_qkv.dtype, num_k_heads, T),
                        lambda: _prefill_outputs(T, num_k_heads, plan.num_v_heads, qk_dtype, mixed_qkv.dtype, dev))


def _prefill_outputs(T: int, Hk: int, Hv: int, qk_dtype, v_dtype, device) -> tuple:
    """Empty q, k [T, Hk, 128] (qk_dtype), v [T, Hv, 128] (v_dtype), g, beta [T, Hv] fp32."""
    q = torch.empty((T, Hk, V.HEAD_DIM), dtype=qk_dtype, device=device)
    g = torch.empty((T, Hv), dtype=torch.float32, device=device)
    return (q, torch.empty_like(q), torch.empty((T, Hv, V.HEAD_DIM), dtype=v_dtype, device=device), g,
            torch.empty_like(g))


def slot_ids(slots, null_slot: int, *, cu_seqlens=None) -> torch.Tensor:
    """An engine step's slot ids as the ops take them: int32, -1 where the engine marks padding.

    Args:
        slots: [N] or [Ns, D] int32/int64 engine slot ids on the device (any strides);
            ``null_slot`` (an int) marks padding. [Ns, D] (spec decodes): a row whose first
            slot is null is padding as a whole.
        cu_seqlens: with [N] prefill slots, the step's [N+1] int32 token offsets on the same
            device: empty sequences are padding too.
    Returns a new int32 tensor of ``slots``' shape. No sync, CUDA-graph capturable; 2-5 torch
    ops (reference_conv.slot_ids), or one launch on the TileLang path where SLOT_IDS_KERNEL.
    """
    V.check_dtype("slots", slots, V.INDEX_DTYPES)
    if slots.dim() not in (1, 2) or (cu_seqlens is not None and slots.dim() != 1):
        raise ValueError(f"slots: expected [N] slot ids ([N] with cu_seqlens) or [Ns, D], got shape {list(slots.shape)}")
    if isinstance(null_slot, bool) or not isinstance(null_slot, int):
        raise TypeError(f"null_slot: expected an int, got {type(null_slot).__name__}")
    if cu_seqlens is not None:
        V.index_vector("cu_seqlens", cu_seqlens, slots.shape[0] + 1, (torch.int32,))
        V.check_device(slots.device, cu_seqlens=cu_seqlens)
    if not SLOT_IDS_KERNEL:
        return reference_conv.slot_ids(slots, null_slot, cu_seqlens)
    return _run("slot_ids", slots.device, None, slots, null_slot, cu_seqlens)


def checkpoint_conv_table(slot_ids, chunks, cu_seqlens) -> tuple:
    """What :func:`causal_conv_checkpoints` launches its kernel over, derived on the device from
    [N] slot ids and chunks and [N+1] cu_seqlens: (table [2N+1] int32, each sequence split at its
    checkpoint; slots [2N] int32, the checkpoint slot at each first half, -1 elsewhere; flags [2N]
    int8 zeros). A step's layers share it (backends/gdn_layer.StepPlan derives it once)."""
    dev = slot_ids.device
    cu = cu_seqlens.to(dev, torch.int32)
    lens = cu[1:] - cu[:-1]
    chunks = chunks.to(dev, torch.int32)
    ends = cu[:-1] + torch.minimum(chunks * 64, lens)
    live = (chunks > 0) & (slot_ids >= 0) & ((chunks - 1) * 64 < lens)
    table = torch.cat([torch.stack([cu[:-1], ends], 1).view(-1), cu[-1:]])        # [2N + 1]
    none = torch.full_like(slot_ids, -1, dtype=torch.int32)
    slots = torch.stack([torch.where(live, slot_ids.to(torch.int32), none), none], 1).view(-1)
    return table, slots, torch.zeros(slots.shape[0], dtype=torch.int8, device=dev)


def causal_conv_checkpoints(x, conv_state, slot_ids, chunks, cu_seqlens, *, width: int, num_v_heads: int,
                            table=None, _trusted=False) -> None:
    """The conv side of gdn_prefill's checkpoints: conv_state[slot_ids[s], :, :W-1] <- the W-1
    raw inputs before token min(64 * chunks[s], len_s) of sequence s, for the same rows
    gdn_prefill writes an SSM checkpoint for (1 <= chunks[s] <= ceil(len_s / 64), slot >= 0).
    x: the prefill rows [T, dim] before the conv, packed by cu_seqlens [N+1] (device); slot_ids,
    chunks: [N] int32 on x's device. A prefix shorter than W - 1 tokens gets zeros before it
    (vLLM's checkpoint offsets are >= 64). Device ops only: the kernel is the prefill's conv-state
    write-back (conv_window) over an interleaved table, sequence s split at its checkpoint.
    ``table``: :func:`checkpoint_conv_table` of these same three tensors, when the caller keeps
    it for a step's layers (else derived here: ~10 small launches). ``_trusted``: internal
    (backends/gdn_layer), as :func:`causal_conv_spec`'s."""
    if not _trusted:
        check_conv_checkpoints_args(x, conv_state, slot_ids, chunks, cu_seqlens, width=width)
    N = slot_ids.shape[0]
    if not N or x.shape[0] == 0:
        return
    if table is None:
        table = checkpoint_conv_table(slot_ids, chunks, cu_seqlens)
    elif not (isinstance(table, tuple) and len(table) == 3 and table[0].shape == (2 * N + 1,)
              and table[1].shape == (2 * N,)):
        raise ValueError(f"table: expected checkpoint_conv_table() of these {N} sequences")
    cu_table, slots, flags = table
    _run("conv_window", x.device, x.dtype, x, conv_state, slots, flags, cu_table, num_v_heads=num_v_heads,
         width=width)


def check_conv_checkpoints_args(x, conv_state, slot_ids, chunks, cu_seqlens, *, width: int) -> None:
    """:func:`causal_conv_checkpoints`' argument checks, without its launch (once per metadata set)."""
    key = _checked_key(("conv_checkpoints", width), (x, conv_state, slot_ids, chunks, cu_seqlens),
                       (slot_ids,))
    if _checks_due(key):
        N = V.index_vector("cu_seqlens", cu_seqlens) - 1
        V.check_index("slot_ids", slot_ids, N, conv_state.shape[0], "conv_state's slot count", unique_live=True)
        V.index_vector("chunks", chunks, N)
        V.check_dtype("conv_state", conv_state, CONV_DTYPES)
        if not (isinstance(width, int) and 2 <= width <= 8 and conv_state.shape[2] >= width - 1):
            raise ValueError(f"width: expected the conv width (2..8, <= conv_state's columns + 1), got {width}")
        V.check_device(x.device, conv_state=conv_state, slot_ids=slot_ids, chunks=chunks, cu_seqlens=cu_seqlens)
        _passed(key)


def causal_conv_decode(x, conv_state, slot_ids, *, conv_weight, conv_bias=None, activation="silu",
                       num_v_heads: int, out=None, _trusted=False):
    """One token per sequence through the causal conv; the window shifts by one in place.

    Args:
        x: [B, dim] (dim = (2 Hk + Hv) 128; unit channel stride); conv_state: [S, dim, L],
            L >= W - 1 (columns 0..W-2 are the window, oldest first); slot_ids: [B] (< 0:
            padding, zero output row, nothing read or written).
        out: optional [B, dim] in x's dtype (unit channel stride). CUDA-graph capturable.
        _trusted: internal (backends/gdn_layer): metadata already checked this step.
    Returns:
        y [B, dim] = act(conv) in x's dtype: q | k | v for :func:`qla_serve.gdn_decode` with
        ``use_qk_l2norm=True``.
    """
    if not _trusted:
        check_conv_decode_args(x, conv_state, slot_ids, conv_weight=conv_weight, conv_bias=conv_bias,
                               activation=activation, num_v_heads=num_v_heads, out=out)
    act = _activation(activation)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _run("conv_decode", x.device, x.dtype, x, conv_state, conv_weight, conv_bias, V.int32_index(slot_ids, x.device),
         num_v_heads=num_v_heads, activation=act, out=out)
    return out


def check_conv_decode_args(x, conv_state, slot_ids, *, conv_weight, conv_bias=None, activation="silu",
                           num_v_heads: int, out=None) -> None:
    """:func:`causal_conv_decode`'s argument checks, without its launch (once per metadata set,
    as ops.check_decode_args)."""
    act = _activation(activation)
    key = _checked_key(("conv_decode", act, num_v_heads), (x, conv_state, slot_ids, conv_weight, conv_bias, out),
                       (slot_ids,))
    if not _checks_due(key):
        return
    dim = x.shape[-1] if isinstance(x, torch.Tensor) else 0
    if not (isinstance(num_v_heads, int) and num_v_heads > 0 and dim % V.HEAD_DIM == 0
            and (dim // V.HEAD_DIM - num_v_heads) > 0 and (dim // V.HEAD_DIM - num_v_heads) % 2 == 0):
        raise ValueError(f"num_v_heads: expected a positive count that leaves x's {dim} channels "
                         f"two equal q/k parts of 128-channel heads, got {num_v_heads}")
    _check_conv(x, conv_state, conv_weight, conv_bias, dim)
    V.check_index("slot_ids", slot_ids, x.shape[0], conv_state.shape[0], "conv_state's slot count",
                  unique_live=True)
    V.check_device(x.device, slot_ids=slot_ids)
    if out is not None:
        _check_conv_out(out, x)
    _passed(key)


def causal_conv_spec(x, conv_state, slot_ids, num_accepted, cu_seqlens, *, conv_weight, conv_bias=None,
                     activation="silu", num_v_heads: int, draft: int, out=None, _trusted=False):
    """A speculative step's conv over vLLM's sliding-window conv state (hopper/conv.py).

    Args:
        x: [Ts, dim], sequences packed by cu_seqlens [N+1] (lengths <= draft; rows past
            cu_seqlens[N] are padding: not read, and not written in ``out``).
        conv_state: [S, dim, L], L >= W - 2 + draft; slot_ids: [N] (< 0: padding);
        num_accepted: [N] int: the window before the step starts at column num_accepted - 1.
        draft: D, the most tokens a sequence has this step (vLLM: 1 + num_speculative_tokens).
    Returns:
        y [Ts, dim] in x's dtype (rows of padding sequences zero; rows past cu_seqlens[N] as
        ``out`` held them, uninitialised when allocated here).
        _trusted: internal (backends/gdn_layer): checked by :func:`check_conv_spec_args` in
            this layer call or a matching one of the step.
    """
    if not _trusted:
        check_conv_spec_args(x, conv_state, slot_ids, num_accepted, cu_seqlens, conv_weight=conv_weight,
                             conv_bias=conv_bias, activation=activation, num_v_heads=num_v_heads, draft=draft,
                             out=out)
    act = _activation(activation)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _run("conv_spec", x.device, x.dtype, x, conv_state, conv_weight, conv_bias, V.int32_index(slot_ids, x.device),
         _int32(num_accepted, x.device), _int32(cu_seqlens, x.device), num_v_heads=num_v_heads, draft=draft,
         activation=act, out=out)
    return out


def check_conv_spec_args(x, conv_state, slot_ids, num_accepted, cu_seqlens, *, conv_weight, conv_bias=None,
                         activation="silu", num_v_heads: int, draft: int, out=None) -> None:
    """:func:`causal_conv_spec`'s argument checks, without its launch (once per metadata set)."""
    act = _activation(activation)
    key = _checked_key(("conv_spec", act, num_v_heads, draft),
                       (x, conv_state, slot_ids, num_accepted, cu_seqlens, conv_weight, conv_bias, out),
                       (slot_ids, num_accepted, cu_seqlens))
    if _checks_due(key):
        _check_draft(draft)
        _check_conv(x, conv_state, conv_weight, conv_bias, x.shape[-1], extra_cols=draft - 1)
        N = slot_ids.shape[0]
        V.check_index("slot_ids", slot_ids, N, conv_state.shape[0], "conv_state's slot count", unique_live=True)
        V.check_dtype("num_accepted", num_accepted, (torch.int32, torch.int64))
        V.check_shape("num_accepted", num_accepted, (N,))
        V.check_dtype("cu_seqlens", cu_seqlens, (torch.int32, torch.int64))
        V.check_shape("cu_seqlens", cu_seqlens, (N + 1,))
        V.check_device(x.device, slot_ids=slot_ids, num_accepted=num_accepted, cu_seqlens=cu_seqlens)
        if out is not None:
            _check_conv_out(out, x)
        _passed(key)


def causal_conv_verify(x, conv_state, slot_ids, windows, window_ids, *, conv_weight, conv_bias=None,
                       activation="silu", num_v_heads: int, draft: int, out=None):
    """SGLang's target-verify conv (hopper/conv.py's conv_verify): D draft tokens per sequence
    over the slot's W - 1 column window, each token's window kept for SGLang's commit.

    Args:
        x: [N * D, dim] (rows past N * D: not read, and not written in ``out``);
        conv_state: [S, dim, W - 1] (SGLang's layout; written: the window after the D tokens);
        slot_ids: [N] int32 (< 0: padding, zero outputs, nothing read or written);
        windows: [Si, D, dim, W - 1] in conv_state's dtype, SGLang's ``intermediate_conv_window``;
            windows[window_ids[s], j] gets the window after sequence s's token j;
        window_ids: [N] int (< 0: no windows for that sequence).
        draft: D, SGLang's draft_token_num.
    Returns:
        y [N * D, dim] in x's dtype (rows of padding sequences zero).
    Arguments are checked once per metadata set (:func:`check_conv_verify_args`), from host
    metadata only.
    """
    check_conv_verify_args(x, conv_state, slot_ids, windows, window_ids, conv_weight=conv_weight,
                           conv_bias=conv_bias, activation=activation, num_v_heads=num_v_heads,
                           draft=draft, out=out)
    act = _activation(activation)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _run("conv_verify", x.device, x.dtype, x, conv_state, conv_weight, conv_bias, V.int32_index(slot_ids, x.device),
         windows, _int32(window_ids, x.device), num_v_heads=num_v_heads, draft=draft, activation=act, out=out)
    return out


def check_conv_verify_args(x, conv_state, slot_ids, windows, window_ids, *, conv_weight, conv_bias=None,
                           activation="silu", num_v_heads: int, draft: int, out=None) -> None:
    """:func:`causal_conv_verify`'s argument checks, without its launch (once per metadata set)."""
    act = _activation(activation)
    key = _checked_key(("conv_verify", act, num_v_heads, draft),
                       (x, conv_state, slot_ids, windows, window_ids, conv_weight, conv_bias, out),
                       (slot_ids, window_ids))
    if _checks_due(key):
        _check_draft(draft)
        W = _check_conv(x, conv_state, conv_weight, conv_bias, x.shape[-1])
        if conv_state.shape[2] != W - 1:
            raise ValueError(f"conv_state: expected SGLang's [S, dim, {W - 1}] (width - 1 columns), "
                             f"got {list(conv_state.shape)}")
        N = slot_ids.shape[0]
        if x.shape[0] < N * draft:
            raise ValueError(f"mixed_qkv: expected at least {N} x {draft} draft rows, got {x.shape[0]}")
        V.check_index("slot_ids", slot_ids, N, conv_state.shape[0], "conv_state's slot count", unique_live=True)
        V.check_dtype("windows", windows, (conv_state.dtype,))
        V.check_shape("windows", windows, (None, draft, x.shape[-1], W - 1))
        V.check_index("window_ids", window_ids, N, windows.shape[0], "windows' slot count", unique_live=False)
        V.check_device(x.device, slot_ids=slot_ids, windows=windows, window_ids=window_ids)
        if out is not None:
            _check_conv_out(out, x)
        _passed(key)


def gdn_verify_slots(q, k, v, pool, spec_slot_ids, num_accepted, cu_seqlens, *, a, b, A_log, dt_bias,
                     use_qk_l2norm=True, scale=None, out=None, _trusted=False, _after_conv=False):
    """Speculative verify into per-token slots (vLLM's layout), no scratch and no commit.

    Sequence i starts from ``pool[spec_slot_ids[i, num_accepted[i] - 1]]``; the state after its
    token j is written to ``pool[spec_slot_ids[i, j]]``. A row whose first id, or whose source
    id, is < 0 is padding (zero outputs, nothing written); other ids < 0 are not written.

    Args:
        q, k: [T, Hk, 128]; v: [T, Hv, 128], packed by cu_seqlens [N+1] (lengths <= D; rows
            past cu_seqlens[N] are not read and not written in ``out``).
        pool: [S, Hv, 128, 128] fp32/bf16; spec_slot_ids: [N, D] int32 (unit column stride);
        num_accepted: [N] int32 in 1..D for live rows.
        a, b: [T, Hv] raw gate logits; A_log, dt_bias: [Hv] (fused gating, as gdn_decode).
        _trusted: internal (backends/gdn_layer), as :func:`causal_conv_spec`'s.
        _after_conv: internal (backends/gdn_layer): q/k/v come from the :func:`causal_conv_spec`
            launch right before this one on the same stream: the kernel runs as its programmatic
            dependent (kernels/hopper/decode.verify_slots' after_conv).
    Returns:
        o [T, Hv, 128] in q's dtype.
    """
    if not _trusted:
        check_verify_slots_args(q, k, v, pool, spec_slot_ids, num_accepted, cu_seqlens, a=a, b=b, A_log=A_log,
                                dt_bias=dt_bias, use_qk_l2norm=use_qk_l2norm, scale=scale, out=out)
    l2 = V.check_flag("use_qk_l2norm", use_qk_l2norm)
    s = _scale(scale)
    a, b = _same_dtype(a, b)
    if out is None:
        out = torch.empty((q.shape[0], v.shape[1], V.HEAD_DIM), dtype=q.dtype, device=q.device)
    _run("verify_slots", q.device, q.dtype, q, k, v, pool, spec_slot_ids, num_accepted, cu_seqlens,
         a=a, b=b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=l2, scale=s, out=out,
         after_conv=bool(_after_conv))
    return out


def check_verify_slots_args(q, k, v, pool, spec_slot_ids, num_accepted, cu_seqlens, *, a, b, A_log, dt_bias,
                            use_qk_l2norm=True, scale=None, out=None) -> None:
    """:func:`gdn_verify_slots`' argument checks, without its launch (once per metadata set)."""
    key = _checked_key("verify_slots", (q, k, v, pool, spec_slot_ids, num_accepted, cu_seqlens, a, b,
                                        A_log, dt_bias, out), (spec_slot_ids, num_accepted, cu_seqlens))
    if _checks_due(key):
        T, Hk, Hv = V.check_qkv(q, k, v)
        V.check_gates(T, Hv, None, None, a, b, A_log, dt_bias, allow_raw=True)
        V.check_pool(pool, Hv)
        V.check_dtype("spec_slot_ids", spec_slot_ids, (torch.int32,))
        if spec_slot_ids.dim() != 2 or (spec_slot_ids.numel() and spec_slot_ids.stride(1) != 1):
            raise ValueError(f"spec_slot_ids: expected [N, D] int32 with unit column stride, got shape "
                             f"{list(spec_slot_ids.shape)} strides {tuple(spec_slot_ids.stride())}")
        N = spec_slot_ids.shape[0]
        V.check_dtype("num_accepted", num_accepted, (torch.int32,))
        V.check_shape("num_accepted", num_accepted, (N,))
        V.check_dtype("cu_seqlens", cu_seqlens, (torch.int32,))
        V.check_shape("cu_seqlens", cu_seqlens, (N + 1,))
        if spec_slot_ids.device.type == "cpu" and spec_slot_ids.numel():
            ids = spec_slot_ids[spec_slot_ids >= 0]
            if ids.numel() and int(ids.max()) >= pool.shape[0]:
                raise ValueError(f"spec_slot_ids: expected ids < the pool's {pool.shape[0]} slots, "
                                 f"got {int(ids.max())}")
            if ids.numel() != ids.unique().numel():
                raise ValueError("spec_slot_ids: expected each live slot id once")
        V.check_device(q.device, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, pool=pool,
                       spec_slot_ids=spec_slot_ids, num_accepted=num_accepted, cu_seqlens=cu_seqlens)
        if out is not None:
            V.output(out, (T, Hv, V.HEAD_DIM), q.dtype, q.device)
        _passed(key)
    V.check_flag("use_qk_l2norm", use_qk_l2norm)
    _scale(scale)
