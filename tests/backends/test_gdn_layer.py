"""qla_serve.backends.gdn_layer against a per-sequence oracle, with vLLM-shaped inputs.

The oracle loops over sequences and tokens in float64: causal conv from the slot's history,
gating, L2 norm, and the per-token recurrence of qla_serve.kernels.reference.recurrent_gdn.
Inputs are shaped like vLLM's: a paged state cache (page stride > one slot), null block 0 as
padding, decodes first then prefills, has_initial_state False for new requests, a resumed
prefill, and speculative batches with 2-D state indices and accepted-token counts, mixed with
prefills through token index permutations. No engine is imported.

CPU variants run in the core venv; the ``gpu`` variants run the same cases on CUDA (bf16 I/O
and a bf16 pool included) on the lent H200.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qla_serve.backends import gdn_layer as GL
from qla_serve.kernels import reference

HK, HV, D_HEAD, W = 2, 4, 128, 4
# GDN layers of one step in the multi-layer tests: the first checks, two record, three replay
LAYERS = 6
DIM = 2 * HK * D_HEAD + HV * D_HEAD
NULL = 0


def _cache(num_slots, dtype, device, gen, spec_cols=0):
    """A vLLM-like paged cache: per block [conv (DIM x (W-1+spec)) | ssm (HV,128,128)] + pad."""
    conv_len = W - 1 + spec_cols
    conv_n, ssm_n = DIM * conv_len, HV * D_HEAD * D_HEAD
    page = conv_n + ssm_n + 512                                  # padded page > slot
    raw = torch.randn(num_slots, page, generator=gen, dtype=torch.float32) * 0.1
    raw = raw.to(device=device, dtype=torch.float32)
    conv = raw[:, :conv_n].view(num_slots, conv_len, DIM).transpose(1, 2)   # SD layout, strided
    ssm = raw[:, conv_n:conv_n + ssm_n].view(num_slots, HV, D_HEAD, D_HEAD)
    if dtype == torch.bfloat16:  # a bf16 pool: separate storage with the same paging
        raw16 = torch.zeros(num_slots, page, dtype=torch.bfloat16, device=device)
        raw16[:, conv_n:conv_n + ssm_n] = raw[:, conv_n:conv_n + ssm_n].to(torch.bfloat16)
        ssm = raw16[:, conv_n:conv_n + ssm_n].view(num_slots, HV, D_HEAD, D_HEAD)
    assert ssm.stride(0) > HV * D_HEAD * D_HEAD
    return conv, ssm


def _weights(gen, device):
    w = (torch.randn(DIM, W, generator=gen) * 0.5).to(device)
    bias = (torch.randn(DIM, generator=gen) * 0.1).to(device)
    A_log = (torch.rand(HV, generator=gen) * 0.5 - 1.0).to(device)
    dt_bias = (torch.randn(HV, generator=gen) * 0.1).to(device)
    return w, bias, A_log, dt_bias


def _oracle_seq(x, a, b, hist, init, w, bias, A_log, dt_bias):
    """One sequence in float64: returns (o [L, HV, 128], conv inputs incl. history, final)."""
    x, hist = x.double(), hist.double()
    full = torch.cat([hist, x.t()], dim=1)                      # [DIM, W-1+L]
    L = x.shape[0]
    y = torch.stack([(full[:, t:t + W] * w.double()).sum(-1) for t in range(L)], 0) if L else x
    y = F.silu(y + bias.double()) if L else y
    q = reference.l2norm(y[:, :HK * D_HEAD].reshape(L, HK, D_HEAD))
    k = reference.l2norm(y[:, HK * D_HEAD:2 * HK * D_HEAD].reshape(L, HK, D_HEAD))
    v = y[:, 2 * HK * D_HEAD:].reshape(L, HV, D_HEAD)
    g = -torch.exp(A_log.double()) * F.softplus(a.double() + dt_bias.double())
    beta = torch.sigmoid(b.double())
    o, final = reference.recurrent_gdn(q, k, v, g, beta, [0, L], init.double().unsqueeze(0), None)
    states = []
    S = init.double().unsqueeze(0)
    for t in range(L):  # per-token states (for spec)
        _, S = reference.recurrent_gdn(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                       [0, 1], S, None)
        states.append(S[0])
    return o, full, final[0], states


def _tol(dtype):
    return {"bf16": True} if dtype == torch.bfloat16 else dict(atol=2e-4, rtol=2e-4)


def _close(got, want, **tol):
    """fp32: elementwise. bf16 (I/O or pool): relative Frobenius error < 2e-2, the measure a
    bf16 kernel is held to (elementwise bounds trip on a few rounding outliers)."""
    if tol.get("bf16"):
        err = float((got.double() - want).norm() / want.norm().clamp_min(1e-30))
        assert err < 2e-2, f"relative error {err:.3g} >= 2e-2"
    else:
        torch.testing.assert_close(got, want, **tol)


def _run_nonspec(device, io_dtype, pool_dtype, seed=0, checkpoints=False):
    gen = torch.Generator().manual_seed(seed)
    S = 12
    conv, ssm = _cache(S, pool_dtype, device, gen)
    conv[5].fill_(float("nan"))   # slot 5 starts a new request: its stale state must not be read
    ssm[5].fill_(float("nan"))
    conv0, ssm0 = conv.clone(), ssm.clone()
    w, bias, A_log, dt_bias = _weights(gen, device)
    # 2 decodes (slots 3, 7), then prefills: new request (slot 5, no state), resumed chunk
    # (slot 9, has state), 1-token new request (slot 2), a trailing zero-length padding row (null).
    dec_slots = [3, 7]
    pre_lens, pre_slots, pre_init = [70, 33, 1, 0], [5, 9, 2, NULL], [False, True, False, False]
    # Prefill checkpoints (vLLM's align-mode prefix caching): after 64 tokens of the new request
    # into slot 10, after 128 of a longer resumed chunk into 11; the null block means none.
    ck_chunks, ck_slots = [1, 2, 0, 0], [10, 11, NULL, NULL]
    if checkpoints:
        pre_lens = [70, 150, 1, 0]
    T = len(dec_slots) + sum(pre_lens)
    x = (torch.randn(T + 3, DIM, generator=gen)).to(device, io_dtype)        # +3 padded rows
    a = torch.randn(T + 3, HV, generator=gen).to(device, io_dtype)
    b = torch.randn(T + 3, HV, generator=gen).to(device, io_dtype)
    step = GL.make_step_plan(
        num_actual_tokens=T, num_v_heads=HV, num_k_heads=HK, conv_width=W, device=device,
        decode_slots=torch.tensor(dec_slots, dtype=torch.int32, device=device),
        prefill_lens=pre_lens, prefill_slots=torch.tensor(pre_slots, dtype=torch.int32, device=device),
        prefill_has_initial_state=torch.tensor(pre_init, device=device),
        prefill_checkpoint_chunks=ck_chunks if checkpoints else None,
        prefill_checkpoint_slots=torch.tensor(ck_slots, dtype=torch.int32, device=device) if checkpoints else None)
    out = torch.full((T + 3, HV, D_HEAD), float("nan"), dtype=io_dtype, device=device)
    calls = []
    GL.gdn_layer_forward(step, x, a, b, conv_weight=w, conv_bias=bias, activation="silu",
                         conv_state=conv, ssm_state=ssm, A_log=A_log, dt_bias=dt_bias,
                         num_k_heads=HK, out=out, on_call=lambda k, n: calls.append((k, n)))
    # (gdn_layer.MIXED_CONV: the decodes' conv runs in the prefill conv's launch, their gdn_decode after it)
    assert calls == ([("prefill", 4), ("decode", 2)] if GL.MIXED_CONV else [("decode", 2), ("prefill", 4)])
    if checkpoints:  # the conv side's table: derived once per step, kept for the step's other layers
        table = step.checkpoint_conv_table()
        assert table is step.checkpoint_conv_table() and table[1].tolist() == [10, -1, 11, -1, -1, -1, -1, -1]
    tol = _tol(io_dtype if io_dtype != torch.float32 else pool_dtype)
    t0 = 0
    touched = set()
    seqs = [(1, s, True, 0, NULL) for s in dec_slots] + list(zip(pre_lens, pre_slots, pre_init, ck_chunks, ck_slots))
    for L, slot, has, ck, ck_slot in seqs:
        if slot == NULL:
            continue
        touched.add(slot)
        hist = conv0[slot, :, :W - 1] if has else torch.zeros(DIM, W - 1, device=device)
        init = ssm0[slot] if has else torch.zeros(HV, D_HEAD, D_HEAD, device=device)
        if checkpoints and ck_slot != NULL:   # the state and conv window after 64 * ck tokens
            n = 64 * ck
            _, full_ck, final_ck, _ = _oracle_seq(x[t0:t0 + n].cpu(), a[t0:t0 + n].cpu(), b[t0:t0 + n].cpu(),
                                                  hist.float().cpu(), init.float().cpu(), w.cpu(), bias.cpu(),
                                                  A_log.cpu(), dt_bias.cpu())
            _close(ssm[ck_slot].double().cpu(), final_ck, **tol)
            _close(conv[ck_slot, :, :W - 1].double().cpu(), full_ck[:, -(W - 1):], **tol)
            touched.add(ck_slot)
        o, full, final, _ = _oracle_seq(x[t0:t0 + L].cpu(), a[t0:t0 + L].cpu(), b[t0:t0 + L].cpu(),
                                        hist.float().cpu(), init.float().cpu(), w.cpu(), bias.cpu(),
                                        A_log.cpu(), dt_bias.cpu())
        _close(out[t0:t0 + L].double().cpu(), o, **tol)
        _close(ssm[slot].double().cpu(), final, **tol)
        _close(conv[slot, :, :W - 1].double().cpu(), full[:, -(W - 1):], **tol)
        t0 += L
    assert torch.isnan(out[T:].float()).all(), "rows past num_actual_tokens must stay untouched"
    for s in range(S):  # untouched slots (the null block's included) bit-identical
        if s not in touched:
            assert torch.equal(ssm[s], ssm0[s]), f"ssm slot {s} changed"
            assert torch.equal(conv[s], conv0[s]), f"conv slot {s} changed"


def _run_spec(device, io_dtype, pool_dtype, with_prefill, seed=1, padded=False, checkpoints=False,
              leading=False):
    """Spec decodes (D = 3: 2 drafts) with ragged lengths, a padding row, and optionally prefills
    interleaved through token index permutations, or (``leading``) after the spec tokens with no
    token indices, as the vLLM adapter hands a step whose spec requests come first. ``padded``: vLLM's padded spec batch under a
    captured graph (gpu_model_runner.py ~4047, gdn_attn.py ~649 in vLLM 0.33): a 0-length row at
    the end too, and num_actual_tokens 4 past the spec cu_seqlens' end. ``checkpoints`` (with
    prefills): vLLM 0.33's defaults together, MTP beside a prefill chunk that writes an
    align-mode checkpoint (the state and conv window after 128 of its 150 tokens into slot 18)."""
    gen = torch.Generator().manual_seed(seed)
    S, D = 20, 3
    conv, ssm = _cache(S, pool_dtype, device, gen, spec_cols=D - 1)
    conv0, ssm0 = conv.clone(), ssm.clone()
    w, bias, A_log, dt_bias = _weights(gen, device)
    spec_slots = [[4, 5, 6], [10, 11, 12], [NULL, NULL, NULL], [15, 16, 17]]
    # 7 spec tokens: the gathered a and b rows of the other tokens start past a padding row
    # (gdn_layer._interleaved_rows)
    spec_lens, accepted = [3, 2, 0, 2], [2, 1, 1, 3]
    extra = 0
    if padded:
        spec_slots.append([NULL, NULL, NULL])
        spec_lens.append(0)
        accepted.append(1)
        extra = 4
    pre_lens, pre_slots, pre_init = ([9, 1], [2, 8], [True, False]) if with_prefill else ([], [], [])
    ck_chunks, ck_slots = [0, 0], [NULL, NULL]
    if checkpoints:
        pre_lens, ck_chunks, ck_slots = [150, 1], [2, 0], [18, NULL]
    Ts, Tp = sum(spec_lens), sum(pre_lens)
    T = Ts + Tp + extra
    # Token order of the batch: prefill tokens and spec tokens interleaved (vLLM orders requests,
    # and maps each group through its own token index), or the spec tokens first.
    perm = torch.randperm(T, generator=gen) if with_prefill and not leading else torch.arange(T)
    indexed = with_prefill and not leading
    # int32 like vLLM's staged index buffers
    spec_idx, non_idx = perm[:Ts].sort().values.int(), perm[Ts:].sort().values.int()
    x = torch.randn(T, DIM, generator=gen).to(device, io_dtype)
    a = torch.randn(T, HV, generator=gen).to(device, io_dtype)
    b = torch.randn(T, HV, generator=gen).to(device, io_dtype)
    cu = [0]
    for n in spec_lens:
        cu.append(cu[-1] + n)
    step = GL.make_step_plan(
        num_actual_tokens=T, num_v_heads=HV, num_k_heads=HK, conv_width=W, device=device,
        prefill_lens=pre_lens,
        prefill_slots=torch.tensor(pre_slots, dtype=torch.int32, device=device) if with_prefill else None,
        prefill_has_initial_state=torch.tensor(pre_init, device=device) if with_prefill else None,
        spec_slots=torch.tensor(spec_slots, dtype=torch.int32, device=device),
        spec_cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        num_accepted=torch.tensor(accepted, dtype=torch.int32, device=device), num_spec_tokens=Ts,
        spec_token_idx=spec_idx.to(device) if indexed else None,
        non_spec_token_idx=non_idx.to(device) if indexed else None,
        prefill_checkpoint_chunks=ck_chunks if checkpoints else None,
        prefill_checkpoint_slots=torch.tensor(ck_slots, dtype=torch.int32, device=device) if checkpoints else None)
    out = torch.zeros(T, HV, D_HEAD, dtype=io_dtype, device=device)
    out[Ts:] = 7.0   # padding tokens' rows (when padded) keep what the adapter put there
    GL.gdn_layer_forward(step, x, a, b, conv_weight=w, conv_bias=bias, activation="silu",
                         conv_state=conv, ssm_state=ssm, A_log=A_log, dt_bias=dt_bias,
                         num_k_heads=HK, out=out)
    if padded:
        assert (out[Ts:] == 7.0).all()
    tol = _tol(io_dtype if io_dtype != torch.float32 else pool_dtype)
    written = set()
    xs, as_, bs, os_ = (t[spec_idx.to(device)] for t in (x, a, b, out))
    for i, (row, L, acc) in enumerate(zip(spec_slots, spec_lens, accepted)):
        if row[0] == NULL:
            continue
        off = acc - 1
        hist = conv0[row[0], :, off:off + W - 1]
        init = ssm0[row[acc - 1]]
        sl = slice(cu[i], cu[i] + L)
        o, full, _, states = _oracle_seq(xs[sl].cpu(), as_[sl].cpu(), bs[sl].cpu(), hist.float().cpu(),
                                         init.float().cpu(), w.cpu(), bias.cpu(), A_log.cpu(), dt_bias.cpu())
        _close(os_[sl].double().cpu(), o, **tol)
        for j in range(L):
            _close(ssm[row[j]].double().cpu(), states[j], **tol)
            written.add(row[j])
        # Conv window after the step: the last W-2 history inputs, then the step's tokens.
        _close(conv[row[0], :, :W - 2 + L].double().cpu(), full[:, 1:], **tol)
        assert torch.equal(conv[row[0], :, W - 2 + L:], conv0[row[0], :, W - 2 + L:])
    if with_prefill:
        xn, an, bn, on = (t[non_idx.to(device)] for t in (x, a, b, out))
        t0 = 0
        for L, slot, has, ck, ck_slot in zip(pre_lens, pre_slots, pre_init, ck_chunks, ck_slots):
            hist = conv0[slot, :, :W - 1] if has else torch.zeros(DIM, W - 1, device=device)
            init = ssm0[slot] if has else torch.zeros(HV, D_HEAD, D_HEAD, device=device)
            if ck_slot != NULL:   # the state and conv window after 64 * ck of its tokens
                n = 64 * ck
                _, full_ck, final_ck, _ = _oracle_seq(xn[t0:t0 + n].cpu(), an[t0:t0 + n].cpu(),
                                                      bn[t0:t0 + n].cpu(), hist.float().cpu(), init.float().cpu(),
                                                      w.cpu(), bias.cpu(), A_log.cpu(), dt_bias.cpu())
                _close(ssm[ck_slot].double().cpu(), final_ck, **tol)
                _close(conv[ck_slot, :, :W - 1].double().cpu(), full_ck[:, -(W - 1):], **tol)
                written.add(ck_slot)
            o, full, final, _ = _oracle_seq(xn[t0:t0 + L].cpu(), an[t0:t0 + L].cpu(), bn[t0:t0 + L].cpu(),
                                            hist.float().cpu(), init.float().cpu(), w.cpu(), bias.cpu(),
                                            A_log.cpu(), dt_bias.cpu())
            _close(on[t0:t0 + L].double().cpu(), o, **tol)
            _close(ssm[slot].double().cpu(), final, **tol)
            written.add(slot)
            t0 += L
    conv_written = {row[0] for row in spec_slots if row[0] != NULL} | set(pre_slots) | set(ck_slots) - {NULL}
    for s in range(S):
        if s not in written:
            # Slots of unaccepted/unused draft positions, of other requests and the null block.
            assert torch.equal(ssm[s], ssm0[s]), f"ssm slot {s} changed"
        if s not in conv_written:
            assert torch.equal(conv[s], conv0[s]), f"conv slot {s} changed"


@pytest.mark.parametrize("io_dtype,pool_dtype", [(torch.float32, torch.float32),
                                                 (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
# gdn_layer.MIXED_CONV: the decodes' conv in the prefill conv's call (reference_conv.conv_prefill's
# decodes), or causal_conv_decode apart
@pytest.mark.parametrize("mixed_conv", [True, False])
def test_nonspec_mixed_batch_cpu(io_dtype, pool_dtype, mixed_conv, monkeypatch):
    monkeypatch.setattr(GL, "MIXED_CONV", mixed_conv)
    _run_nonspec("cpu", io_dtype, pool_dtype)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefill_checkpoints_cpu(pool_dtype):
    """vLLM's align-mode checkpoints through the layer: state and conv window after 64 * chunks
    tokens in their own slots, a null slot writes nothing, the rest as without them."""
    _run_nonspec("cpu", torch.float32, pool_dtype, checkpoints=True)


# prefills: none, interleaved with the spec tokens (gathered by the token indices), after them
_SPEC_PREFILLS = [(False, False), (True, False), (True, True)]


@pytest.mark.parametrize("with_prefill,leading", _SPEC_PREFILLS)
@pytest.mark.parametrize("io_dtype", [torch.float32, torch.bfloat16])
def test_spec_batch_cpu(with_prefill, leading, io_dtype):
    _run_spec("cpu", io_dtype, torch.float32, with_prefill, leading=leading)


def test_padded_spec_batch_cpu():
    _run_spec("cpu", torch.float32, torch.float32, False, padded=True)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leading", [False, True])
def test_spec_batch_with_prefill_checkpoints_cpu(pool_dtype, leading):
    _run_spec("cpu", torch.float32, pool_dtype, True, checkpoints=True, leading=leading)


def test_step_plan_reuses_host_parts():
    """A step with the same prefill lengths takes the previous step's plan; a 0-length row's
    slot becomes padding (-1) whatever the engine put there."""
    kw = dict(num_actual_tokens=5, num_v_heads=HV, num_k_heads=HK, conv_width=W, device="cpu",
              prefill_lens=[3, 2, 0], prefill_slots=torch.tensor([1, 2, 7], dtype=torch.int32),
              prefill_has_initial_state=torch.tensor([True, False, True]))
    first = GL.make_step_plan(**kw)
    again = GL.make_step_plan(**kw, reuse=first)
    assert again.prefill_plan is first.prefill_plan
    assert first.ids("prefill").tolist() == [1, 2, -1]
    other = GL.make_step_plan(**{**kw, "prefill_lens": [4, 1, 0]}, reuse=first)
    assert other.prefill_plan is not first.prefill_plan and other.prefill_plan.seq_lens == (4, 1, 0)


def test_prefill_lens_must_match_slots():
    with pytest.raises(ValueError, match="prefill_lens"):
        GL.make_step_plan(num_actual_tokens=3, num_v_heads=HV, num_k_heads=HK, conv_width=W,
                          device="cpu", prefill_lens=[3],
                          prefill_slots=torch.tensor([1, 2], dtype=torch.int32))


@pytest.mark.parametrize("given", ["spec_token_idx", "non_spec_token_idx"])
def test_spec_token_indices_come_in_pairs(given):
    """vLLM hands both token indices (spec decodes beside other tokens) or neither (spec decodes
    only); one alone would leave the other kind's rows unplaced, so the step plan refuses it."""
    with pytest.raises(ValueError, match=f"{given} alone"):
        GL.make_step_plan(num_actual_tokens=3, num_v_heads=HV, num_k_heads=HK, conv_width=W, device="cpu",
                          spec_slots=torch.tensor([[1, 2]], dtype=torch.int32),
                          spec_cu_seqlens=torch.tensor([0, 2], dtype=torch.int32),
                          num_accepted=torch.tensor([1], dtype=torch.int32), num_spec_tokens=2,
                          **{given: torch.tensor([0, 1], dtype=torch.int32)})


