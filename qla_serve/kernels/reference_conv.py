"""Torch reference of the GDN layer's conv ops, of verify into per-token slots and of the step's
slot ids (hopper/slot_ids.py).

The same functions, arguments and formulas as kernels/hopper/conv.py (its module docstring
gives the math) and hopper/decode.py's verify_slots; they run on CPU tensors (the CI and
tiny-model path) and on any CUDA GPU without qla_serve kernels. No per-token Python: every
index is computed with tensor ops. Writes to the state caches go through the live rows'
indices (``nonzero``), which syncs a GPU once per call: this is the reference path, not a
fast one. Slot ids < 0 are padding: never read, never written.
verify_slots loops over sequences and tokens on the host (the per-token recurrence).

Numerics match the kernels: the conv in fp32 from the stored inputs and history; prefill's
q/k normalised from the fp32 conv output (then stored in q_out's dtype); decode and spec
return the conv output in x's dtype (their recurrence kernels normalise q/k from it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qla_serve.kernels import reference

HEAD_DIM = 128


def _act(y: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


def _history(conv_state, slot_ids, use, H):
    """[N, dim, H] fp32: each row's first H conv-state columns where ``use``, else zeros
    (torch.where, not a product: a recycled slot may hold inf/nan)."""
    hist = conv_state[slot_ids.long().clamp(min=0), :, :H].float()
    return torch.where(use.view(-1, 1, 1), hist, torch.zeros_like(hist))


def _write_rows(conv_state, slot_ids, cols: int, values) -> None:
    """conv_state[slot_ids[i], :, :cols] = values[i] for live rows (slot >= 0) only."""
    live = (slot_ids >= 0).nonzero().view(-1)
    conv_state[slot_ids[live].long(), :, :cols] = values[live].to(conv_state.dtype)


def conv_varlen(x, conv_state, weight, bias, slot_ids, has_initial_state, cu_seqlens, *, activation):
    """The prefill conv: x [T, dim] packed by cu_seqlens [N+1] -> y [T, dim] fp32 (after the
    activation); each live slot's first W-1 columns get its sequence's last W-1 inputs."""
    T, W = x.shape[0], weight.shape[1]
    H = W - 1
    cu = cu_seqlens.long()
    hist = _history(conv_state, slot_ids, has_initial_state.bool() & (slot_ids >= 0), H)
    t = torch.arange(T, device=x.device)
    seq = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp(max=max(len(slot_ids) - 1, 0))
    pos = t - cu[seq]
    xf, w = x.float(), weight.float()
    y = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device) if bias is None \
        else bias.float().expand(T, -1).clone()
    for i in range(W):
        p = pos - H + i                                            # e_s[p] feeds tap i
        from_x = xf[(t - H + i).clamp(min=0)]
        from_h = hist[seq, :, (p + H).clamp(0, H - 1)]
        y += w[:, i] * torch.where((p >= 0).view(-1, 1), from_x, from_h)
    _write_rows(conv_state, slot_ids, H, _last_windows(xf, hist, cu, H))
    return _act(y, activation)


def _last_windows(xf, hist, cu, H):
    """[N, dim, H]: each sequence's last H inputs (from its history ``hist`` [N, dim, H] where
    the sequence is shorter)."""
    T = xf.shape[0]
    lens = cu[1:] - cu[:-1]
    cols = lens.view(-1, 1) - H + torch.arange(H, device=xf.device).view(1, -1)     # [N, H]
    from_x = xf[(cu[:-1].view(-1, 1) + cols).clamp(0, max(T - 1, 0))] if T else \
        torch.zeros(len(cu) - 1, H, xf.shape[1], device=xf.device)
    from_h = torch.gather(hist, 2, (cols + H).clamp(0, H - 1).unsqueeze(1).expand(-1, xf.shape[1], -1))
    return torch.where((cols >= 0).unsqueeze(1), from_x.transpose(1, 2), from_h)


def conv_window(x, conv_state, slot_ids, has_initial_state, cu_seqlens, *, num_v_heads, width,
                weight_dtype=None) -> None:
    """hopper/conv.py's conv_window: each live slot's first W-1 columns <- the W-1 inputs before
    its sequence's end (its old window where the sequence is shorter and has_initial_state)."""
    H = width - 1
    hist = _history(conv_state, slot_ids, has_initial_state.bool() & (slot_ids >= 0), H)
    _write_rows(conv_state, slot_ids, H, _last_windows(x.float(), hist, cu_seqlens.long(), H))


