"""Public GDN ops: validate from host metadata, then dispatch to one implementation path.

Paths, picked per op and device (logged once per op and path):

* ``tilelang``  — qla_serve's TileLang kernels for the device's arch (kernels/hopper, sm_90a).
* ``fla``       — flash-linear-attention's Triton ops, on CUDA GPUs without qla_serve kernels.
  A compatibility path: it gathers the states out of the pool and scatters them back
  (FLA has no in-place pool indexing), which syncs the host once per call.
* ``reference`` — the torch reference (kernels/reference.py): CPU tensors, and float32 q/k/v
  (the TileLang kernels take bf16/fp16).

``QLA_SERVE_OP_PATH=tilelang|fla|reference`` forces a path; a forced path that cannot run
raises instead of falling back (paths.py). Validation never reads GPU memory (see _validate.py).
"""

from __future__ import annotations

import logging

import torch

from qla_serve import _validate as V
from qla_serve.kernels import reference
from qla_serve.launch_record import note_dispatch
# Path selection lives below ops and the planner (paths.py); its names stay importable from here.
from qla_serve.paths import (FLA_OPS, PATHS, _arch_of, _fla_error, device_arch, explain_path,  # noqa: F401
                             kernel_module, supported_prefill_strategies)
from qla_serve.plan import PrefillPlan

log = logging.getLogger("qla_serve")


# ---------------------------------------------------------------------------------------
# Path selection (paths.py decides; resolved once per op, device and dtype here)
# ---------------------------------------------------------------------------------------

_resolved: dict = {}


def _path(op: str, device: torch.device, io_dtype) -> str:
    """The path for this call, resolved once per (op, device, dtype, forced path) and logged
    then: the per-call cost is one dict lookup (decode's host time matters)."""
    key = (op, device, io_dtype, V.env("QLA_SERVE_OP_PATH"))
    path = _resolved.get(key)
    if path is None:
        path, why = explain_path(op, device, io_dtype)
        level = logging.WARNING if (path != "tilelang" and device.type == "cuda") else logging.INFO
        log.log(level, "qla_serve %s on %s runs the %s path (%s)", op, device, path, why)
        _resolved[key] = path
    return path


def path_module(path: str, device: torch.device, reference_module=reference):
    """The module that implements ``path`` on ``device``: the arch's TileLang kernels, FLA's
    fallback, or ``reference_module`` (kernels/reference.py; layer_ops passes reference_conv)."""
    if path == "tilelang":
        return kernel_module(device_arch(device))
    if path == "fla":
        from qla_serve.kernels import fla_fallback
        return fla_fallback
    return reference_module


def _run(op: str, device: torch.device, io_dtype, *args, **kwargs) -> str:
    """Call ``op`` of the module that implements this call's path; returns the path."""
    path = _path(op, device, io_dtype)
    note_dispatch(op, path)
    getattr(path_module(path, device), op)(*args, **kwargs)
    return path


# ---------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------

def _scale(scale) -> float:
    return V.check_scale(scale)