def _spec_decode_prefill_step(**kw):
    """make_step_plan for 6 tokens: a spec decode of 2 tokens, a decode and a 3-token prefill."""
    return GL.make_step_plan(num_actual_tokens=6, num_v_heads=HV, num_k_heads=HK, conv_width=W, device="cpu",
                             decode_slots=torch.tensor([3], dtype=torch.int32), prefill_lens=[3],
                             prefill_slots=torch.tensor([4], dtype=torch.int32),
                             prefill_has_initial_state=torch.tensor([False]),
                             spec_slots=torch.tensor([[1, 2]], dtype=torch.int32),
                             spec_cu_seqlens=torch.tensor([0, 2], dtype=torch.int32),
                             num_accepted=torch.tensor([1], dtype=torch.int32), **kw)


def test_non_spec_token_idx_covers_the_decode_and_prefill_tokens():
    """The non-spec rows are gathered by non_spec_token_idx and split into decodes and prefills:
    an index of another length is refused when the step is planned, by name."""
    with pytest.raises(ValueError, match=r"non_spec_token_idx: expected one index per decode and prefill token \(4\)"):
        _spec_decode_prefill_step(num_spec_tokens=2, spec_token_idx=torch.tensor([0, 1], dtype=torch.int32),
                                  non_spec_token_idx=torch.tensor([2, 3, 4], dtype=torch.int32))


