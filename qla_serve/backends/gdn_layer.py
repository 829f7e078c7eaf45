"""The engine-agnostic GDN layer core: causal conv1d, gating, and qla_serve's GDN ops run on an
engine's own state caches, in place. No engine import here: adapters (vLLM, SGLang) turn their
metadata into a :class:`StepPlan` once per step and call :func:`gdn_layer_forward` per layer.

What one call does (the work behind vLLM's ``qwen_gdn_attention_core``), for a batch laid out as
``[decode tokens | prefill tokens]`` or, with speculative decoding, with spec tokens at
``spec_token_idx`` and the rest at ``non_spec_token_idx``:

1. causal conv1d over ``mixed_qkv`` [T, 2*Hk*128 + Hv*128] with the per-slot conv state
   (read and written in place); SiLU.
2. split into q, k [.., Hk, 128] and v [.., Hv, 128].
3. decodes: :func:`qla_serve.gdn_decode` with the raw gating (a, b, A_log, dt_bias) and the
   in-kernel L2 norm; prefills: L2 norm and gating by :func:`qla_serve.gdn_prefill_inputs` (one
   launch), then :func:`qla_serve.gdn_prefill` with the step's shared
   :class:`qla_serve.PrefillPlan`; spec decodes: :func:`qla_serve.gdn_verify`.
4. outputs written into ``out`` [T, Hv, 128].

State caches (engine-owned, never copied as a whole):

* ``ssm_state`` [S, Hv, 128(V), 128(K)], fp32 or bf16; ``stride(0)`` may exceed one slot (pages).
* ``conv_state`` [S, dim, state_len] (a transposed view is fine), ``state_len >= width - 1``.
  Non-spec steps use its first ``width - 1`` columns; spec steps use it as vLLM's sliding window:
  the state before the step starts at column ``num_accepted - 1``, and after the step columns
  ``[0, width - 2 + len)`` hold the last ``width - 2`` inputs before the step and the step's
  tokens, so that the next step resumes from the last accepted token.

Slot ids equal to ``null_slot`` (vLLM's null block 0) are padding: their SSM state is never
read or written (they go to the ops as -1). Conv-state updates and the spec-state scatter write
padding rows' garbage *into* the null slot instead of branching on device values, as vLLM's own
prefill path does: nothing reads that slot as a live state, and no host sync is needed.

Speculative decoding follows vLLM's layout: ``spec_slots`` [Ns, D] holds one slot per draft
position; the initial state is ``ssm_state[spec_slots[i, num_accepted[i] - 1]]`` and the state
after token j goes to ``ssm_state[spec_slots[i, j]]``. :func:`qla_serve.gdn_verify` writes the
per-token states into a scratch [Ns, D, Hv, 128, 128], scattered into those slots afterwards
(one extra write of D states per sequence; a kernel taking 2-D slot ids would remove it).

Host syncs: none in decode and spec paths (all indices stay on the device; shapes come from the
plan). Prefill uses index tensors built on the host from CPU lengths in :func:`make_step_plan`
and uploaded once per step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn.functional as F

import qla_serve
from qla_serve.plan import PrefillPlan

HEAD_DIM = 128


@dataclasses.dataclass(eq=False)
class PrefillConvIndex:
    """Host-built row indices for the vectorised varlen causal conv of one step's prefills.

    The prefill tokens of sequence i are laid out in a scratch buffer after ``width - 1`` rows of
    that sequence's conv history: region i starts at ``start_i + i * (width - 1)``.

        x_rows      [Tp]              where each prefill token goes in the scratch buffer
        hist_rows   [Np * (width-1)]  where each sequence's history rows go
        win_rows    [width, Tp]       win_rows[j, t]: scratch row of tap j of token t's window
        final_rows  [Np, width-1]     the last width-1 rows of each region (the new conv state)
    """

    width: int
    num_rows: int
    x_rows: torch.Tensor
    hist_rows: torch.Tensor
    win_rows: torch.Tensor
    final_rows: torch.Tensor


@dataclasses.dataclass(eq=False)
class StepPlan:
    """What every GDN layer of one engine step shares. Built once per step (host code).

    Token layout of the step's batch (``num_actual_tokens`` rows of the layer inputs):
      without spec decodes: [num_decode_tokens decode tokens | num_prefill_tokens prefill tokens];
      with spec decodes: spec tokens at ``spec_token_idx`` ([Ts] device int), the others at
      ``non_spec_token_idx`` ([Td + Tp], decodes then prefills); both None when the batch is
      spec tokens only.

    Device tensors (engine ids, ``null_slot`` = padding):
      decode_slots [num_decodes]; prefill_slots [Np]; prefill_has_initial_state [Np] bool;
      spec_slots [Ns, D]; spec_cu_seqlens [Ns+1] int32; num_accepted [Ns].
    """

    num_actual_tokens: int
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None
    prefill_plan: PrefillPlan | None = None
    prefill_slots: torch.Tensor | None = None
    prefill_has_initial_state: torch.Tensor | None = None
    prefill_conv: PrefillConvIndex | None = None
    num_spec_decodes: int = 0
    num_spec_tokens: int = 0
    spec_slots: torch.Tensor | None = None
    spec_cu_seqlens: torch.Tensor | None = None
    num_accepted: torch.Tensor | None = None
    spec_token_idx: torch.Tensor | None = None
    non_spec_token_idx: torch.Tensor | None = None
    null_slot: int = 0
    info: dict = dataclasses.field(default_factory=dict)   # adapter notes (logs, counters)

    @property
    def num_prefills(self) -> int:
        return 0 if self.prefill_plan is None else self.prefill_plan.num_seqs

    @property
    def num_prefill_tokens(self) -> int:
        return 0 if self.prefill_plan is None else self.prefill_plan.total_tokens

    def kinds(self) -> dict:
        """Counts for logs and tests: decodes, prefills, resumed prefills (host-known only)."""
        return {"decode": self.num_decodes, "prefill": self.num_prefills, "spec": self.num_spec_decodes}


def prefill_conv_index(seq_lens: Sequence[int], width: int, device) -> PrefillConvIndex:
    """Host-side index tensors for :func:`_prefill_conv` (one upload per step)."""
    h = width - 1
    x_rows, hist_rows, win_rows, final_rows = [], [], [], []
    start = 0
    for i, n in enumerate(seq_lens):
        base = start + i * h                       # region i: h history rows, then n tokens
        hist_rows.extend(range(base, base + h))
        rows = list(range(base + h, base + h + n))
        x_rows.extend(rows)
        for r in rows:
            win_rows.append([r - h + j for j in range(width)])
        final_rows.append(list(range(base + n, base + n + h)))
        start += n
    num_rows = start + len(seq_lens) * h
    win = torch.tensor(win_rows, dtype=torch.long).reshape(-1, width).t().contiguous()

    def up(x, shape=None):
        t = torch.tensor(x, dtype=torch.long)
        if shape is not None:
            t = t.reshape(shape)
        return t.to(device, non_blocking=True) if torch.device(device).type != "cpu" else t

    return PrefillConvIndex(
        width=width, num_rows=num_rows, x_rows=up(x_rows), hist_rows=up(hist_rows),
        win_rows=win.to(device, non_blocking=True) if torch.device(device).type != "cpu" else win,
        final_rows=up(final_rows, (len(seq_lens), h)),
    )


def make_step_plan(*, num_actual_tokens: int, num_v_heads: int, num_k_heads: int, conv_width: int,
                   device, decode_slots=None, prefill_lens: Sequence[int] = (), prefill_slots=None,
                   prefill_has_initial_state=None, spec_slots=None, spec_cu_seqlens=None,
                   num_accepted=None, num_spec_tokens: int = 0, spec_token_idx=None,
                   non_spec_token_idx=None, null_slot: int = 0, cp: str = "auto",
                   reuse: StepPlan | None = None) -> StepPlan:
    """Build the step's plan: the prefill plan and conv indices from CPU ``prefill_lens``.

    ``num_v_heads``/``num_k_heads`` are the TP-local GDN heads. Every tensor argument is the
    engine's device tensor as described in :class:`StepPlan`; ``prefill_lens`` are host ints, one
    per row of ``prefill_slots`` (0 for padding rows). ``reuse``: a previous step's plan with the
    same ``prefill_lens``, whose host-built prefill plan and conv indices are taken as they are.
    """
    device = torch.device(device)
    plan = conv = None
    if prefill_slots is not None and len(prefill_lens):
        if prefill_slots.shape[0] != len(prefill_lens):
            raise ValueError(f"prefill_lens: expected one length per prefill slot "
                             f"({prefill_slots.shape[0]}), got {len(prefill_lens)}")
        if reuse is not None and reuse.prefill_plan is not None \
                and reuse.prefill_plan.seq_lens == tuple(prefill_lens):
            plan, conv = reuse.prefill_plan, reuse.prefill_conv
        else:
            plan = qla_serve.plan_prefill(list(prefill_lens), num_v_heads, num_k_heads, device=device, cp=cp)
            conv = prefill_conv_index(prefill_lens, conv_width, device)
        # Rows of length 0 are padding (vLLM keeps trailing padded requests in the prefill
        # slice): never touch their slot, whatever their has_initial_state says.
        if any(n == 0 for n in prefill_lens):
            keep = torch.tensor([n > 0 for n in prefill_lens], dtype=torch.bool).to(device, non_blocking=True)
            prefill_slots = torch.where(keep, prefill_slots, torch.full_like(prefill_slots, null_slot))
    num_decodes = 0 if decode_slots is None else int(decode_slots.shape[0])
    num_spec = 0 if spec_slots is None else int(spec_slots.shape[0])
    return StepPlan(
        num_actual_tokens=num_actual_tokens, num_decodes=num_decodes, decode_slots=decode_slots,
        prefill_plan=plan, prefill_slots=prefill_slots if plan is not None else None,
        prefill_has_initial_state=prefill_has_initial_state if plan is not None else None,
        prefill_conv=conv, num_spec_decodes=num_spec, num_spec_tokens=num_spec_tokens,
        spec_slots=spec_slots, spec_cu_seqlens=spec_cu_seqlens, num_accepted=num_accepted,
        spec_token_idx=spec_token_idx, non_spec_token_idx=non_spec_token_idx, null_slot=null_slot)


# ---------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------

def _ops_slots(slots: torch.Tensor, null_slot: int) -> torch.Tensor:
    """Engine slot ids -> qla_serve ids (padding = -1), on the device, no sync."""
    return torch.where(slots == null_slot, torch.full_like(slots, -1), slots).to(torch.int32)


def _act(x: torch.Tensor, activation) -> torch.Tensor:
    if activation in ("silu", "swish", True):
        return F.silu(x)
    if activation in (None, False, "none", "identity"):
        return x
    raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")


def _split_qkv(x: torch.Tensor, num_k_heads: int, num_v_heads: int):
    """[T, 2*Hk*128 + Hv*128] -> strided views q, k [T, Hk, 128], v [T, Hv, 128]."""
    kd = num_k_heads * HEAD_DIM
    T = x.shape[0]
    q = x[:, :kd].reshape(T, num_k_heads, HEAD_DIM)
    k = x[:, kd:2 * kd].reshape(T, num_k_heads, HEAD_DIM)
    v = x[:, 2 * kd:].reshape(T, num_v_heads, HEAD_DIM)
    return q, k, v


def _decode_conv(x, conv_state, slots, weight, bias, activation):
    """One token per sequence. x [B, dim]; conv_state [S, dim, L]; weight [dim, W]."""
    W = weight.shape[1]
    hist = conv_state[slots.long(), :, : W - 1]                       # [B, dim, W-1]
    full = torch.cat([hist.to(torch.float32), x.float().unsqueeze(-1)], dim=-1)
    y = (full * weight.float().unsqueeze(0)).sum(-1)
    if bias is not None:
        y = y + bias.float()
    conv_state[slots.long(), :, : W - 1] = full[:, :, 1:].to(conv_state.dtype)
    return _act(y, activation).to(x.dtype)


def _prefill_conv(x, conv_state, slots, has_initial_state, idx: PrefillConvIndex, weight, bias,
                  activation):
    """Varlen causal conv over the step's prefills, history from/to the conv state in place.

    x [Tp, dim]; slots [Np] (engine ids); has_initial_state [Np] bool or None.
    """
    W = idx.width
    dim = x.shape[1]
    buf = torch.zeros(idx.num_rows, dim, dtype=torch.float32, device=x.device)
    buf[idx.x_rows] = x.float()
    hist = conv_state[slots.long(), :, : W - 1].to(torch.float32).transpose(1, 2)   # [Np, W-1, dim]
    if has_initial_state is not None:  # where, not a product: a recycled slot may hold inf/nan
        hist = torch.where(has_initial_state.view(-1, 1, 1), hist, torch.zeros_like(hist))
    buf[idx.hist_rows] = hist.reshape(-1, dim)
    w = weight.float()
    y = buf[idx.win_rows[0]] * w[:, 0]
    for j in range(1, W):
        y = y + buf[idx.win_rows[j]] * w[:, j]
    if bias is not None:
        y = y + bias.float()
    final = buf[idx.final_rows]                                       # [Np, W-1, dim]
    conv_state[slots.long(), :, : W - 1] = final.transpose(1, 2).to(conv_state.dtype)
    return _act(y, activation).to(x.dtype)


def _spec_positions(cu: torch.Tensor, num_tokens: int, D: int):
    """Per spec token: its sequence and position in it (device, no sync)."""
    t = torch.arange(num_tokens, device=cu.device, dtype=cu.dtype)
    seq = torch.searchsorted(cu[1:].contiguous(), t, right=True)
    return seq.long(), (t - cu[seq]).long()


def _spec_conv(x, conv_state, slot0, live, num_accepted, cu, D, weight, bias, activation):
    """vLLM's sliding-window conv for spec decodes. x [Ts, dim] packed by cu [Ns+1]."""
    W = weight.shape[1]
    Ns, dim = slot0.shape[0], x.shape[1]
    Ts = x.shape[0]
    state_len = conv_state.shape[2]
    if state_len < W - 2 + D:
        raise ValueError(f"conv_state: expected at least width-2+D={W - 2 + D} columns for spec "
                         f"decoding with D={D}, got {state_len}")
    old = conv_state[slot0.long()].to(torch.float32)                  # [Ns, dim, L]
    off = (num_accepted.long() - 1).clamp(min=0, max=state_len - (W - 1))
    cols = off.view(-1, 1, 1) + torch.arange(W - 1, device=x.device).view(1, 1, -1)
    hist = torch.gather(old, 2, cols.expand(Ns, dim, W - 1))          # [Ns, dim, W-1]
    seq, pos = _spec_positions(cu, Ts, D)
    xs = torch.zeros(Ns, D, dim, dtype=torch.float32, device=x.device)
    xs[seq, pos] = x.float()
    window = torch.cat([hist, xs.transpose(1, 2)], dim=-1)            # [Ns, dim, W-1+D]
    w = weight.float()
    y = window[seq, :, pos] * w[:, 0]                                 # [Ts, dim]
    for j in range(1, W):
        y = y + window[seq, :, pos + j] * w[:, j]
    if bias is not None:
        y = y + bias.float()
    # New window: the last W-2 history inputs, then this step's tokens; columns past
    # W-2+len keep their old values (vLLM's kernel leaves them alone too).
    lens = (cu[1:] - cu[:-1]).long()
    new = window[:, :, 1:]                                            # [Ns, dim, W-2+D]
    ncol = W - 2 + D
    keep_new = torch.arange(ncol, device=x.device).view(1, 1, -1) < (W - 2 + lens).view(-1, 1, 1)
    new = torch.where(keep_new & live.view(-1, 1, 1), new, old[:, :, :ncol])
    conv_state[slot0.long(), :, :ncol] = new.to(conv_state.dtype)
    return _act(y, activation).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------