def gdn_prefill(q, k, v, g, beta, pool, slot_ids, plan, *, has_initial_state=None,
                scale=None, out=None, checkpoints=None, _trusted=False):
    """Chunked GDN prefill over a packed varlen batch; states read and written in ``pool``.

    Args:
        q, k: [T, Hk, 128] bf16/fp16 (fp32 takes the reference path), L2-normalised.
        v: [T, Hv, 128], q's dtype, or bf16 beside fp16 q/k (gdn_prefill_inputs with
            qk_dtype=torch.float16: the Hopper kernels then skip their fp16 copy of q/k);
            Hv % Hk == 0.
        g, beta: [T, Hv] float32 (log decay <= 0; write strength in (0, 1)).
        pool: [S, Hv, 128(V), 128(K)] fp32/bf16 state slots (stride(0) may exceed a slot).
        slot_ids: [N] int32/int64, one slot per sequence; < 0 is padding (not read or written).
        plan: from :func:`qla_serve.plan_prefill` for these sequence lengths and heads.
        has_initial_state: [N] bool or None (all True); False starts from zero, slot unread.
        scale: defaults to 128 ** -0.5.
        out: optional [T, Hv, 128] output buffer of v's dtype.
        checkpoints: None, or (chunks, slots), two [N] int32/int64 tensors on q's device: the
            state after min(64 * chunks[s], len_s) tokens of sequence s is also written to pool
            slot slots[s] (pool dtype), for 1 <= chunks[s] <= ceil(len_s / 64); chunks[s] = 0,
            larger values, or slots[s] < 0 write nothing (vLLM's align-mode prefix-caching
            checkpoints: docs/vllm_checkpoints.md). Slots are checked like slot_ids (values only
            where they are on the CPU). The reference path and the TileLang kernels write them (under
            context parallelism's gate warmup, the state its outputs use); the FLA path refuses
            them by name.
        _trusted: internal (backends/gdn_layer): arguments whose metadata matches a call of
            this step that passed the checks (the layer's own key), so they are not re-checked.
    Returns:
        o [T, Hv, 128] in v's dtype; every live slot holds its sequence's final state. A padding
        sequence's rows are zeros (as in decode/verify) on the reference and FLA paths; on the
        TileLang path they hold that sequence's outputs from a zero state (_zero_padding_rows).
    """
    if not _trusted:
        check_prefill_args(q, k, v, g, beta, pool, slot_ids, plan, has_initial_state=has_initial_state,
                           scale=scale, out=out, checkpoints=checkpoints)
    extra = {}
    if checkpoints is not None:
        extra["checkpoints"] = _checkpoint_ids(checkpoints, plan.num_seqs, pool.shape[0], q.device)
    if out is None:
        out = torch.empty((q.shape[0], v.shape[1], V.HEAD_DIM), dtype=v.dtype, device=q.device)
    ids = V.int32_index(slot_ids, q.device)
    path = _run("prefill", q.device, v.dtype, q, k, v, g, beta, pool, ids, plan,
                has_initial_state=has_initial_state, scale=_scale(scale), out=out, **extra)
    _zero_padding_rows(out, slot_ids, plan, path)
    return out


def check_prefill_args(q, k, v, g, beta, pool, slot_ids, plan, *, has_initial_state=None, scale=None, out=None,
                       checkpoints=None) -> None:
    """:func:`gdn_prefill`'s argument checks, without its launch: from host metadata (values
    only where they are on the CPU), once per plan and metadata set (kept in the plan).
    backends/gdn_layer runs every op's checks of a layer call before its first launch, so a
    refused argument leaves every state slot as it was."""
    args = (q, k, v, g, beta, pool, slot_ids, has_initial_state, out)
    seen = None
    if isinstance(getattr(plan, "kernel_cache", None), dict):  # (no cache: checked on every call)
        seen = _checked_key("ops.gdn_prefill checked", args, (slot_ids,))
    if seen is None or seen not in plan.kernel_cache:
        _check_prefill(plan, *args)
        if seen is not None:
            plan.kernel_cache[seen] = True
    _scale(scale)
    if checkpoints is not None:
        _checkpoint_ids(checkpoints, plan.num_seqs, pool.shape[0], q.device)


def _checkpoint_ids(checkpoints, n: int, num_slots: int, device) -> tuple:
    """gdn_prefill's (chunks, slots): [n] integer index tensors on ``device`` -> int32; slots
    checked like slot_ids (values where they are on the CPU)."""
    if not (isinstance(checkpoints, (tuple, list)) and len(checkpoints) == 2
            and all(isinstance(x, torch.Tensor) for x in checkpoints)):
        raise TypeError("checkpoints: expected None or a pair of tensors (chunks, slots)")
    V.index_vector("checkpoints[0] (chunks)", checkpoints[0], n)
    V.check_index("checkpoints[1] (slots)", checkpoints[1], n, num_slots, "pool.shape[0], the pool's slot count",
                  unique_live=True)
    V.check_device(device, **{"checkpoints[0]": checkpoints[0], "checkpoints[1]": checkpoints[1]})
    return tuple(V.int32_index(x, device) for x in checkpoints)


def _zero_padding_rows(out, slot_ids, plan, path) -> None:
    """Zero the rows of padding sequences (slot < 0), as decode and verify write them, on the
    reference and FLA paths: from the slot ids' values on the CPU, else by a device mask (both
    paths sync per call anyway). Not on the TileLang path: its kernels compute a padding
    sequence's rows from a zero state, and the slot ids live on the GPU there, so zeroing them
    here would cost a masked launch over ``out`` on every call, padding or not (the kernels
    could skip those items instead, which would also save their time)."""
    if path not in ("reference", "fla") or not out.shape[0]:
        return
    if slot_ids.device.type == "cpu":
        pads = [i for i, s in enumerate(slot_ids.tolist()) if s < 0]
        if pads:
            cu = plan.cu_seqlens_cpu
            for i in pads:
                out[cu[i]:cu[i + 1]].zero_()
    else:
        lens = plan.scratch(("ops_seq_lens", out.device), lambda: plan.cu_seqlens.diff().long())
        pad = torch.repeat_interleave(slot_ids < 0, lens, output_size=out.shape[0])
        out.masked_fill_(pad[:, None, None], 0)