@pytest.mark.parametrize("num_spec_tokens", [0, 4])
def test_leading_spec_tokens_fit_before_the_others(num_spec_tokens):
    """Without token indices the spec tokens are the step's first num_spec_tokens rows and the
    decode and prefill tokens follow them: a count that leaves them no room (or no spec rows at
    all) is refused when the step is planned, by name, instead of splitting the rows wrongly."""
    with pytest.raises(ValueError, match=r"num_spec_tokens: the spec tokens lead .* expected 1\.\.2, got "
                       + str(num_spec_tokens)):
        _spec_decode_prefill_step(num_spec_tokens=num_spec_tokens)


# A step's batch (spec rows of D = 2 tokens) and one argument that only a later op of the layer
# call checks: the core's (scale, out) or the prefill's (has_initial_state) after a conv or a
# decode that an earlier op launches.
_REFUSED = [("decode", "scale"), ("decode", "out"), ("mixed", "has_initial_state"), ("mixed", "scale"),
            ("checkpoints", "scale"), ("spec", "scale"), ("spec", "out"), ("spec+prefill", "has_initial_state")]


def _refused_call(device, kind, bad, monkeypatch):
    """A layer call with one bad argument raises, naming it, before any launch: the whole conv
    and SSM caches stay bit-identical (before, a conv or a decode launched ahead of the op that
    refused the argument had already written the batch's slots)."""
    from qla_serve import ops

    monkeypatch.setattr(ops, "_checked_steps", {})    # decode/verify keep passed keys process-wide
    gen = torch.Generator().manual_seed(9)
    spec = kind.startswith("spec")
    conv, ssm = _cache(16, torch.float32, device, gen, spec_cols=1 if spec else 0)
    w, bias, A_log, dt_bias = _weights(gen, device)
    i32 = dict(dtype=torch.int32, device=device)
    kw = dict(num_v_heads=HV, num_k_heads=HK, conv_width=W, device=device)
    lens, T = [], 0
    if kind in ("decode", "mixed"):
        kw.update(decode_slots=torch.tensor([3, 7], **i32))
        T += 2
    if kind in ("mixed", "checkpoints", "spec+prefill"):
        lens = [70] if kind == "checkpoints" else [5, 9]
        kw.update(prefill_lens=lens, prefill_slots=torch.tensor([5, 9][:len(lens)], **i32),
                  prefill_has_initial_state=torch.tensor([False, True][:len(lens)], device=device))
        T += sum(lens)
    if kind == "checkpoints":
        kw.update(prefill_checkpoint_chunks=[1], prefill_checkpoint_slots=torch.tensor([10], **i32))
    if spec:
        Ts = 3
        kw.update(spec_slots=torch.tensor([[1, 2], [11, 12]], **i32), spec_cu_seqlens=torch.tensor([0, 2, 3], **i32),
                  num_accepted=torch.tensor([1, 2], **i32), num_spec_tokens=Ts)
        if lens:
            kw.update(spec_token_idx=torch.arange(Ts, **i32), non_spec_token_idx=torch.arange(Ts, Ts + T, **i32))
        T += Ts
    if bad == "has_initial_state":
        kw["prefill_has_initial_state"] = kw["prefill_has_initial_state"].to(torch.int32)
    step = GL.make_step_plan(num_actual_tokens=T, **kw)
    x = torch.randn(T, DIM, generator=gen).to(device)
    a, b = (torch.randn(T, HV, generator=gen).to(device) for _ in range(2))
    out = torch.zeros(T, HV, D_HEAD, dtype=torch.float16 if bad == "out" else torch.float32, device=device)
    conv0, ssm0 = conv.clone(), ssm.clone()
    with pytest.raises((TypeError, ValueError), match=f"^{bad}: "):
        GL.gdn_layer_forward(step, x, a, b, conv_weight=w, conv_bias=bias, activation="silu", conv_state=conv,
                             ssm_state=ssm, A_log=A_log, dt_bias=dt_bias, num_k_heads=HK, out=out,
                             scale=float("nan") if bad == "scale" else None)
    assert torch.equal(conv, conv0), "conv state written before the refusal"
    assert torch.equal(ssm, ssm0), "SSM state written before the refusal"