def conv_prefill(x, conv_state, weight, bias, slot_ids, has_initial_state, cu_seqlens, a, b, A_log,
                 dt_bias, *, activation, q_out, k_out, v_out, g_out, beta_out, decodes=None) -> None:
    """The prefill conv, then split, L2 norm of q/k (from the fp32 conv output) and gates; with
    ``decodes`` = (x [B, dim], slot_ids [B], out [B, dim]) also :func:`conv_decode` of a mixed
    step's decode rows (hopper/conv.py's conv_prefill does both in one launch)."""
    if decodes is not None:
        xd, ids, out = decodes
        conv_decode(xd, conv_state, weight, bias, ids, num_v_heads=v_out.shape[1], activation=activation,
                    out=out)
    y = conv_varlen(x, conv_state, weight, bias, slot_ids, has_initial_state, cu_seqlens,
                    activation=activation)
    T, Hk, Hv = x.shape[0], q_out.shape[1], v_out.shape[1]
    kd = Hk * HEAD_DIM
    q_out.copy_(reference.l2norm(y[:, :kd].reshape(T, Hk, HEAD_DIM)))
    k_out.copy_(reference.l2norm(y[:, kd:2 * kd].reshape(T, Hk, HEAD_DIM)))
    v_out.copy_(y[:, 2 * kd:].reshape(T, Hv, HEAD_DIM))
    g, beta = reference.fused_gating(a, b, A_log, dt_bias)
    g_out.copy_(g)
    beta_out.copy_(beta)


def conv_decode(x, conv_state, weight, bias, slot_ids, *, num_v_heads, activation, out) -> None:
    """One token per row: out = act(conv(window)) in x's dtype (zeros for padding rows); the
    live slots' windows shift by one."""
    H = weight.shape[1] - 1
    live = slot_ids >= 0
    window = torch.cat([_history(conv_state, slot_ids, live, H), x.float().unsqueeze(-1)], dim=-1)
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    _write_rows(conv_state, slot_ids, H, window[:, :, 1:])
    out.copy_(torch.where(live.view(-1, 1), _act(y, activation), torch.zeros_like(y)))


def conv_spec(x, conv_state, weight, bias, slot_ids, num_accepted, cu_seqlens, *, num_v_heads, draft,
              activation, out) -> None:
    """vLLM's speculative sliding window (hopper/conv.py's conv_spec): rows past cu_seqlens[N]
    and tokens past a sequence's first ``draft`` are not touched."""
    W = weight.shape[1]
    H, D = W - 1, draft
    L = conv_state.shape[2]
    cu = cu_seqlens.long()
    live = slot_ids >= 0
    lens = (cu[1:] - cu[:-1]).clamp(0, D)
    off = (num_accepted.long() - 1).clamp(max=L - H).clamp(min=0)
    old = conv_state[slot_ids.long().clamp(min=0)].float()                      # [N, dim, L]
    cols = off.view(-1, 1) + torch.arange(H, device=x.device).view(1, -1)
    hist = torch.gather(old, 2, cols.unsqueeze(1).expand(-1, old.shape[1], -1))  # [N, dim, H]
    j = torch.arange(D, device=x.device).view(1, -1)
    tok = (cu[:-1].view(-1, 1) + j).clamp(0, max(x.shape[0] - 1, 0))           # [N, D]
    xs = torch.where((j < lens.view(-1, 1)).unsqueeze(-1), x.float()[tok], torch.zeros(()))
    window = torch.cat([hist, xs.transpose(1, 2)], dim=-1)                      # [N, dim, H + D]
    y = sum(window[:, :, i:i + D] * weight.float()[:, i].view(1, -1, 1) for i in range(W))
    if bias is not None:
        y = y + bias.float().view(1, -1, 1)
    y = torch.where(live.view(-1, 1, 1), _act(y, activation), torch.zeros_like(y))  # [N, dim, D]
    rows = (j < lens.view(-1, 1)).nonzero()
    out[cu[rows[:, 0]] + rows[:, 1]] = y[rows[:, 0], :, rows[:, 1]].to(out.dtype)
    ncol = H - 1 + D
    keep = torch.arange(ncol, device=x.device).view(1, 1, -1) < (H - 1 + lens).view(-1, 1, 1)
    _write_rows(conv_state, slot_ids, ncol, torch.where(keep, window[:, :, 1:], old[:, :, :ncol]))