def _check_prefill(plan, q, k, v, g, beta, pool, slot_ids, has_initial_state, out) -> None:
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan: expected a PrefillPlan from qla_serve.plan_prefill, got {type(plan).__name__}")
    T, Hk, Hv = V.check_qkv(q, k, v, fp16_qk_ok=True)
    V.check_gates(T, Hv, g, beta, None, None, None, None, allow_raw=False, contiguous_gb=True)
    V.check_pool(pool, Hv)
    if (plan.num_v_heads, plan.num_k_heads) != (Hv, Hk):
        raise ValueError(f"plan: expected a plan for {Hk}/{Hv} qk/v heads, got "
                         f"{plan.num_k_heads}/{plan.num_v_heads}")
    if plan.total_tokens != T:
        raise ValueError(f"plan: expected a plan for {T} tokens (q.shape[0]), got {plan.total_tokens}")
    if plan.device != q.device:
        raise ValueError(f"plan: expected index tensors on {q.device}, got {plan.device}")
    N = plan.num_seqs
    V.check_index("slot_ids", slot_ids, N, pool.shape[0], "pool.shape[0], the pool's slot count",
                  unique_live=True)
    if has_initial_state is not None:
        V.index_vector("has_initial_state", has_initial_state, N, (torch.bool,))
    V.check_device(q.device, k=k, v=v, g=g, beta=beta, pool=pool, slot_ids=slot_ids,
                   has_initial_state=has_initial_state)
    if out is not None:  # (gdn_prefill allocates a missing one)
        V.output(out, (T, Hv, V.HEAD_DIM), v.dtype, q.device)


def _metadata(x):
    """What the checks read of a tensor: dtype, shape, strides, device, and its address modulo
    16 (the vector and TMA alignment checks: a view one element further along passes no other)."""
    return None if x is None else (x.dtype, x.shape, x.stride(), x.device, x.data_ptr() % 16)


def _checked_key(tag, tensors, index_tensors) -> tuple | None:
    """The key under which a public op records that arguments with this metadata passed its
    checks: every tensor's dtype, shape, strides, device and address modulo 16 (:func:`_metadata`),
    which is all the checks read, so an engine's other GDN layers of the step (same metadata,
    other tensors) skip them. gdn_prefill
    keeps its keys in the plan (~16 -> ~5 us on the CPU machine), gdn_decode / gdn_verify in
    _checked_steps (the engines' decode call, benchmarks/ops_host.py: 39 -> 31 us of host time
    on the H200's CPU). None, and the checks run on every call, where they also read values (an
    index tensor on the CPU, QLA_SERVE_DEBUG=1) or where an argument is not a tensor (the checks
    then say which)."""
    try:
        for x in index_tensors:
            if x.device.type == "cpu":
                return None
        if V.debug_checks():
            return None
        return (tag, *map(_metadata, tensors))
    except AttributeError:
        return None