@pytest.mark.parametrize("kind,bad", _REFUSED)
def test_a_refused_argument_writes_no_slot_cpu(kind, bad, monkeypatch):
    _refused_call("cpu", kind, bad, monkeypatch)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("io_dtype,pool_dtype", [(torch.bfloat16, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16)])
# gdn_layer.MIXED_CONV: the decodes' conv as decode CTAs of the prefill conv's launch, or apart
@pytest.mark.parametrize("mixed_conv", [True, False])
def test_nonspec_mixed_batch_gpu(io_dtype, pool_dtype, mixed_conv, monkeypatch):
    monkeypatch.setattr(GL, "MIXED_CONV", mixed_conv)
    _run_nonspec("cuda", io_dtype, pool_dtype)


def _run_later_layers(dev, io, monkeypatch):
    """A step's later GDN layers (their own inputs, weights and caches, the same metadata) skip
    their ops' checks (gdn_layer._layer_key; counted here by the layer ops' _check_conv, which
    the decode conv and the prefill inputs run when they check) and take the prefill's inputs in
    the step's buffers; each layer still gives bit for bit what it gives as the first layer of a
    fresh step. From the third layer on, on the TileLang path, the layers replay the launches
    the first and second recorded (backends/launch_replay.py): the same bits again. A later call
    whose metadata differs (out in another dtype) is checked again and refused by name."""
    from qla_serve import layer_ops, ops

    # gdn_decode / causal_conv_decode keep passed keys process-wide: an earlier test with the
    # same metadata would have spared this step's first layer its checks
    monkeypatch.setattr(ops, "_checked_steps", {})
    S = 12
    dec, lens, pre, init = [3, 7], [70, 33], [5, 9], [False, True]
    T = len(dec) + sum(lens)
    gen = torch.Generator().manual_seed(5)

    def make_step():
        return GL.make_step_plan(
            num_actual_tokens=T, num_v_heads=HV, num_k_heads=HK, conv_width=W, device=dev,
            decode_slots=torch.tensor(dec, dtype=torch.int32, device=dev), prefill_lens=lens,
            prefill_slots=torch.tensor(pre, dtype=torch.int32, device=dev),
            prefill_has_initial_state=torch.tensor(init, device=dev))

    def layer(step, i, caches, out):
        x, a, b, (w, bias, A_log, dt_bias) = inputs[i]
        GL.gdn_layer_forward(step, x, a, b, conv_weight=w, conv_bias=bias, activation="silu",
                             conv_state=caches[0], ssm_state=caches[1], A_log=A_log, dt_bias=dt_bias,
                             num_k_heads=HK, out=out)

    inputs = [(torch.randn(T, DIM, generator=gen).to(dev, io), torch.randn(T, HV, generator=gen).to(dev, io),
               torch.randn(T, HV, generator=gen).to(dev, io), _weights(gen, dev)) for _ in range(LAYERS)]
    shared = [_cache(S, torch.float32, dev, torch.Generator().manual_seed(100 + i)) for i in range(LAYERS)]
    fresh = [_cache(S, torch.float32, dev, torch.Generator().manual_seed(100 + i)) for i in range(LAYERS)]
    outs = [torch.full((T, HV, D_HEAD), float("nan"), dtype=io, device=dev) for _ in range(2 * LAYERS)]
    checks = []
    real_check = layer_ops._check_conv
    monkeypatch.setattr(layer_ops, "_check_conv", lambda *args, **kw: checks.append(1) or real_check(*args, **kw))
    step, per_layer = make_step(), []
    for i in range(LAYERS):
        checks.clear()
        layer(step, i, shared[i], outs[i])
        per_layer.append(len(checks))
    assert len(step._checked) == 1
    assert [k[0] for k in step._scratch] == ["decode_conv_out"]   # one conv output buffer for the step
    assert per_layer == [2] + [0] * (LAYERS - 1), per_layer   # the decode conv's and the prefill inputs' checks, once
    assert step._replays.replayed == (LAYERS - 2 if dev == "cuda" else 0), step._replays.refused
    for i in range(LAYERS):
        layer(make_step(), i, fresh[i], outs[LAYERS + i])
        assert torch.equal(outs[i], outs[LAYERS + i]), f"layer {i}: out"
        assert torch.equal(shared[i][1], fresh[i][1]), f"layer {i}: ssm state"
        assert torch.equal(shared[i][0], fresh[i][0]), f"layer {i}: conv state"
    with pytest.raises(TypeError, match="^out: expected dtype"):
        layer(step, 0, shared[0], torch.empty(T, HV, D_HEAD, dtype=torch.float16, device=dev))


