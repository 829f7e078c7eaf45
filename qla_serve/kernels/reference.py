"""Torch reference for every qla_serve op: the contracts of DESIGN.md, on CPU and GPU.

Two forms of the prefill math live here:

* :func:`recurrent_gdn` — the per-token recurrence, the truth every kernel is tested
  against (float64-capable)::

      S_t = exp(g_t) * S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T      (S: [V, K])
      o_t = scale * S_t q_t

* :func:`chunked_gdn` — the chunked form the TileLang kernels follow (chunk C = 64,
  a gate-free triangular solve, the gate applied afterwards as Gamma o A).

Pool-level functions (:func:`prefill`, :func:`decode`, :func:`verify`) have exactly the
signature of the kernel modules (see ``qla_serve/kernels/__init__.py``): they read the
initial state from ``pool[slot_ids[i]]`` and write the final state back in place.
Slot ids < 0 are padding: never read, never written; their outputs are computed from a
zero state. Everything computes in float32 (float64 when the inputs are float64) and
casts on output.

Shapes (token-major packed varlen): q, k ``[T, Hk, 128]``, v ``[T, Hv, 128]``,
g, beta ``[T, Hv]``, states ``[N, Hv, V, K]`` (V-first, as the engines store them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CHUNK = 64


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64: the relative L2 error every qla_serve check reports
    (the demo against this module's recurrence, `bench prefill --check` against the baselines)."""
    ref = ref.double()
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and the engines' convention).

    Computed in fp32 (fp64 for fp64 input), as the engines' kernels sum it, and returned in
    x's dtype; the backends use it to normalise q/k before gdn_prefill."""
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def fused_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                 dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next / Qwen3.5 gating. a, b [..., Hv]; A_log, dt_bias [Hv] -> fp32 (g, beta).

    g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).
    """
    dt = (a.float() + dt_bias.float())
    g = -torch.exp(A_log.float()) * F.softplus(dt)
    return g, torch.sigmoid(b.float())


def prefill_inputs(q, k, a, b, A_log, dt_bias, *, q_out, k_out, g_out, beta_out) -> None:
    """What prefill takes from what the engines' layers have: l2norm(q), l2norm(k) and, unless
    a is None, fused_gating(a, b, A_log, dt_bias), into the outputs (the math of
    kernels/hopper/prefill_inputs.py)."""
    # fp32 math rounded once into the outputs' dtype (q's, or fp16: the kernel's qk_dtype)
    q_out.copy_(l2norm(q.to(_compute_dtype(q))))
    k_out.copy_(l2norm(k.to(_compute_dtype(k))))
    if a is not None:
        g, beta = fused_gating(a, b, A_log, dt_bias)
        g_out.copy_(g)
        beta_out.copy_(beta)


def _expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """GVA: qk-head h // (Hv // Hk) serves v-head h. [T, Hk, D] -> [T, Hv, D]."""
    return x.repeat_interleave(num_v_heads // x.shape[1], dim=1)


def _seq_bounds(cu_seqlens) -> list[tuple[int, int]]:
    cu = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    return list(zip(cu[:-1], cu[1:]))


def _setup(q, k, v, g, beta, cu_seqlens, scale):
    """Shared set-up of both prefill forms: compute dtype, scale, GVA-expanded inputs in that
    dtype, sequence bounds and zeroed outputs (o [T, Hv, V], final [N, Hv, V, K])."""
    dt = _compute_dtype(q)
    Hv, Kd, Vd = v.shape[1], q.shape[-1], v.shape[-1]
    scale = Kd ** -0.5 if scale is None else scale
    inputs = (_expand_heads(q.to(dt), Hv), _expand_heads(k.to(dt), Hv), v.to(dt), g.to(dt), beta.to(dt))
    bounds = _seq_bounds(cu_seqlens)
    o = torch.zeros(v.shape[0], Hv, Vd, dtype=dt, device=v.device)
    final = torch.zeros(len(bounds), Hv, Vd, Kd, dtype=dt, device=v.device)
    return dt, scale, inputs, bounds, o, final


def recurrent_gdn(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None):
    """Per-token recurrence over packed sequences.

    Args:
        q, k: [T, Hk, K]; v: [T, Hv, V]; g, beta: [T, Hv]; cu_seqlens: [N+1] ints.
        initial_state: [N, Hv, V, K] or None (zeros).
        scale: defaults to K ** -0.5.
    Returns:
        o [T, Hv, V] in the compute dtype (float64 for float64 inputs, else float32) and
        final_state [N, Hv, V, K] in the same dtype.
    """
    dt, scale, (qe, ke, ve, ge, be), bounds, o, final = _setup(q, k, v, g, beta, cu_seqlens, scale)
    Hv, Kd, Vd = v.shape[1], q.shape[-1], v.shape[-1]
    for i, (bos, eos) in enumerate(bounds):
        S = (initial_state[i].to(dt).clone() if initial_state is not None
             else torch.zeros(Hv, Vd, Kd, dtype=dt, device=v.device))
        for t in range(bos, eos):
            kt, vt, bt = ke[t], ve[t], be[t]                       # [Hv,K], [Hv,V], [Hv]
            S = S * torch.exp(ge[t])[:, None, None]
            v_old = torch.einsum("hvk,hk->hv", S, kt)              # S k
            S = S + torch.einsum("hv,hk->hvk", bt[:, None] * (vt - v_old), kt)
            o[t] = scale * torch.einsum("hvk,hk->hv", S, qe[t])
        final[i] = S
    return o, final


def _chunk_step(Q, Kc, Vc, g, beta, S, scale):
    """One chunk of the chunked form for all heads. K-first state S [Hv, K, V].

    Q, Kc [Hv, C, K]; Vc [Hv, C, V]; g, beta [Hv, C]. Returns (O [Hv, C, V], S_next).
    """
    return _apply_chunk(Q, Kc, *_chunk_products(Q, Kc, Vc, g, beta, scale), S, scale)


def _apply_chunk(Q, Kc, U0, Wk, P, gamma, dec, S, scale):
    """The state-dependent half of a chunk, from its :func:`_chunk_products`: (O, S_next)."""
    V_new = U0 - Wk @ S                   # = (Gamma o A) diag(beta) (V - diag(gamma) K S)
    O = scale * gamma[..., None] * (Q @ S) + P @ V_new
    S_next = gamma[..., -1:, None] * S + Kc.transpose(-1, -2) @ (dec[..., None] * V_new)
    return O, S_next


def _chunk_inputs(qe, ke, ve, ge, be, c0, c1):
    """Tokens c0..c1-1 of the expanded inputs, head-major: Q, K [Hv, C, K], V [Hv, C, V], g, beta [Hv, C]."""
    return (qe[c0:c1].transpose(0, 1), ke[c0:c1].transpose(0, 1), ve[c0:c1].transpose(0, 1),
            ge[c0:c1].T, be[c0:c1].T)


def _initial_k_first(initial_state, i, Hv, Kd, Vd, dt, device):
    """Sequence i's initial state K-first [Hv, K, V] in dt (a copy), zeros without one."""
    if initial_state is None:
        return torch.zeros(Hv, Kd, Vd, dtype=dt, device=device)
    return initial_state[i].to(dt).transpose(-1, -2).clone()


def _chunk_products(Q, Kc, Vc, g, beta, scale):
    """The state-free products of one chunk (what the Hopper kernels' stage 1 makes), all heads:
    A = (I + StrictLower(diag(beta) K K^T))^-1 solved gate-free once per chunk, the gate entering
    as Gamma o A with Gamma[i, j] = gamma_i / gamma_j (exact: a similarity transform by
    diag(gamma); differences of cumsums avoid overflowing exp(-gcum_j)); M = (Gamma o A) diag(beta);
    returns U0 = M V, Wk = M diag(gamma) K, P = scale Lower(Gamma) o Q K^T, gamma and
    dec = gamma_last / gamma. Shapes as in :func:`_chunk_step`."""
    C = Kc.shape[1]
    gcum = g.cumsum(-1)
    eye = torch.eye(C, dtype=Kc.dtype, device=Kc.device)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=Kc.device), -1)
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=Kc.device))
    KKt = beta[..., :, None] * (Kc @ Kc.transpose(-1, -2))
    A = torch.linalg.solve_triangular(eye + KKt.masked_fill(~strict, 0), eye.expand_as(KKt),
                                      upper=False, unitriangular=True)
    Gamma = torch.exp((gcum[..., :, None] - gcum[..., None, :]).masked_fill(~lower, -math.inf))
    M = (Gamma * A) * beta[..., None, :]
    gamma = torch.exp(gcum)
    P = scale * (Q @ Kc.transpose(-1, -2)) * Gamma
    return M @ Vc, M @ (gamma[..., None] * Kc), P, gamma, torch.exp(gcum[..., -1:] - gcum)