def conv_verify(x, conv_state, weight, bias, slot_ids, windows, window_ids, *, num_v_heads, draft, activation,
                out) -> None:
    """SGLang's target verify (hopper/conv.py's conv_verify): D = draft tokens per sequence; the
    window after each token to windows[window_ids[s], j] (ids < 0: none), after the last to the
    slot; padding rows (slot < 0) get zero outputs and write nothing."""
    W = weight.shape[1]
    H, D, N = W - 1, draft, slot_ids.shape[0]
    live = slot_ids >= 0
    hist = _history(conv_state, slot_ids, live, H)                              # [N, dim, H]
    xs = x.float()[:N * D].view(N, D, -1).transpose(1, 2)                      # [N, dim, D]
    window = torch.cat([hist, xs], dim=-1)                                      # [N, dim, H + D]
    y = sum(window[:, :, i:i + D] * weight.float()[:, i].view(1, -1, 1) for i in range(W))
    if bias is not None:
        y = y + bias.float().view(1, -1, 1)
    y = torch.where(live.view(-1, 1, 1), _act(y, activation), torch.zeros_like(y))
    out[:N * D] = y.transpose(1, 2).reshape(N * D, -1).to(out.dtype)
    rows = (live & (window_ids >= 0)).nonzero().view(-1)
    steps = torch.stack([window[:, :, j + 1:j + 1 + H] for j in range(D)], dim=1)  # [N, D, dim, H]
    windows[window_ids[rows].long()] = steps[rows].to(windows.dtype)
    _write_rows(conv_state, slot_ids, H, window[:, :, D:])


def verify_slots(q, k, v, pool, spec_slot_ids, num_accepted, cu_seqlens, *, a, b, A_log, dt_bias,
                 use_qk_l2norm, scale, out, after_conv=False) -> None:
    """hopper/decode.py's verify_slots, token by token: sequence i starts from
    pool[spec_slot_ids[i, num_accepted[i] - 1]]; the state after its token j goes to
    pool[spec_slot_ids[i, j]] (ids < 0 not written); padding rows get zero outputs; tokens past
    a sequence's first D and rows past cu_seqlens[N] are not touched. ``after_conv`` (the
    TileLang kernel's launch form) changes nothing here."""
    g, beta = reference.fused_gating(a, b, A_log, dt_bias)
    dt = reference._compute_dtype(q)
    if use_qk_l2norm:
        q, k = reference.l2norm(q.to(dt)), reference.l2norm(k.to(dt))
    N, D = spec_slot_ids.shape
    cu, acc, slots = cu_seqlens.tolist(), num_accepted.tolist(), spec_slot_ids.tolist()
    for i in range(N):
        bos, n = cu[i], min(cu[i + 1] - cu[i], D)
        col = acc[i] - 1
        src = slots[i][col] if slots[i][0] >= 0 and 0 <= col < D else -1
        if src < 0:
            out[bos:bos + n] = 0
            continue
        state = pool[src].to(dt).unsqueeze(0)       # read before any write (src may be a target)
        for j in range(n):
            t = bos + j
            o_t, state = reference.recurrent_gdn(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                 beta[t:t + 1], [0, 1], state, scale)
            out[t] = o_t[0].to(out.dtype)
            if slots[i][j] >= 0:
                pool[slots[i][j]] = state[0].to(pool.dtype)


def slot_ids(slots, null_slot: int, cu_seqlens=None) -> torch.Tensor:
    """Engine slot ids -> the ops' int32 ids (-1 = padding), device ops only (no sync): slots [N]
    (with cu_seqlens [N+1], empty sequences are padding too) or [Ns, D] (a row whose first slot
    is null is padding as a whole). kernels/hopper/slot_ids.py is the one-launch form."""
    pad = slots == null_slot
    if cu_seqlens is not None:
        pad = pad | (cu_seqlens[1:] <= cu_seqlens[:-1])
    elif slots.dim() == 2:
        pad = pad | (slots[:, :1] == null_slot)
    return torch.where(pad, -1, slots).to(torch.int32)   # (a scalar -1: no fill launch)