def test_later_layers_of_a_step_skip_the_checks_cpu(monkeypatch):
    """_run_later_layers on the CPU reference path. The layer key is None for a step whose slot
    ids are on the CPU (values are checked there on every call), so this variant replaces
    gdn_layer._layer_key by the metadata key alone (a stand-in: the real one runs in the gpu
    variant) to walk the trusted path."""
    from qla_serve import ops

    monkeypatch.setattr(GL, "_layer_key", lambda step, tensors, scalars: ("gdn_layer", *scalars,
                                                                          *map(ops._metadata, tensors)))
    _run_later_layers("cpu", torch.float32, monkeypatch)


@pytest.mark.gpu
@needs_cuda
def test_later_layers_of_a_step_skip_the_checks_gpu(monkeypatch):
    _run_later_layers("cuda", torch.bfloat16, monkeypatch)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind,bad", _REFUSED)
def test_a_refused_argument_writes_no_slot_gpu(kind, bad, monkeypatch):
    _refused_call("cuda", kind, bad, monkeypatch)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefill_checkpoints_gpu(pool_dtype):
    _run_nonspec("cuda", torch.bfloat16, pool_dtype, checkpoints=True)



@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("with_prefill,leading", _SPEC_PREFILLS)
def test_spec_batch_gpu(with_prefill, leading):
    _run_spec("cuda", torch.bfloat16, torch.float32, with_prefill, leading=leading)