def gdn_layer_forward(step: StepPlan, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                      conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, activation,
                      conv_state: torch.Tensor, ssm_state: torch.Tensor, A_log: torch.Tensor,
                      dt_bias: torch.Tensor, num_k_heads: int, out: torch.Tensor,
                      scale: float | None = None, on_call=None) -> None:
    """Run one GDN layer's core for the step, writing ``out[:num_actual_tokens]`` in full.

    Args:
        step: this step's :class:`StepPlan` (shared by every GDN layer).
        mixed_qkv: [>= T, 2*Hk*128 + Hv*128] projected q|k|v before the conv (rows past T: padding).
        a, b: [>= T, Hv] raw gating inputs (decay and write-strength logits).
        conv_weight: [dim, W]; conv_bias: [dim] or None; activation: "silu" or None.
        conv_state: [S, dim, state_len] view of the engine's conv cache (written in place).
        ssm_state: [S, Hv, 128, 128] fp32/bf16 view of the engine's state cache (written in place).
        A_log, dt_bias: [Hv]. num_k_heads: TP-local Hk.
        out: [>= T, Hv, 128] in mixed_qkv's dtype.
        on_call: optional callback(kind, count) for instrumentation ("decode", "prefill", "spec").
    """
    T = step.num_actual_tokens
    if T == 0:
        return
    Hv = ssm_state.shape[1]
    x, a, b = mixed_qkv[:T], a[:T], b[:T]
    null = step.null_slot
    Td = step.num_decodes
    Tp = step.num_prefill_tokens

    if step.num_spec_decodes:
        xs = x if step.spec_token_idx is None else x.index_select(0, step.spec_token_idx)
        as_ = a if step.spec_token_idx is None else a.index_select(0, step.spec_token_idx)
        bs = b if step.spec_token_idx is None else b.index_select(0, step.spec_token_idx)
        o_spec = _spec_forward(step, xs, as_, bs, conv_weight, conv_bias, activation, conv_state,
                               ssm_state, A_log, dt_bias, num_k_heads, scale)
        if step.spec_token_idx is None:
            out[: xs.shape[0]].copy_(o_spec)
        else:
            out.index_copy_(0, step.spec_token_idx.long(), o_spec)
        if on_call:
            on_call("spec", step.num_spec_decodes)
        if step.non_spec_token_idx is None or (Td + Tp) == 0:
            return
        xn = x.index_select(0, step.non_spec_token_idx)
        an = a.index_select(0, step.non_spec_token_idx)
        bn = b.index_select(0, step.non_spec_token_idx)
        out_n = torch.empty(Td + Tp, Hv, HEAD_DIM, dtype=out.dtype, device=out.device)
    else:
        xn, an, bn = x, a, b
        out_n = out

    if Td:
        xd = _decode_conv(xn[:Td], conv_state, step.decode_slots, conv_weight, conv_bias, activation)
        q, k, v = _split_qkv(xd, num_k_heads, Hv)
        qla_serve.gdn_decode(q, k, v, ssm_state, _ops_slots(step.decode_slots, null),
                             a=an[:Td], b=bn[:Td], A_log=A_log, dt_bias=dt_bias,
                             use_qk_l2norm=True, scale=scale, out=out_n[:Td])
        if on_call:
            on_call("decode", Td)
    if Tp:
        xp = _prefill_conv(xn[Td:Td + Tp], conv_state, step.prefill_slots,
                           step.prefill_has_initial_state, step.prefill_conv, conv_weight,
                           conv_bias, activation)
        q, k, v = _split_qkv(xp, num_k_heads, Hv)
        q, k, g, beta = qla_serve.gdn_prefill_inputs(q, k, an[Td:Td + Tp], bn[Td:Td + Tp], A_log, dt_bias,
                                                     qk_dtype=qla_serve.prefill_qk_dtype(q))
        qla_serve.gdn_prefill(q, k, v, g, beta, ssm_state, _ops_slots(step.prefill_slots, null),
                              step.prefill_plan, has_initial_state=step.prefill_has_initial_state,
                              scale=scale, out=out_n[Td:Td + Tp])
        if on_call:
            on_call("prefill", step.num_prefills)
    if out_n is not out:
        out.index_copy_(0, step.non_spec_token_idx.long(), out_n)