def gdn_prefill_inputs(q, k, a=None, b=None, A_log=None, dt_bias=None, *, qk_dtype=None):
    """What :func:`gdn_prefill` takes, from what the engines' GDN layers have, in one launch on
    the TileLang path (kernels/hopper/prefill_inputs.py; torch's ~20 elementwise launches
    elsewhere).

    Args:
        q, k: [T, Hk, 128] bf16/fp16 (fp32 takes the reference path), not yet L2-normalised;
            strided views of a fused projection are fine.
        a, b: [T, Hv] raw gating logits; A_log, dt_bias: [Hv] (each in its own dtype). All four
            None: q and k only (a caller that has g and beta).
        qk_dtype: the normalised q/k's dtype: None (q's), or torch.float16 for bf16 q
            (:func:`prefill_qk_dtype` says which to ask for). fp16 from a bf16 q is what
            gdn_prefill reads on Hopper without converting q/k itself (its stage 1 then writes
            no fp16 copies: benchmarks/prefill.md "v24"); unit-norm rows lose nothing to fp16's
            range, and its rounding is 8x finer than bf16's.
    Returns:
        (q, k, g, beta): q, k L2-normalised, [T, Hk, 128] in qk_dtype, contiguous (x / sqrt(
        sum x^2 + 1e-6), fp32 math); g = -exp(A_log) * softplus(a + dt_bias) and
        beta = sigmoid(b), [T, Hv] float32 (None without the raw gates).
    """
    gates = any(x is not None for x in (a, b, A_log, dt_bias))
    if qk_dtype is not None and not isinstance(qk_dtype, torch.dtype):
        raise TypeError(f"qk_dtype: expected None or a torch.dtype, got {type(qk_dtype).__name__}")
    key = _checked_key(("inputs", qk_dtype), (q, k, a, b, A_log, dt_bias), ())
    if _checks_due(key):
        T, Hk = V.check_qk(q, k)
        V.check_qk_dtype(qk_dtype, q)
        V.check_device(q.device, k=k)
        if gates:
            Hv = a.shape[-1] if isinstance(a, torch.Tensor) and a.dim() == 2 else -1
            V.check_gates(T, Hv, None, None, a, b, A_log, dt_bias, allow_raw=True)
            if Hv == 0:
                raise ValueError(f"a: expected at least one value head, got shape {list(a.shape)}")
            if Hv % Hk:
                raise ValueError(f"a: expected a value-head count that is a multiple of q's {Hk} heads, got {Hv}")
            V.check_device(q.device, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
        _passed(key)
    T, Hk = q.shape[0], q.shape[1]
    q_out = torch.empty((T, Hk, V.HEAD_DIM), dtype=qk_dtype or q.dtype, device=q.device)
    k_out = torch.empty_like(q_out)
    g_out = beta_out = None
    if gates:
        a, b = _same_dtype(a, b)
        g_out = torch.empty((T, a.shape[1]), dtype=torch.float32, device=q.device)
        beta_out = torch.empty_like(g_out)
    _run("prefill_inputs", q.device, q.dtype, q, k, a, b, A_log, dt_bias, q_out=q_out, k_out=k_out,
         g_out=g_out, beta_out=beta_out)
    return q_out, k_out, g_out, beta_out


def prefill_qk_dtype(q):
    """The q/k dtype a layer should ask :func:`gdn_prefill_inputs` for ahead of
    :func:`gdn_prefill`: torch.float16 for bf16 q where prefill runs the TileLang kernels, which
    read fp16 q/k as they are (their stage 1 then writes no fp16 copies; unit-norm rows lose
    nothing to fp16's range); None (q's own dtype) elsewhere: the reference gains nothing, and
    FLA's fallback takes one dtype and would convert back. Resolved with the op's path (cached)."""
    if q.dtype != V.BF16_MODEL:
        return None
    return V.FP16_QK if _path("prefill", q.device, q.dtype) == "tilelang" else None


def _same_dtype(x, y):
    """The kernels take a and b in one dtype (A_log and dt_bias each in its own: SGLang keeps
    A_log in fp32 beside a bf16 dt_bias). Upcast a mixed a/b pair to fp32: exact, [T, Hv]."""
    if x is not None and y is not None and x.dtype != y.dtype:
        return x.float(), y.float()
    return x, y


def _check_step_inputs(q, k, v, pool, g, beta, a, b, A_log, dt_bias):
    T, Hk, Hv = V.check_qkv(q, k, v)
    V.check_gates(T, Hv, g, beta, a, b, A_log, dt_bias, allow_raw=True)
    V.check_pool(pool, Hv)
    V.check_device(q.device, k=k, v=v, g=g, beta=beta, a=a, b=b, A_log=A_log,
                   dt_bias=dt_bias, pool=pool)
    return T, Hk, Hv


# Metadata keys (_checked_key) of decode / verify argument sets that passed their checks: an
# engine calls these once per GDN layer per step with the same metadata, so every layer but the
# first skips the checks. Bounded: cleared when full (batch sizes vary from step to step).
_checked_steps: dict = {}
_CHECKED_STEPS_MAX = 4096


def _checks_due(key) -> bool:
    return key is None or key not in _checked_steps


def _passed(key) -> None:
    if key is not None:
        if len(_checked_steps) >= _CHECKED_STEPS_MAX:
            _checked_steps.clear()
        _checked_steps[key] = True


_SLOTS = "pool.shape[0], the pool's slot count"
_INTER_SLOTS = "intermediate.shape[0], its slot count"


def gdn_decode(q, k, v, pool, slot_ids, *, g=None, beta=None, a=None, b=None, A_log=None,
               dt_bias=None, use_qk_l2norm=False, scale=None, out=None, _after_conv=False, _trusted=False):
    """One token per sequence, states updated in place. CUDA-graph capturable (pass ``out``).

    Args:
        q, k: [B, Hk, 128]; v: [B, Hv, 128] (strided views of a fused projection are fine).
        pool: [S, Hv, 128, 128] fp32/bf16; slot_ids: [B] (< 0: zero output, nothing touched).
        g, beta: [B, Hv] float32 — or raw a, b: [B, Hv] with A_log, dt_bias: [Hv]
            (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), fused in the kernel).
        use_qk_l2norm: L2-normalise q and k in the kernel.
        _after_conv: internal (backends/gdn_layer): q/k/v come from the layer_ops.causal_conv_decode
            launch just before on this stream; the kernel overlaps its state loads with it
            (kernels/hopper/decode.decode's after_conv).
        _trusted: internal (backends/gdn_layer): metadata already checked this step (as
            gdn_prefill's).
    Returns:
        o [B, Hv, 128] in q's dtype.
    """
    if not _trusted:
        check_decode_args(q, k, v, pool, slot_ids, g=g, beta=beta, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                          use_qk_l2norm=use_qk_l2norm, scale=scale, out=out)
    l2 = V.check_flag("use_qk_l2norm", use_qk_l2norm)
    s = _scale(scale)
    a, b = _same_dtype(a, b)
    if out is None:
        out = torch.empty((q.shape[0], v.shape[1], V.HEAD_DIM), dtype=q.dtype, device=q.device)
    _run("decode", q.device, q.dtype, q, k, v, pool, V.int32_index(slot_ids, q.device), g=g, beta=beta, a=a,
         b=b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=l2, scale=s, out=out, after_conv=bool(_after_conv))
    return out


def check_decode_args(q, k, v, pool, slot_ids, *, g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None,
                      use_qk_l2norm=False, scale=None, out=None) -> None:
    """:func:`gdn_decode`'s argument checks, without its launch (as :func:`check_prefill_args`;
    once per metadata set: _checked_steps)."""
    key = _checked_key("decode", (q, k, v, pool, slot_ids, g, beta, a, b, A_log, dt_bias, out), (slot_ids,))
    if _checks_due(key):
        B, Hk, Hv = _check_step_inputs(q, k, v, pool, g, beta, a, b, A_log, dt_bias)
        V.check_index("slot_ids", slot_ids, B, pool.shape[0], _SLOTS, unique_live=True)
        V.check_device(q.device, slot_ids=slot_ids)
        if out is not None:
            V.output(out, (B, v.shape[1], V.HEAD_DIM), q.dtype, q.device)
        _passed(key)
    V.check_flag("use_qk_l2norm", use_qk_l2norm)
    _scale(scale)


def gdn_verify(q, k, v, pool, slot_ids, cu_seqlens, intermediate, intermediate_ids, *,
               g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None,
               use_qk_l2norm=False, scale=None, out=None, _after_conv=False):
    """Speculative verify: several draft tokens per sequence, the main slot left untouched.

    Args:
        q, k: [T, Hk, 128]; v: [T, Hv, 128] packed over N sequences by ``cu_seqlens`` [N+1].
        pool: [S, Hv, 128, 128]; slot_ids: [N] (read only; < 0: zero state, nothing written).
        intermediate: [S', D, Hv, 128, 128] in the pool's dtype; the state after token j of
            sequence i is written to ``intermediate[intermediate_ids[i], j]`` (j < D).
        intermediate_ids: [N]; < 0 is padding.
        Gating as in :func:`gdn_decode`.
        _after_conv: internal (backends/sglang/verify_layer): q/k/v come from the
            layer_ops.causal_conv_verify launch just before on this stream (as gdn_decode's).
    Returns:
        o [T, Hv, 128]. Commit the accepted step with :func:`commit_verified`.
    """
    key = _checked_key("verify", (q, k, v, pool, slot_ids, g, beta, a, b, A_log, dt_bias, out, cu_seqlens,
                                  intermediate, intermediate_ids), (slot_ids, cu_seqlens, intermediate_ids))
    if _checks_due(key):
        _check_verify(q, k, v, pool, slot_ids, cu_seqlens, intermediate, intermediate_ids,
                      g, beta, a, b, A_log, dt_bias, out)
        _passed(key)
    l2 = V.check_flag("use_qk_l2norm", use_qk_l2norm)
    s = _scale(scale)
    a, b = _same_dtype(a, b)
    if out is None:
        out = torch.empty((q.shape[0], v.shape[1], V.HEAD_DIM), dtype=q.dtype, device=q.device)
    dev = q.device
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    _run("verify", dev, q.dtype, q, k, v, pool, V.int32_index(slot_ids, dev), cu,
         intermediate, V.int32_index(intermediate_ids, dev), g=g, beta=beta, a=a, b=b, A_log=A_log,
         dt_bias=dt_bias, use_qk_l2norm=l2, scale=s, out=out, after_conv=bool(_after_conv))
    return out


def _check_verify(q, k, v, pool, slot_ids, cu_seqlens, intermediate, intermediate_ids,
                  g, beta, a, b, A_log, dt_bias, out) -> None:
    T, Hk, Hv = _check_step_inputs(q, k, v, pool, g, beta, a, b, A_log, dt_bias)
    V.check_intermediate(intermediate, pool)
    cu = V.check_cu_seqlens("cu_seqlens", cu_seqlens, T)
    N = cu_seqlens.shape[0] - 1
    if cu is not None and max((b - a for a, b in zip(cu, cu[1:])), default=0) > intermediate.shape[1]:
        raise ValueError(f"cu_seqlens: expected at most intermediate.shape[1]={intermediate.shape[1]} "
                         "tokens per sequence")
    V.check_index("slot_ids", slot_ids, N, pool.shape[0], _SLOTS, unique_live=True)
    V.check_index("intermediate_ids", intermediate_ids, N, intermediate.shape[0], _INTER_SLOTS,
                  unique_live=True)
    V.check_device(q.device, slot_ids=slot_ids, cu_seqlens=cu_seqlens, intermediate=intermediate,
                   intermediate_ids=intermediate_ids)
    if out is not None:
        V.output(out, (T, Hv, V.HEAD_DIM), q.dtype, q.device)


def commit_verified(pool, slot_ids, intermediate, intermediate_ids, num_accepted):
    """Copy the state after the last accepted token into each main slot, in place.

    ``num_accepted`` [N] ints in [0, D]: the state ``intermediate[intermediate_ids[i],
    num_accepted[i]-1]`` replaces ``pool[slot_ids[i]]``; 0 accepted tokens or a padding id
    leaves the slot as is. ``intermediate`` [S', D, Hv, 128, 128] must match the pool's dtype
    and head count. Values are checked where they are on the CPU (or QLA_SERVE_DEBUG=1), as in
    the other ops; argument metadata once per shape (the checks a step's later layers skip).
    """
    key = _checked_key("commit", (pool, slot_ids, intermediate, intermediate_ids, num_accepted),
                       (slot_ids, intermediate_ids, num_accepted))
    if _checks_due(key):
        _check_commit(pool, slot_ids, intermediate, intermediate_ids, num_accepted)
        _passed(key)
    dev = pool.device
    _run("commit_verified", dev, None, pool, V.int32_index(slot_ids, dev), intermediate,
         V.int32_index(intermediate_ids, dev), num_accepted)


def _check_commit(pool, slot_ids, intermediate, intermediate_ids, num_accepted) -> None:
    V.check_pool(pool, None)
    V.check_intermediate(intermediate, pool)
    N = V.index_vector("slot_ids", slot_ids)
    V.check_index("slot_ids", slot_ids, N, pool.shape[0], _SLOTS, unique_live=True)
    V.check_index("intermediate_ids", intermediate_ids, N, intermediate.shape[0], _INTER_SLOTS,
                  unique_live=True)
    V.check_index("num_accepted", num_accepted, N, intermediate.shape[1] + 1,
                  "accepted tokens, at most intermediate.shape[1], the draft depth", unique_live=False,
                  padding=False)
    V.check_device(pool.device, slot_ids=slot_ids, intermediate=intermediate,
                   intermediate_ids=intermediate_ids, num_accepted=num_accepted)