@pytest.mark.gpu
@needs_cuda
def test_padded_spec_batch_gpu():
    _run_spec("cuda", torch.bfloat16, torch.float32, False, padded=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leading", [False, True])
def test_spec_batch_with_prefill_checkpoints_gpu(pool_dtype, leading):
    _run_spec("cuda", torch.bfloat16, pool_dtype, True, checkpoints=True, leading=leading)


def _run_spec_layers_share_the_step(dev, io, leading=False):
    """GDN layers of one spec step with prefills interleaved (their own inputs, weights and
    caches): the step's scratch buffers (the spec conv's output, the spec and non-spec rows
    gathered in one buffer per input, their outputs and the token permutation: StepPlan.scratch) serve them all, the layers from the third on
    replay the step's recorded launches on the TileLang path, and each layer gives bit for bit
    what it gives as the only layer of a fresh step. ``leading``: the prefills after the spec
    tokens, no token indices (row views: no gather buffers in the step's scratch)."""
    gen = torch.Generator().manual_seed(7)
    S, D = 20, 3
    spec_slots, spec_lens, accepted = [[4, 5, 6], [10, 11, 12], [15, 16, 17]], [3, 2, 2], [2, 1, 3]
    pre_lens, pre_slots, pre_init = [9, 1], [2, 8], [True, False]
    Ts = sum(spec_lens)
    T = Ts + sum(pre_lens)
    perm = torch.randperm(T, generator=gen)
    spec_idx, non_idx = perm[:Ts].sort().values.int(), perm[Ts:].sort().values.int()
    indices = {} if leading else dict(spec_token_idx=spec_idx.to(dev), non_spec_token_idx=non_idx.to(dev))

    def make_step():
        return GL.make_step_plan(
            num_actual_tokens=T, num_v_heads=HV, num_k_heads=HK, conv_width=W, device=dev, prefill_lens=pre_lens,
            prefill_slots=torch.tensor(pre_slots, dtype=torch.int32, device=dev),
            prefill_has_initial_state=torch.tensor(pre_init, device=dev),
            spec_slots=torch.tensor(spec_slots, dtype=torch.int32, device=dev),
            spec_cu_seqlens=torch.tensor([0, 3, 5, 7], dtype=torch.int32, device=dev),
            num_accepted=torch.tensor(accepted, dtype=torch.int32, device=dev), num_spec_tokens=Ts, **indices)

    inputs = [tuple(torch.randn(T, n, generator=gen).to(dev, io) for n in (DIM, HV, HV)) + (_weights(gen, dev),)
              for _ in range(LAYERS)]
    shared = [_cache(S, torch.float32, dev, torch.Generator().manual_seed(200 + i), spec_cols=D - 1)
              for i in range(LAYERS)]
    fresh = [_cache(S, torch.float32, dev, torch.Generator().manual_seed(200 + i), spec_cols=D - 1)
             for i in range(LAYERS)]
    outs = [torch.full((T, HV, D_HEAD), float("nan"), dtype=io, device=dev) for _ in range(2 * LAYERS)]

    def layer(step, i, caches, out):
        x, a, b, (w, bias, A_log, dt_bias) = inputs[i]
        GL.gdn_layer_forward(step, x, a, b, conv_weight=w, conv_bias=bias, activation="silu",
                             conv_state=caches[0], ssm_state=caches[1], A_log=A_log, dt_bias=dt_bias,
                             num_k_heads=HK, out=out)

    step = make_step()
    for i in range(LAYERS):
        layer(step, i, shared[i], outs[i])
    gathers = set() if leading else {"interleaved", "interleaved_rows", "interleaved_blocks", "interleaved_out"}
    assert {k[0] for k in step._scratch} == {"spec_conv_out"} | gathers
    assert step._replays.replayed == (LAYERS - 2 if dev == "cuda" else 0), step._replays.refused
    for i in range(LAYERS):
        layer(make_step(), i, fresh[i], outs[LAYERS + i])
        assert torch.equal(outs[i], outs[LAYERS + i]), f"layer {i}: out"
        assert torch.equal(shared[i][1], fresh[i][1]), f"layer {i}: ssm state"
        assert torch.equal(shared[i][0], fresh[i][0]), f"layer {i}: conv state"


@pytest.mark.parametrize("leading", [False, True])
def test_spec_layers_share_the_step_cpu(leading):
    _run_spec_layers_share_the_step("cpu", torch.float32, leading)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("leading", [False, True])
def test_spec_layers_share_the_step_gpu(leading):
    _run_spec_layers_share_the_step("cuda", torch.bfloat16, leading)


@pytest.mark.gpu
@needs_cuda
def test_padded_spec_batch_in_a_cuda_graph():
    """vLLM's FULL decode graph: captured for 4 spec rows, replayed with 3 live and a padded
    4th (0-length) row; was an out-of-bounds index assert before the layer kernels."""
    gen = torch.Generator().manual_seed(11)
    S, D, Nmax = 16, 2, 4
    conv, ssm = _cache(S, torch.float32, "cuda", gen, spec_cols=D - 1)
    w, bias, A_log, dt_bias = _weights(gen, "cuda")
    T = Nmax * D
    x = torch.randn(T, DIM, generator=gen).to("cuda", torch.bfloat16)
    a, b = (torch.randn(T, HV, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    slots = torch.arange(1, 1 + Nmax * D, dtype=torch.int32, device="cuda").view(Nmax, D)
    cu = torch.arange(0, T + 1, D, dtype=torch.int32, device="cuda")
    acc = torch.ones(Nmax, dtype=torch.int32, device="cuda")
    def step():  # vLLM builds fresh metadata for the capture run (its warm-up runs had their own)
        return GL.make_step_plan(num_actual_tokens=T, num_v_heads=HV, num_k_heads=HK, conv_width=W,
                                 device="cuda", spec_slots=slots, spec_cu_seqlens=cu, num_accepted=acc,
                                 num_spec_tokens=T)
    out = torch.zeros(T, HV, D_HEAD, dtype=torch.bfloat16, device="cuda")
    kw = dict(conv_weight=w, conv_bias=bias, activation="silu", conv_state=conv, ssm_state=ssm,
              A_log=A_log, dt_bias=dt_bias, num_k_heads=HK, out=out)
    GL.gdn_layer_forward(step(), x, a, b, **kw)            # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    captured = step()
    with torch.cuda.graph(graph):
        GL.gdn_layer_forward(captured, x, a, b, **kw)
        GL.gdn_layer_forward(captured, x, a, b, **kw)      # a second layer of the same step
    # replay: the last row padded (null slots, 0 tokens), so cu ends at 3 * D < T
    # (the engine's persistent buffers, rewritten in place before the replay)
    padded = slots[3].tolist() + [NULL]
    slots[3].fill_(NULL)
    cu[4] = 3 * D
    ssm0, conv0 = ssm.clone(), conv.clone()
    # what one layer computes eagerly from the same caches (twice: the graph holds two layers)
    ssm_e, conv_e, out_e = ssm.clone(), conv.clone(), torch.full_like(out, 7.0)
    for _ in range(2):
        GL.gdn_layer_forward(step(), x, a, b, **{**kw, "ssm_state": ssm_e, "conv_state": conv_e, "out": out_e})
    out.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    assert (out[3 * D:] == 7.0).all()
    assert torch.equal(out, out_e) and torch.equal(ssm, ssm_e) and torch.equal(conv, conv_e)
    for s in padded:
        assert torch.equal(ssm[s], ssm0[s]) and torch.equal(conv[s], conv0[s])


@pytest.mark.gpu
@needs_cuda
def test_a_step_of_six_layers_in_a_cuda_graph(monkeypatch):
    """vLLM's FULL decode graph of a step of six GDN layers, each with its own weights, caches and
    activations: captured with the launch replay on (layers 3-6 replay inside the capture what
    layers 1-2 recorded), then replayed after the engine rewrites its persistent slot buffer in
    place (other slots, the padding moved): every layer's output, SSM and conv states equal, bit
    for bit, those of eager calls on fresh steps without the replay, over copies of the caches."""
    gen = torch.Generator().manual_seed(13)
    S, B = 16, 5
    weights = [_weights(gen, "cuda") for _ in range(LAYERS)]
    caches = [_cache(S, torch.float32, "cuda", torch.Generator().manual_seed(300 + i)) for i in range(LAYERS)]
    xs = [torch.randn(B, DIM, generator=gen).to("cuda", torch.bfloat16) for _ in range(LAYERS)]
    gates = [tuple(torch.randn(B, HV, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
             for _ in range(LAYERS)]
    outs = [torch.zeros(B, HV, D_HEAD, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    slots = torch.tensor([3, 7, NULL, 11, 2], dtype=torch.int32, device="cuda")   # vLLM's persistent buffer

    def step(ids):
        return GL.make_step_plan(num_actual_tokens=B, num_v_heads=HV, num_k_heads=HK, conv_width=W, device="cuda",
                                 decode_slots=ids)

    def forward(st, caches_, outs_):
        for (w, bias, A_log, dt_bias), (conv, ssm), x, (a, b), out in zip(weights, caches_, xs, gates, outs_):
            GL.gdn_layer_forward(st, x, a, b, conv_weight=w, conv_bias=bias, activation="silu", conv_state=conv,
                                 ssm_state=ssm, A_log=A_log, dt_bias=dt_bias, num_k_heads=HK, out=out)

    def copies():   # the caches' values in the same paged layout
        out = []
        for i, (conv, ssm) in enumerate(caches):
            conv_c, ssm_c = _cache(S, torch.float32, "cuda", torch.Generator().manual_seed(400 + i))
            conv_c.copy_(conv)
            ssm_c.copy_(ssm)
            out.append((conv_c, ssm_c))
        return out

    forward(step(slots), copies(), [torch.empty_like(o) for o in outs])   # compile and load outside the capture
    torch.cuda.synchronize()
    captured = step(slots)   # vLLM builds the capture run's metadata afresh
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(captured, caches, outs)
    assert captured._replays.replayed == LAYERS - 2, captured._replays.refused
    monkeypatch.setattr(GL, "LAUNCH_REPLAY", False)
    for trial, new in enumerate(([5, NULL, 9, 12, 1], [14, 3, 6, NULL, 8])):
        slots.copy_(torch.tensor(new, dtype=torch.int32))
        ref_caches, ref_outs = copies(), [torch.zeros_like(o) for o in outs]
        forward(step(slots.clone()), ref_caches, ref_outs)
        graph.replay()
        torch.cuda.synchronize()
        for i in range(LAYERS):
            assert torch.equal(outs[i], ref_outs[i]), f"trial {trial} layer {i}: out"
            assert torch.equal(caches[i][1], ref_caches[i][1]), f"trial {trial} layer {i}: ssm state"
            assert torch.equal(caches[i][0], ref_caches[i][0]), f"trial {trial} layer {i}: conv state"


def test_padded_decode_batch_cpu():
    """vLLM 0.33's FULL decode graph pads the decode rows with the null block
    (v1/attention/backends/gdn_attn.py ~655-668: non_spec_state_indices_tensor[num_decodes:]
    .fill_(NULL_BLOCK_ID)): those rows get zero outputs and no state, SSM or conv, changes."""
    gen = torch.Generator().manual_seed(5)
    conv, ssm = _cache(10, torch.float32, "cpu", gen)
    conv0, ssm0 = conv.clone(), ssm.clone()
    w, bias, A_log, dt_bias = _weights(gen, "cpu")
    slots = [3, NULL, 7, NULL]
    x = torch.randn(4, DIM, generator=gen)
    a, b = torch.randn(4, HV, generator=gen), torch.randn(4, HV, generator=gen)
    step = GL.make_step_plan(num_actual_tokens=4, num_v_heads=HV, num_k_heads=HK, conv_width=W, device="cpu",
                             decode_slots=torch.tensor(slots, dtype=torch.int32))
    out = torch.full((4, HV, D_HEAD), 7.0)
    GL.gdn_layer_forward(step, x, a, b, conv_weight=w, conv_bias=bias, activation="silu", conv_state=conv,
                         ssm_state=ssm, A_log=A_log, dt_bias=dt_bias, num_k_heads=HK, out=out)
    for i, s in enumerate(slots):
        if s == NULL:
            assert (out[i] == 0).all()
            continue
        o, full, final, _ = _oracle_seq(x[i:i + 1], a[i:i + 1], b[i:i + 1], conv0[s, :, :W - 1], ssm0[s],
                                        w, bias, A_log, dt_bias)
        _close(out[i:i + 1].double(), o, atol=2e-4, rtol=2e-4)
        _close(ssm[s].double(), final, atol=2e-4, rtol=2e-4)
    for s in set(range(10)) - {3, 7}:
        assert torch.equal(ssm[s], ssm0[s]) and torch.equal(conv[s], conv0[s])


@pytest.mark.parametrize("decodes,after_conv", [(1, True), (64, True), (65, False), (256, False)])
def test_decode_launch_form_follows_the_batch(decodes, after_conv, monkeypatch):
    """The decode step asks for the dependent launch after the conv (kernels/hopper/decode's
    after_conv) only while decodes x v-heads <= DECODE_AFTER_CONV_MAX_ROWS (256; HV = 4 here),
    where it measured faster. qla_serve.gdn_decode is wrapped to record the flag (a spy, the real
    op still runs: the CPU reference path, which ignores it)."""
    seen = []
    real = GL.qla_serve.gdn_decode

    def spy(*args, _after_conv=False, **kw):
        seen.append(_after_conv)
        return real(*args, _after_conv=_after_conv, **kw)

    monkeypatch.setattr(GL.qla_serve, "gdn_decode", spy)
    gen = torch.Generator().manual_seed(5)
    conv, ssm = _cache(decodes + 1, torch.float32, "cpu", gen)
    w, bias, A_log, dt_bias = _weights(gen, "cpu")
    step = GL.make_step_plan(num_actual_tokens=decodes, num_v_heads=HV, num_k_heads=HK, conv_width=W,
                             device="cpu", decode_slots=torch.arange(1, decodes + 1, dtype=torch.int32))
    x = torch.randn(decodes, DIM, generator=gen)
    a, b = torch.randn(decodes, HV, generator=gen), torch.randn(decodes, HV, generator=gen)
    out = torch.empty(decodes, HV, D_HEAD)
    GL.gdn_layer_forward(step, x, a, b, conv_weight=w, conv_bias=bias, activation="silu", conv_state=conv,
                         ssm_state=ssm, A_log=A_log, dt_bias=dt_bias, num_k_heads=HK, out=out)
    assert seen == [after_conv] and torch.isfinite(out).all()