def _scaled_diag_inverse(KKt, beta, block):
    """Db = Dinv diag(beta): Dinv inverts the diagonal block x block blocks of
    I + StrictLower(diag(beta) K K^T), by forward substitution as the kernels' threads do it
    (column c of Dinv_b: x[r] = [c == r] - beta_r sum_{m<r} KK[r, m] x[m]); zero off those blocks."""
    C = KKt.shape[-1]
    eye = torch.eye(C, dtype=KKt.dtype, device=KKt.device)
    dinv = torch.zeros_like(KKt)
    for b in range(C // block):
        r = slice(b * block, (b + 1) * block)
        x = torch.zeros_like(KKt[..., r, r])
        for i in range(block):
            row = b * block + i
            acc = (KKt[..., row, r][..., :i, None] * x[..., :i, :]).sum(-2)
            x[..., i, :] = eye[row, r] - beta[..., row, None] * acc
        dinv[..., r, r] = x
    return dinv * beta[..., None, :]


def _rounder(dtype, operand_dtype):
    return (lambda x: x.to(operand_dtype).to(dtype)) if operand_dtype is not None else (lambda x: x)


def blocked_solve(KKt, beta, operand_dtype=None, block=16):
    """A diag(beta), A = (I + StrictLower(diag(beta) K K^T))^-1, by the Hopper stage 1's blocked
    algorithm (kernels/hopper/prefill_prep.py, _solve; the same as solving the triangular system
    in :func:`_chunk_products`, in another order). KKt [..., C, C] = K K^T (beta-free), beta
    [..., C]; returns [..., C, C].

    Dinv inverts I + L's diagonal block x block blocks by forward substitution, Db = Dinv
    diag(beta), N = Db (K K^T)_off (K K^T below the diagonal blocks; strictly block-lower, so
    N^(C / block) = 0), and for C / block = 4: A diag(beta) = (I + N^2)(I - N) Db.
    operand_dtype (e.g. torch.float16): round what the kernel keeps in shared memory as GEMM
    operands -- (K K^T)_off, Db, N, I - N, I + N^2 and B = (I - N) Db -- to it, the products
    accumulating in KKt's dtype, to see the kernel's rounding; None computes exactly."""
    C = KKt.shape[-1]
    if C % block or C // block != 4:
        raise ValueError(f"blocked_solve: four {block}-blocks expected, got C = {C}")
    dt = KKt.dtype
    rnd = _rounder(dt, operand_dtype)
    blk = torch.arange(C, device=KKt.device) // block
    off = blk[:, None] > blk[None, :]
    eye = torch.eye(C, dtype=dt, device=KKt.device)
    db = rnd(_scaled_diag_inverse(KKt, beta, block))
    n = db @ rnd(KKt.masked_fill(~off, 0))
    b_mat = rnd(rnd(eye - n) @ db)
    return rnd(eye + rnd(n) @ rnd(n)) @ b_mat


def block_substitution_solve(KKt, beta, operand_dtype=None, block=16):
    """The same A diag(beta) as :func:`blocked_solve`, by the block forward substitution of
    stage 1's mma solve (kernels/hopper/csrc/block_solve.cuh, PREP_SOLVE "mma"): with W = A
    diag(beta), Db as there and KK_ik the blocks of K K^T,
        W_jj = Db_j,   W_ij = -Db_i sum_{k=j}^{i-1} KK_ik W_kj   (i > j),
    block column by block column. operand_dtype rounds what that kernel rounds: the operands Db
    and KK_ik, each W_kj before it is multiplied again, and each sum before its product with Db_i
    (the products accumulate in KKt's dtype); None computes exactly."""
    C = KKt.shape[-1]
    nb = C // block
    if C % block:
        raise ValueError(f"block_substitution_solve: C = {C} is not a multiple of {block}")
    rnd = _rounder(KKt.dtype, operand_dtype)
    db = rnd(_scaled_diag_inverse(KKt, beta, block))
    kk = rnd(KKt)
    blk = [slice(b * block, (b + 1) * block) for b in range(nb)]
    w = torch.zeros_like(KKt)
    for j in range(nb):
        w[..., blk[j], blk[j]] = db[..., blk[j], blk[j]]
        for i in range(j + 1, nb):
            z = sum(kk[..., blk[i], blk[m]] @ rnd(w[..., blk[m], blk[j]]) for m in range(j, i))
            w[..., blk[i], blk[j]] = -(db[..., blk[i], blk[i]] @ rnd(z))
    return w


def chunked_gdn(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, chunk_size=CHUNK):
    """Chunked form of :func:`recurrent_gdn` (same arguments and results).

    Per chunk (K-first, gamma = exp of the chunk-local cumsum of g):
    A = (I + StrictLower(diag(beta) K K^T))^-1; V' = (Gamma o A) diag(beta) (V - diag(gamma) K S);
    O = diag(gamma) Q S + (Lower(Gamma) o Q K^T) V'; S' = gamma_last S + K^T diag(gamma_last/gamma) V'.
    """
    dt, scale, (qe, ke, ve, ge, be), bounds, o, final = _setup(q, k, v, g, beta, cu_seqlens, scale)
    Hv, Kd, Vd = v.shape[1], q.shape[-1], v.shape[-1]
    for i, (bos, eos) in enumerate(bounds):
        S = _initial_k_first(initial_state, i, Hv, Kd, Vd, dt, v.device)
        for c0 in range(bos, eos, chunk_size):
            c1 = min(c0 + chunk_size, eos)
            O, S = _chunk_step(*_chunk_inputs(qe, ke, ve, ge, be, c0, c1), S, scale)
            o[c0:c1] = O.transpose(0, 1)
        final[i] = S.transpose(-1, -2)
    return o, final


def segmented_gdn(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None,
                  segment_chunks=4, chunk_size=CHUNK):
    """Exact context-parallel form of :func:`recurrent_gdn` (same arguments and results): the
    algebra a CP prefill kernel implements. Each sequence is cut into segments of
    ``segment_chunks`` chunks. Per chunk (K-first S, products of :func:`_chunk_products`)
        V' = U0 - Wk S,   O = diag(gamma) scale Q S + P V',
        S' = gamma_last S + K^T diag(dec) V' = T S + b,  T = gamma_last I - K^T diag(dec) Wk,
                                                          b = K^T diag(dec) U0,
    so a segment maps its initial state affinely: S_end = Phi S_start + S0 (Phi = the product of
    its chunks' T, [K, K]; S0 = its walk from a zero state). The segments' (Phi, S0) are
    independent (the parallel pass), a scan over segments gives every initial state, and a
    second parallel pass walks each segment from its own initial state for the outputs.
    """
    dt, scale, (qe, ke, ve, ge, be), bounds, o, final = _setup(q, k, v, g, beta, cu_seqlens, scale)
    Hv, Kd, Vd = v.shape[1], q.shape[-1], v.shape[-1]
    eye = torch.eye(Kd, dtype=dt, device=v.device).expand(Hv, Kd, Kd)
    for i, (bos, eos) in enumerate(bounds):
        chunks = []
        for c0 in range(bos, eos, chunk_size):
            c1 = min(c0 + chunk_size, eos)
            Qc, Kc, Vc, gc, bc = _chunk_inputs(qe, ke, ve, ge, be, c0, c1)
            chunks.append((c0, c1, Qc, Kc, *_chunk_products(Qc, Kc, Vc, gc, bc, scale)))
        segments = [chunks[j:j + segment_chunks] for j in range(0, len(chunks), segment_chunks)]
        # Pass 1 (parallel over segments): each segment's affine map (Phi, S0).
        maps = []
        for seg in segments:
            Phi, S0 = eye.clone(), torch.zeros(Hv, Kd, Vd, dtype=dt, device=v.device)
            for _, _, _, Kc, U0, Wk, _, gamma, dec in seg:
                KtD = Kc.transpose(-1, -2) * dec[..., None, :]
                T = gamma[..., -1:, None] * eye - KtD @ Wk
                Phi, S0 = T @ Phi, T @ S0 + KtD @ U0
            maps.append((Phi, S0))
        # Scan (sequential over segments, cheap): every segment's initial state.
        S = _initial_k_first(initial_state, i, Hv, Kd, Vd, dt, v.device)
        starts = []
        for Phi, S0 in maps:
            starts.append(S)
            S = Phi @ S + S0
        final[i] = S.transpose(-1, -2)
        # Pass 2 (parallel over segments): outputs from each segment's initial state.
        for seg, S in zip(segments, starts):
            for c0, c1, Qc, Kc, *products in seg:
                O, S = _apply_chunk(Qc, Kc, *products, S, scale)
                o[c0:c1] = O.transpose(0, 1)
    return o, final


def scan_segment_maps(maps, cut_levels, skip=None):
    """The CP scan (kernels/hopper/prefill_scan.py) in the layout the maps pass leaves, in place:
    for cut sequence j (num_cut = len(cut_levels)) and k = 1 .. cut_levels[j] - 1, map
    m = k num_cut + j,
        maps[m, h, 0] <- maps[m - num_cut, h, 0] @ maps[m, h, 1] + maps[m, h, 0]
    i.e. X_k = X_{k-1} Phi_k^T + B_k^T, segmented_gdn's S_k = Phi_k S_{k-1} + B_k with the state
    transposed (V-first, like the pool). maps [num_maps, Hv, 2, 128, 128]; skip [num_cut, Hv]
    bool: pairs left as they are (the warmup finder's need_maps == 0). Returns maps."""
    ncut = len(cut_levels)
    for j, levels in enumerate(cut_levels):
        for lvl in range(1, levels):
            m = lvl * ncut + j
            x = maps[m - ncut, :, 0] @ maps[m, :, 1] + maps[m, :, 0]
            if skip is not None:
                x[skip[j]] = maps[m, :, 0][skip[j]]
            maps[m, :, 0] = x
    return maps


WARMUP_LOG_DECAY = -10.0  # DESIGN.md: history decayed by e^-10 ~ 4.5e-5 may be dropped


def warmup_start_chunks(g_seq, first_chunk, threshold=WARMUP_LOG_DECAY, chunk_size=CHUNK):
    """Gate warmup, the truncating CP form: per head, the chunk from which a segment starting at
    chunk ``first_chunk`` of its sequence recomputes its initial state from a zero state -- the
    latest chunk w < first_chunk with sum(g[w C : first_chunk C]) <= threshold, so the dropped
    history is scaled by at most exp(threshold) -- or 0 (the whole history, from the sequence's
    true initial state: exact) for heads whose gates never decay that far, e.g. g = 0 heads.

    g_seq: [T_seq, Hv], the sequence's gates. Returns Hv ints."""
    Hv = g_seq.shape[1]
    per_chunk = torch.stack([g_seq[c * chunk_size:(c + 1) * chunk_size].sum(0) for c in range(first_chunk)]) \
        if first_chunk else torch.zeros(0, Hv, dtype=g_seq.dtype)
    starts = []
    for h in range(Hv):
        back = per_chunk[:, h].flip(0).cumsum(0)  # decay of the last 1, 2, ... chunks before the segment
        hit = (back <= threshold).nonzero()
        starts.append(first_chunk - 1 - int(hit[0]) if hit.numel() else 0)
    return starts


def warmup_gdn(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, segment_chunks=4,
               threshold=WARMUP_LOG_DECAY, chunk_size=CHUNK):
    """Gate-warmup context-parallel form of :func:`recurrent_gdn` (same arguments and results):
    each segment of ``segment_chunks`` chunks recomputes its initial state per head by walking
    from :func:`warmup_start_chunks` (from zero; from the true initial state when that is chunk
    0) -- no scan, but history older than a summed log decay of ``threshold`` is dropped. Exact
    for heads that never decay that far; the oracle a warmup kernel would be held to."""
    dt, scale, (qe, ke, ve, ge, be), bounds, o, final = _setup(q, k, v, g, beta, cu_seqlens, scale)
    Hv, Kd, Vd = v.shape[1], q.shape[-1], v.shape[-1]
    for i, (bos, eos) in enumerate(bounds):
        nchunks = -(-(eos - bos) // chunk_size)
        init = _initial_k_first(initial_state, i, Hv, Kd, Vd, dt, v.device)
        S = init.clone()
        for first in range(0, nchunks, segment_chunks):
            starts = warmup_start_chunks(ge[bos:eos], first, threshold, chunk_size)
            S = init.clone() if min(starts) == 0 else torch.zeros_like(init)
            for c in range(min(starts), min(first + segment_chunks, nchunks)):
                reset = torch.tensor([w == c and c > 0 for w in starts], device=v.device)
                S[reset] = 0.0  # this head's warmup starts here
                c0, c1 = bos + c * chunk_size, min(bos + (c + 1) * chunk_size, eos)
                O, S = _chunk_step(*_chunk_inputs(qe, ke, ve, ge, be, c0, c1), S, scale)
                if c >= first:
                    o[c0:c1] = O.transpose(0, 1)
        final[i] = S.transpose(-1, -2)
    return o, final


# ---------------------------------------------------------------------------------------
# Pool-level ops: the kernel-module contract (see qla_serve/kernels/__init__.py).
# ---------------------------------------------------------------------------------------

def _gather_initial(pool, slot_ids, has_initial_state, dtype):
    """Initial states [N, Hv, V, K]: pool rows for live slots with an initial state, else 0."""
    ids = slot_ids.long()
    use = ids >= 0
    if has_initial_state is not None:
        use = use & has_initial_state.to(torch.bool)
    init = torch.zeros((ids.numel(),) + tuple(pool.shape[1:]), dtype=dtype, device=pool.device)
    if bool(use.any()):
        init[use] = pool[ids[use]].to(dtype)
    return init


def _scatter_final(pool, slot_ids, final):
    live = slot_ids.long() >= 0
    if bool(live.any()):
        pool[slot_ids.long()[live]] = final[live].to(pool.dtype)


def _gating(g, beta, a, b, A_log, dt_bias):
    if g is None:
        return fused_gating(a, b, A_log, dt_bias)
    return g, beta


def prefill(q, k, v, g, beta, pool, slot_ids, plan, *, has_initial_state, scale, out,
            form: str = "plan", checkpoints=None):
    """Reference prefill on the pool. ``plan`` supplies cu_seqlens (a PrefillPlan, or the
    cu_seqlens list itself); ``form`` picks the math: "plan" (default) follows the plan's
    strategy -- "cp" runs the exact segmented form with plan.segment_chunks, anything else the
    chunked form -- or "chunked", "recurrent"."""
    if form not in ("plan", "chunked", "recurrent"):
        raise ValueError(f"form must be 'plan', 'chunked' or 'recurrent', got {form!r}")
    dt = _compute_dtype(q)
    init = _gather_initial(pool, slot_ids, has_initial_state, dt)
    cu = plan.cu_seqlens_cpu if hasattr(plan, "cu_seqlens_cpu") else plan
    if form == "recurrent":
        o, final = recurrent_gdn(q, k, v, g, beta, cu, init, scale)
    elif form == "plan" and getattr(plan, "strategy", None) == "cp" and plan.segment_chunks > 0:
        o, final = segmented_gdn(q, k, v, g, beta, cu, init, scale, segment_chunks=plan.segment_chunks)
    else:
        o, final = chunked_gdn(q, k, v, g, beta, cu, init, scale)
    out.copy_(o.to(out.dtype))
    if checkpoints is not None:
        _write_checkpoints(q, k, v, g, beta, pool, cu, init, scale, *checkpoints)
    _scatter_final(pool, slot_ids, final)


def _write_checkpoints(q, k, v, g, beta, pool, cu, init, scale, chunks, slots) -> None:
    """gdn_prefill's checkpoints: the state after min(CHUNK * chunks[s], len_s) tokens of
    sequence s into pool[slots[s]], for 1 <= chunks[s] <= ceil(len_s / CHUNK) and slots[s] >= 0
    (the kernels' rule: the chunk that ends there writes it), from the sequence's own start state."""
    for s, (c, slot) in enumerate(zip(chunks.tolist(), slots.tolist())):
        n = cu[s + 1] - cu[s]
        if slot < 0 or c < 1 or (c - 1) * CHUNK >= n:
            continue
        rows = slice(cu[s], cu[s] + min(c * CHUNK, n))
        _, state = chunked_gdn(q[rows], k[rows], v[rows], g[rows], beta[rows], [0, rows.stop - rows.start],
                               init[s:s + 1], scale)
        pool[slot] = state[0].to(pool.dtype)


def decode(q, k, v, pool, slot_ids, *, g, beta, a, b, A_log, dt_bias, use_qk_l2norm, scale, out,
           after_conv=False):
    """One token per sequence: q, k [B, Hk, K], v [B, Hv, V]; out [B, Hv, V].

    Padding rows (slot < 0) get a zero output and touch no slot. ``after_conv`` (the TileLang
    kernel's launch form after the layer's conv) changes nothing here.
    """
    g, beta = _gating(g, beta, a, b, A_log, dt_bias)
    if use_qk_l2norm:
        q, k = l2norm(q.to(_compute_dtype(q))), l2norm(k.to(_compute_dtype(k)))
    B = q.shape[0]
    cu = list(range(B + 1))
    dt = _compute_dtype(q)
    init = _gather_initial(pool, slot_ids, None, dt)
    o, final = recurrent_gdn(q, k, v, g, beta, cu, init, scale)
    o[slot_ids.long() < 0] = 0
    out.copy_(o.to(out.dtype))
    _scatter_final(pool, slot_ids, final)


def verify(q, k, v, pool, slot_ids, cu_seqlens, intermediate, intermediate_ids, *, g, beta,
           a, b, A_log, dt_bias, use_qk_l2norm, scale, out, after_conv=False):
    """Speculative verify: the state after token j of sequence i goes to
    ``intermediate[intermediate_ids[i], j]`` ([S', D, Hv, V, K]); the pool is only read.
    ``after_conv`` (the TileLang kernel's launch form) changes nothing here.

    Sequences whose slot or intermediate id is < 0 are padding: zero output, nothing written.
    """
    g, beta = _gating(g, beta, a, b, A_log, dt_bias)
    dt = _compute_dtype(q)
    if use_qk_l2norm:
        q, k = l2norm(q.to(dt)), l2norm(k.to(dt))
    init = _gather_initial(pool, slot_ids, None, dt)
    o = torch.zeros(v.shape, dtype=dt, device=v.device)
    for i, (bos, eos) in enumerate(_seq_bounds(cu_seqlens)):
        live = int(slot_ids[i]) >= 0 and int(intermediate_ids[i]) >= 0
        if not live:
            continue
        state = init[i:i + 1]
        for t in range(bos, eos):
            o_t, state = recurrent_gdn(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                       beta[t:t + 1], [0, 1], state, scale)
            o[t] = o_t[0]
            intermediate[int(intermediate_ids[i]), t - bos] = state[0].to(intermediate.dtype)
    out.copy_(o.to(out.dtype))


def commit_verified(pool, slot_ids, intermediate, intermediate_ids, num_accepted):
    """Copy the state after the last accepted token into the main slot, in place.

    num_accepted[i] >= 1 tokens of sequence i were accepted; 0 or a padding id leaves the slot.
    """
    ids = slot_ids.long()
    acc = num_accepted.long()
    live = (ids >= 0) & (intermediate_ids.long() >= 0) & (acc > 0)
    if bool(live.any()):
        src = intermediate[intermediate_ids.long()[live], acc[live] - 1]
        pool[ids[live]] = src.to(pool.dtype)