def _spec_forward(step: StepPlan, xs, a, b, conv_weight, conv_bias, activation, conv_state,
                  ssm_state, A_log, dt_bias, num_k_heads, scale):
    slots = step.spec_slots                                        # [Ns, D]
    Ns, D = slots.shape
    null = step.null_slot
    cu = step.spec_cu_seqlens[: Ns + 1]
    acc = step.num_accepted[:Ns]
    live = slots[:, 0] != null
    xc = _spec_conv(xs, conv_state, slots[:, 0], live, acc, cu, D, conv_weight, conv_bias, activation)
    Hv = ssm_state.shape[1]
    q, k, v = _split_qkv(xc, num_k_heads, Hv)
    src = slots.gather(1, (acc.long() - 1).clamp(0, D - 1).view(-1, 1)).view(-1)
    src = torch.where(live & (src != null), src, torch.full_like(src, -1)).to(torch.int32)
    ids = torch.where(live, torch.arange(Ns, device=slots.device, dtype=torch.int32),
                      torch.full((Ns,), -1, device=slots.device, dtype=torch.int32))
    # Zeroed: rows of padding sequences are scattered into the null slot; keep them finite.
    scratch = torch.zeros(Ns, D, Hv, HEAD_DIM, HEAD_DIM, dtype=ssm_state.dtype, device=ssm_state.device)
    o = qla_serve.gdn_verify(q, k, v, ssm_state, src, cu.to(torch.int32), scratch, ids, a=a, b=b,
                             A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True, scale=scale)
    # State after token j -> slots[i, j] for j < len_i on live rows; everything else lands in
    # the null slot (garbage there is harmless; see the module docstring).
    lens = (cu[1:] - cu[:-1]).long()
    valid = (torch.arange(D, device=slots.device).view(1, -1) < lens.view(-1, 1)) & (slots != null) \
        & live.view(-1, 1) & (src.view(-1, 1) >= 0)
    tgt = torch.where(valid, slots, torch.full_like(slots, null)).long().view(-1)
    ssm_state[tgt] = scratch.view(Ns * D, Hv, HEAD_DIM, HEAD_DIM)
    return o
