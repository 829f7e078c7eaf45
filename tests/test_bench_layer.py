"""`qla-serve bench layer` (qla_serve/bench/layer.py) on the CPU: arguments, rows, the schedule,
the caches, the tables, and the composed baselines' math against qla_serve's own layer.

The composed "fla", "flashinfer" and "vllm" layers call FLA's Triton ops, FlashInfer's CUDA ops and
vLLM 0.33.0's Triton ops, which do not run on a CPU. Here they get torch stand-ins (:func:`standin_ops`) written from those libraries'
documented contracts, read in flash-linear-attention's source (fla/modules/conv/triton/{ops,kernels}.py:
conv state [N, D, W] whose column c holds the input at relative time c - W, the update shifting it
by one; fla/ops/gated_delta_rule/{chunk,fused_recurrent}.py: [B, T, H, D] inputs, log-space g,
V-first states under state_v_first, in-kernel gating/sigmoid/l2norm; fla/ops/utils/index.py:
chunk indices), FlashInfer's (flashinfer/gdn_prefill.py, gdn_decode.py: linear-space alpha, the
pool read and written in place through state indices) and vLLM's (its wheel's mamba/ops/causal_conv1d.py
and third_party/flash_linear_attention/ops: conv state [S, D, W-1], the conv update writing over its
input, slot <= 0 skipped by the packed decode). The "sglang" and "sglang_qla" decode steps call
SGLang 0.5.23's Triton ops: its kernels/ops/mamba/causal_conv1d_triton.py update has vLLM's
contract but returns a new tensor (x left alone), and its fla/fused_recurrent.py packed decode is
vLLM's, so they take the vLLM stand-ins; their extends take stand-ins of SGLang's causal_conv1d_fn,
q/k/v split, gating and q/k prepare, and of FlashInfer's prefill as SGLang's SM90 wrapper calls it
(kernels/gdn_flashinfer.py). The stand-ins check the arguments they rely
on, so a composition that passes a K-first state or wrong chunk indices fails here. The recurrence in
them is a plain float64 per-token loop, independent of qla_serve's reference.

What this does NOT test: the real FLA/FlashInfer ops (their signatures in the installed versions, their
numerics, CUDA-graph capture), the GPU timing and host-time code, and the qla_serve TileLang path; those
run only on the GPU (`qla-serve bench layer --check` reports the same comparison there).
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from qla_serve.bench import layer as L
from qla_serve.bench import source_commit
from qla_serve.bench import layer_composed as C
from qla_serve.cli import main


# ---------------------------------------------------------------------------------------------
# Rows, heads, arguments, schedule
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,decodes,lens", [
    ("1x32768", 0, (32768,)),
    ("16x512", 0, (512,) * 16),
    ("mixed", 0, (2048, 1024, 4096, 512, 512)),
    ("2048+1024+512", 0, (2048, 1024, 512)),
    ("d32", 32, ()),
    ("d32+4x512+7", 32, (512,) * 4 + (7,)),
    ("3+d2", 2, (3,)),
])
def test_parse_row(text, decodes, lens):
    row = L.parse_row(text)
    assert (row.name, row.decodes, row.prefill_lens) == (text, decodes, lens)
    assert row.tokens == decodes + sum(lens) and row.seqs == decodes + len(lens)
    assert row.decode_only == (not lens)


@pytest.mark.parametrize("text,spec,spec_len,lens", [
    ("s8x3", 8, 3, ()),
    ("s8x3+4x512", 8, 3, (512,) * 4),
    ("70+s2x4", 2, 4, (70,)),
])
def test_parse_spec_rows(text, spec, spec_len, lens):
    """sNxD: N spec decodes of D tokens, each with D slots (one per draft position)."""
    row = L.parse_row(text)
    assert (row.spec, row.spec_len, row.decodes, row.prefill_lens) == (spec, spec_len, 0, lens)
    assert row.tokens == spec * spec_len + sum(lens) and row.seqs == spec + len(lens)
    assert row.slots_per_set == spec * spec_len + len(lens) and row.decode_only == (not lens)
    assert L.seq_bounds(row)[:spec] == [(i * spec_len, (i + 1) * spec_len) for i in range(spec)]


@pytest.mark.parametrize("text", ["s2x1", "s0x3", "s2x3+s1x2", "s2x3+d1", "s2"])
def test_parse_spec_rows_rejects(text):
    """A spec decode has 1 + drafts >= 2 tokens; one spec item; no plain decodes beside spec ones
    (vLLM counts them as prefills there)."""
    with pytest.raises(ValueError, match="row"):
        L.parse_row(text)


@pytest.mark.parametrize("text", ["", "d0", "0x5", "x5", "3x", "d3+d4", "abc", "1x-2", "4+"])
def test_parse_row_rejects(text):
    with pytest.raises(ValueError, match="row"):
        L.parse_row(text)


def test_parse_heads():
    assert L.parse_heads("2/8,16/64") == [(2, 8), (16, 64)]
    for bad, msg in (("3/8", "multiple"), ("2-8", "Hk/Hv"), ("0/8", "Hk/Hv"), ("2/8/1", "Hk/Hv")):
        with pytest.raises(ValueError, match=msg):
            L.parse_heads(bad)


def _parser():
    p = argparse.ArgumentParser(prog="bench layer")
    L.add_arguments(p)
    return p


def test_arguments_defaults_and_values():
    a = _parser().parse_args([])
    assert (a.heads, a.rows, a.impls, a.states, a.prefill_states) == (
        None, None, ["qla", "fla", "flashinfer", "vllm"], ["fp32", "bf16"], ["fp32"])
    assert (a.pool, a.cp, a.check, a.json, a.plot) == ("paged", "auto", False, None, None)
    a = _parser().parse_args(["--heads", "4/16", "--rows", "mixed,d8+100", "--impls", "qla,fla",
                              "--states", "bf16", "--reps", "3", "--check", "--json", "x.json"])
    assert a.heads == [(4, 16)] and [r.name for r in a.rows] == ["mixed", "d8+100"]
    assert a.impls == ["qla", "fla"] and a.states == ["bf16"] and a.reps == 3 and a.check


@pytest.mark.parametrize("argv,needle", [
    (["--heads", "3/8"], "multiple"), (["--heads", "x"], "Hk/Hv"), (["--rows", "d0"], "row"),
    (["--rows", ","], "at least one row"), (["--impls", "qla,triton"], "impls"),
    (["--states", "fp16"], "states"), (["--prefill-states", ""], "prefill-states"),
    (["--reps", "0"], "not positive"), (["--graph-calls", "-1"], "not positive"),
    (["--pool", "flat"], "invalid choice"), (["--cp", "maybe"], "invalid choice"),
])
def test_argument_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_registered_in_the_cli(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "layer", "--help"])
    assert e.value.code == 0 and "--prefill-states" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["bench", "layer", "--rows", "d3+d4"])
    assert e.value.code == 2 and "more than one decode item" in capsys.readouterr().err


def test_schedule():
    pts = L.schedule(None, None, ["fp32", "bf16"], ["fp32"])
    pre = [(hk, hv, r.name) for hk, hv, r, st in pts if not r.decode_only]
    dec = [(hk, hv, r.name, st) for hk, hv, r, st in pts if r.decode_only]
    assert len(pre) == 3 * 5 + 1 and {(hk, hv) for hk, hv, _ in pre} == {(2, 8), (4, 16), (16, 64)}
    assert (2, 8, "s8x3+4x512") in pre
    assert [(hk, hv, n) for hk, hv, n, st in dec if st == "fp32"] == [
        (2, 8, "d1"), (2, 8, "d32"), (2, 8, "d256"), (2, 8, "s32x3"), (16, 32, "d64"), (16, 32, "d256")]
    assert len(dec) == 12
    only = L.schedule([(16, 32)], None, ["bf16"], ["fp32"])
    assert [(r.name, st) for _, _, r, st in only] == [("d64", "bf16"), ("d256", "bf16")]
    other = L.schedule([(8, 24)], None, ["fp32"], ["fp32"])
    assert [r.name for _, _, r, _ in other] == L.PREFILL_ROWS + ["d1", "d32", "d256"]
    rows = [L.parse_row("d4"), L.parse_row("100")]
    given = L.schedule(None, rows, ["fp32", "bf16"], ["bf16"])
    assert len(given) == 4 * 3 and {st for _, _, r, st in given if not r.decode_only} == {"bf16"}


def test_slot_sets_and_chunk_indices():
    f32 = torch.float32
    assert L.slot_sets_for(L.parse_row("1x8192"), 8, f32, 256 << 20) == 1
    assert L.slot_sets_for(L.parse_row("d1"), 8, f32, 256 << 20) == L.MAX_SLOT_SETS
    assert L.slot_sets_for(L.parse_row("d256"), 32, f32, 256 << 20) == 2
    assert L.slot_sets_for(L.parse_row("d32"), 8, torch.bfloat16, 256 << 20) == 32
    assert C.chunk_indices([70, 7, 1, 64]) == [0, 0, 0, 1, 1, 0, 2, 0, 3, 0]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_paged_caches_alias_one_page_per_slot(state_dtype):
    S, dim, hv = 5, 3 * 128, 2
    conv, ssm, (raw,) = L.make_caches(S, dim, hv, state_dtype, torch.bfloat16, "cpu")
    assert conv.shape == (S, dim, L.CONV_WIDTH - 1) and conv.stride(1) == 1   # transposed view
    assert ssm.shape == (S, hv, 128, 128) and ssm.stride(0) > hv * 128 * 128
    assert (ssm.stride(0) * ssm.element_size()) % 16 == 0 and ssm.storage_offset() * ssm.element_size() % 256 == 0
    ssm[3].fill_(1.0)
    conv[3].fill_(2.0)
    assert raw[3].any() and not raw[2].any() and not raw[4].any()
    conv2, ssm2, bufs = L.make_caches(S, dim, hv, state_dtype, torch.bfloat16, "cpu", "compact")
    assert ssm2.is_contiguous() and conv2.shape == conv.shape and len(bufs) == 2


# ---------------------------------------------------------------------------------------------
# Torch stand-ins for FLA's and FlashInfer's ops (CPU), from their documented contracts
# ---------------------------------------------------------------------------------------------

def _l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)      # FLA's l2norm (eps 1e-6)


def _recurrence(q, k, v, g, beta, h0, scale):
    """One sequence, float64: q, k [L, H, K]; v [L, HV, V]; log decay g, beta [L, HV]; h0 [HV, V, K]
    (V-first). S <- e^g S; S += beta (v - S k) k^T; o = scale S q. Returns (o [L, HV, V], S)."""
    S = h0.double().clone()
    rep = v.shape[1] // q.shape[1]
    q, k = (t.double().repeat_interleave(rep, dim=1) for t in (q, k))
    o = torch.zeros(v.shape, dtype=torch.float64)
    for t in range(v.shape[0]):
        S = S * torch.exp(g[t].double())[:, None, None]
        err = v[t].double() - torch.einsum("hvk,hk->hv", S, k[t])
        S = S + torch.einsum("hv,hk->hvk", beta[t].double()[:, None] * err, k[t])
        o[t] = scale * torch.einsum("hvk,hk->hv", S, q[t])
    return o, S


def _fla_chunk_indices(cu):
    """FLA's prepare_chunk_indices (fla/ops/utils/index.py), re-derived: (sequence, chunk) pairs."""
    counts = (cu[1:] - cu[:-1] + 63) // 64
    seg = torch.repeat_interleave(torch.arange(len(counts)), counts)
    start = torch.cumsum(counts, 0) - counts
    return torch.stack([seg, torch.arange(len(seg)) - start[seg]], 1)


def _bounds(cu):
    cu = cu.tolist()
    return list(zip(cu[:-1], cu[1:]))


def _act(y, activation):
    assert activation in ("silu", "swish")
    return F.silu(y)


def fla_causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None,
                      output_final_state=False, activation=None, backend="triton", cu_seqlens=None,
                      cu_seqlens_cpu=None, chunk_indices=None):
    """x [1, T, D] varlen by cu_seqlens; initial_state [N, D, W] (column c: input at time c - W)."""
    assert x.dim() == 3 and x.shape[0] == 1 and residual is None
    if chunk_indices is not None:
        assert torch.equal(chunk_indices.cpu(), _fla_chunk_indices(cu_seqlens.cpu())), "chunk_indices"
    D, W = weight.shape
    y, finals = torch.empty_like(x), []
    for i, (bos, eos) in enumerate(_bounds(cu_seqlens)):
        hist = initial_state[i].double() if initial_state is not None else torch.zeros(D, W, dtype=torch.float64)
        assert hist.shape == (D, W)
        full = torch.cat([hist, x[0, bos:eos].double().t()], 1)       # input at time tau: column tau + W
        for t in range(eos - bos):
            acc = (full[:, t + 1:t + 1 + W] * weight.double()).sum(-1) + bias.double()
            y[0, bos + t] = _act(acc, activation).to(x.dtype)
        finals.append(full[:, -W:].to(x.dtype))
    return y, (torch.stack(finals) if output_final_state else None)


def fla_causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None):
    """x [N, D]; cache [N, D, W] shifted left by one with x last, in place; y from the new cache."""
    assert x.dim() == 2 and cache.shape == (x.shape[0], x.shape[1], weight.shape[1]) and residual is None
    new = torch.cat([cache[..., 1:].double(), x.double()[..., None]], -1)
    y = _act((new * weight.double()).sum(-1) + bias.double(), activation).to(x.dtype)
    cache.copy_(new.to(cache.dtype))
    return y, cache


def fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None,
                               cu_seqlens_cpu=None, chunk_indices=None):
    """[1, T, H, D] inputs, log-space g, V-first [N, HV, V, K] states under state_v_first."""
    assert q.shape[0] == 1 and state_v_first and use_qk_l2norm_in_kernel and g.dtype == torch.float32
    assert torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
    assert torch.equal(chunk_indices.cpu(), _fla_chunk_indices(cu_seqlens_cpu)), "chunk_indices"
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, finals = torch.empty_like(v), []
    for i, (bos, eos) in enumerate(_bounds(cu_seqlens)):
        s = slice(bos, eos)
        oi, S = _recurrence(_l2(q[0, s].double()), _l2(k[0, s].double()), v[0, s], g[0, s], beta[0, s],
                            initial_state[i], scale)
        o[0, s] = oi.to(o.dtype)
        finals.append(S.float())
    return o, (torch.stack(finals) if output_final_state else None)


def fla_fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                         output_final_state=False, use_qk_l2norm_in_kernel=False,
                                         use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                         use_beta_sigmoid_in_kernel=False, state_v_first=False):
    """[B, T, H, D] inputs, one sequence per batch row; raw a/b with the gating in the kernel."""
    assert state_v_first and use_gate_in_kernel and use_beta_sigmoid_in_kernel and use_qk_l2norm_in_kernel
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    gl = -torch.exp(A_log.double()) * F.softplus(g.double() + dt_bias.double())
    bt = torch.sigmoid(beta.double())
    o, finals = torch.empty_like(v), []
    for i in range(q.shape[0]):
        oi, S = _recurrence(_l2(q[i].double()), _l2(k[i].double()), v[i], gl[i], bt[i], initial_state[i], scale)
        o[i] = oi.to(o.dtype)
        finals.append(S.float())
    return o, torch.stack(finals)


def fi_chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                              output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                              output=None, output_state=None, state_indices=None):
    """[T, H, D] inputs, linear-space alpha, pool [S, HV, V, K] read and written at state_indices."""
    assert g.dtype == beta.dtype == torch.float32 and use_qk_l2norm_in_kernel and output_state is initial_state
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    for i, (bos, eos) in enumerate(_bounds(cu_seqlens)):
        s, slot = slice(bos, eos), int(state_indices[i])
        oi, S = _recurrence(_l2(q[s].double()), _l2(k[s].double()), v[s], torch.log(g[s].double()),
                            beta[s], initial_state[slot], scale)
        output[s] = oi.to(output.dtype)
        output_state[slot] = S.to(output_state.dtype)
    return output, output_state


def fi_decode(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True,
              initial_state=None, initial_state_indices=None):
    """q, k [B, 1, H, K]; raw a, b [B, 1, HV]; pool [S, HV, V, K] updated in place at the indices."""
    assert state is None and use_qk_l2norm and q.is_contiguous() and output.shape == v.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    gl = -torch.exp(A_log.double()) * F.softplus(a.double() + dt_bias.double())
    for i in range(q.shape[0]):
        slot = int(initial_state_indices[i])
        oi, S = _recurrence(_l2(q[i].double()), _l2(k[i].double()), v[i], gl[i], torch.sigmoid(b[i].double()),
                            initial_state[slot], scale)
        output[i] = oi.to(output.dtype)
        initial_state[slot] = S.to(initial_state.dtype)
    return output, initial_state


# vLLM 0.33.0's ops (its wheel: vllm/model_executor/layers/mamba/ops/causal_conv1d.py and
# vllm/third_party/flash_linear_attention/ops/{fused_gdn_prefill_post_conv,fused_recurrent,
# fused_sigmoid_gating}.py): Triton kernels, GPU only, so torch stand-ins from those contracts.

def _conv_row(window, weight, bias, activation):
    """One token's conv from its W inputs [D, W] (oldest first)."""
    return _act((window.double() * weight.double()).sum(-1) + bias.double(), activation)


def vllm_causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None,
                          has_initial_state=None, activation="silu", metadata=None, **kw):
    """x [D, T] (a transposed [T, D]); conv_states [S, D, W-1] read where has_initial_state (else
    zeros) and rewritten with each sequence's last W-1 inputs; returns [D, T] like x."""
    assert x.stride(0) == 1 and not kw, "channel-last x, no other arguments"
    lens = query_start_loc.diff()
    assert metadata.nums_dict[8]["tot"] == int((-(-lens // 8)).sum()), "conv metadata"
    assert torch.equal(metadata.batch_ptr[:metadata.nums_dict[8]["mlist_len"]].cpu(),
                       torch.repeat_interleave(torch.arange(len(lens)), -(-lens // 8)).int()), "batch_ptr"
    return _varlen_conv(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation)


def sglang_causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, seq_lens_cpu, cache_indices=None,
                            has_initial_state=None, activation="silu", **kw):
    """SGLang's Triton causal_conv1d_fn (kernels/ops/mamba/causal_conv1d_triton.py): vLLM's contract,
    with the host lengths instead of a metadata table."""
    assert not kw and list(seq_lens_cpu) == query_start_loc.diff().tolist(), "seq_lens_cpu"
    return _varlen_conv(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation)


def _varlen_conv(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation):
    """The state's first W-1 columns (vLLM's causal_conv1d_fn: state_len = width - 1, also where the
    state holds more columns for speculative decoding)."""
    W = weight.shape[1]
    out = torch.empty_like(x)
    for i, (bos, eos) in enumerate(_bounds(query_start_loc)):
        slot = int(cache_indices[i])
        hist = conv_states[slot][:, :W - 1].double() if has_initial_state[i] else torch.zeros(
            x.shape[0], W - 1, dtype=torch.float64)
        full = torch.cat([hist, x[:, bos:eos].double()], 1)
        for t in range(eos - bos):
            out[:, bos + t] = _conv_row(full[:, t:t + W], weight, bias, activation).to(x.dtype)
        conv_states[slot][:, :W - 1] = full[:, -(W - 1):].to(conv_states.dtype)
    return out


def vllm_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                              num_accepted_tokens=None, query_start_loc=None, max_query_len=-1,
                              validate_data=False):
    """x [B, D], one token per row; the slot's window shifts by one in place; the output is written
    over x (vLLM's with out=None) and returned. With num_accepted_tokens (speculative decoding,
    varlen by query_start_loc): sequence i's history is its state's columns [n - 1, n + W - 2)
    (n = num_accepted_tokens[i]), and afterwards columns [0, W - 2 + L) hold the last W - 2
    history inputs and its L tokens (the sliding window: the next step resumes at its accepted
    token)."""
    if num_accepted_tokens is not None:
        return _spec_conv_update(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
                                 query_start_loc, max_query_len)
    y = x
    for i in range(x.shape[0]):
        slot = int(conv_state_indices[i])
        full = torch.cat([conv_state[slot].double(), x[i].double()[:, None]], 1)
        y[i] = _conv_row(full, weight, bias, activation).to(x.dtype)      # (x[i] is in full already)
        conv_state[slot] = full[:, 1:].to(conv_state.dtype)
    return y


def _spec_conv_update(x, conv_state, weight, bias, activation, ids, accepted, query_start_loc, max_query_len):
    W = weight.shape[1]
    assert conv_state.shape[-1] >= W - 1 + max_query_len - 1
    y = x
    for i, (bos, eos) in enumerate(_bounds(query_start_loc)):
        slot, n = int(ids[i]), int(accepted[i])
        full = torch.cat([conv_state[slot][:, n - 1:n - 1 + W - 1].double(), x[bos:eos].double().T], 1)
        for t in range(eos - bos):
            y[bos + t] = _conv_row(full[:, t:t + W], weight, bias, activation).to(x.dtype)
        conv_state[slot][:, :W - 2 + eos - bos] = full[:, 1:].to(conv_state.dtype)
    return y


def vllm_post_conv_prep(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim,
                        apply_l2norm=True, output_g_exp=False):
    """[L, qkv_dim] -> q, k [L, H, K] (l2-normalised), v [L, HV, V], log-space g and beta fp32."""
    assert apply_l2norm and not output_g_exp and conv_output.is_contiguous()
    L_, kd = conv_output.shape[0], num_k_heads * head_k_dim
    y = conv_output.double()
    q = _l2(y[:, :kd].view(L_, num_k_heads, head_k_dim)).to(conv_output.dtype)
    k = _l2(y[:, kd:2 * kd].view(L_, num_k_heads, head_k_dim)).to(conv_output.dtype)
    v = conv_output[:, 2 * kd:].reshape(L_, -1, head_v_dim).clone()
    g = (-torch.exp(A_log.double()) * F.softplus(a.double() + dt_bias.double())).float()
    return q, k, v, g, torch.sigmoid(b.double()).float()


def vllm_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
                       use_qk_l2norm_in_kernel=False):
    """One token per row from the conv output [B, qkv_dim]; V-first pool updated in place at the
    row's slot; slot <= 0 (vLLM's null block): zero output, pool untouched."""
    assert use_qk_l2norm_in_kernel and out.shape == (mixed_qkv.shape[0], 1) + tuple(initial_state.shape[1:3])
    HV, V, K = initial_state.shape[1:]
    H = (mixed_qkv.shape[1] - HV * V) // (2 * K)
    gl = -torch.exp(A_log.double()) * F.softplus(a.double() + dt_bias.double())
    for i in range(mixed_qkv.shape[0]):
        slot = int(ssm_state_indices[i])
        if slot <= 0:
            out[i].zero_()
            continue
        x = mixed_qkv[i].double()
        q, k = x[:H * K].view(1, H, K), x[H * K:2 * H * K].view(1, H, K)
        oi, S = _recurrence(_l2(q), _l2(k), x[2 * H * K:].view(1, HV, V), gl[i:i + 1],
                            torch.sigmoid(b[i:i + 1].double()), initial_state[slot], scale)
        out[i] = oi.to(out.dtype)
        initial_state[slot] = S.to(initial_state.dtype)
    return out, initial_state


def vllm_sigmoid_gating_update(A_log, a, b, dt_bias, q, k, v, beta=1.0, threshold=20.0, scale=None,
                               initial_state=None, inplace_final_state=True, cu_seqlens=None,
                               ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                               is_kda=False):
    """q, k [1, T, H, K], v [1, T, HV, V] packed by cu_seqlens; sequence i's state at
    ssm_state_indices[i], updated in place; raw a, b gated in the kernel. Speculative decoding
    (num_accepted_tokens, ssm_state_indices [N, 1 + drafts]): sequence i starts from the state at
    ssm_state_indices[i, n - 1] (n = num_accepted_tokens[i]) and the state after its token t goes
    to ssm_state_indices[i, t]."""
    assert inplace_final_state and use_qk_l2norm_in_kernel and q.shape[0] == 1
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert (num_accepted_tokens is None) == (ssm_state_indices.dim() == 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    gl = -torch.exp(A_log.double()) * F.softplus(a.double() + dt_bias.double())
    o = torch.empty_like(v)
    for i, (bos, eos) in enumerate(_bounds(cu_seqlens)):
        if num_accepted_tokens is None:
            s, slot = slice(bos, eos), int(ssm_state_indices[i])
            oi, S = _recurrence(_l2(q[0, s].double()), _l2(k[0, s].double()), v[0, s], gl[s],
                                torch.sigmoid(b[s].double()), initial_state[slot], scale)
            o[0, s] = oi.to(o.dtype)
            initial_state[slot] = S.to(initial_state.dtype)
            continue
        S = initial_state[int(ssm_state_indices[i, int(num_accepted_tokens[i]) - 1])]
        for t in range(bos, eos):
            s = slice(t, t + 1)
            oi, S = _recurrence(_l2(q[0, s].double()), _l2(k[0, s].double()), v[0, s], gl[s],
                                torch.sigmoid(b[s].double()), S, scale)
            o[0, s] = oi.to(o.dtype)
            initial_state[int(ssm_state_indices[i, t - bos])] = S.to(initial_state.dtype)
    return o, initial_state


def vllm_fi_chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                   output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                                   state_checkpoints=None, checkpoint_cu_starts=None,
                                   checkpoint_every_n_tokens=0, use_cp="auto", backend="flashinfer"):
    """FlashInfer's prefill as vLLM's wrapper calls it: [T, H, D] contiguous, already l2-normalised,
    linear-space alpha, one fp32 initial state per sequence; returns (o, final states)."""
    assert not use_qk_l2norm_in_kernel and output_final_state and state_checkpoints is None
    assert cu_seqlens.dtype == torch.int64 and initial_state.dtype == g.dtype == beta.dtype == torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, finals = torch.empty_like(v), []
    for i, (bos, eos) in enumerate(_bounds(cu_seqlens)):
        s = slice(bos, eos)
        oi, S = _recurrence(q[s], k[s], v[s], torch.log(g[s].double()), beta[s], initial_state[i], scale)
        o[s] = oi.to(o.dtype)
        finals.append(S.float())
    return o, torch.stack(finals)


def sglang_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                                validate_data=False):
    """SGLang's update: vLLM's contract, output in a new tensor (x is not written)."""
    return vllm_causal_conv1d_update(x.clone(), conv_state, weight, bias, activation, conv_state_indices)


def sglang_proj_split(qkvz, ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """SGLang's fused_qkvzba_split_reshape_cat_contiguous: [q|k|v|z], [b|a] -> new mixed_qkv [T,
    dim], z [T, Hv, 128], b, a [T, Hv]."""
    dim = (2 * num_heads_qk * head_qk) + num_heads_v * head_v
    return (qkvz[:, :dim].clone(), qkvz[:, dim:].reshape(-1, num_heads_v, head_v).clone(),
            ba[:, :num_heads_v].clone(), ba[:, num_heads_v:].clone())


def sglang_proj_conv(qkvz, ba, conv_state, conv_weight, conv_bias, conv_state_indices, *, qkv_dim, v_dim,
                     num_v_heads, head_v_dim, activation, pad_slot_id=-1):
    """SGLang's fused_qkvzba_causal_conv1d_update_contiguous: the split, then the conv update."""
    assert qkvz.shape[1] == qkv_dim + v_dim and v_dim == num_v_heads * head_v_dim
    num_heads_qk = (qkv_dim - v_dim) // (2 * head_v_dim)          # (q/k heads have the v heads' dim)
    x, z, b, a = sglang_proj_split(qkvz, ba, num_heads_qk, num_v_heads, head_v_dim, head_v_dim)
    return vllm_causal_conv1d_update(x, conv_state, conv_weight, conv_bias, activation, conv_state_indices), z, b, a


def sglang_qkv_split(mixed_qkv, num_q_heads, num_k_heads, num_v_heads, head_q, head_k, head_v):
    """SGLang's fused_qkv_split_gdn_prefill: [T, q|k|v] -> contiguous q, k, v [1, T, H, D]."""
    T, qd, kd = mixed_qkv.shape[0], num_q_heads * head_q, num_k_heads * head_k
    return (mixed_qkv[:, :qd].reshape(1, T, num_q_heads, head_q).clone(),
            mixed_qkv[:, qd:qd + kd].reshape(1, T, num_k_heads, head_k).clone(),
            mixed_qkv[:, qd + kd:].reshape(1, T, num_v_heads, head_v).clone())


def sglang_fi_chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                                     output=None, output_state=None, state_checkpoints=None,
                                     checkpoint_cu_starts=None, checkpoint_every_n_tokens=0):
    """FlashInfer's prefill as SGLang's SM90 wrapper calls it (kernels/gdn_flashinfer.py:566-582):
    [T, H, D] already l2-normalised, linear-space alpha, one fp32 initial state per sequence, the
    output and final states written into ``output`` / ``output_state``."""
    assert not use_qk_l2norm_in_kernel and output_final_state and state_checkpoints is None
    assert cu_seqlens.dtype == torch.int64 and initial_state.dtype == g.dtype == beta.dtype == torch.float32
    assert output_state.shape == initial_state.shape and output.shape == v.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    for i, (bos, eos) in enumerate(_bounds(cu_seqlens)):
        s = slice(bos, eos)
        oi, S = _recurrence(q[s], k[s], v[s], torch.log(g[s].double()), beta[s], initial_state[i], scale)
        output[s] = oi.to(output.dtype)
        output_state[i] = S.float()
    return output, output_state


def sglang_qk_prepare(q, k, v):
    """SGLang's gdn_prefill_qkv_prepare_fwd: L2-normalised q, k (in q's dtype) and v, [T, H, D]."""
    return _l2(q.double()).to(q.dtype), _l2(k.double()).to(k.dtype), v


def sglang_gating(A_log, a, b, dt_bias):
    """SGLang's fused_gdn_gating: fp32 g, beta [1, T, Hv]."""
    g = -torch.exp(A_log.double()) * F.softplus(a.double() + dt_bias.double())
    return g.float()[None], torch.sigmoid(b.double()).float()[None]


def standin_ops(impl):
    if impl in C.PROJECTION_IMPLS:
        return C.ComposedOps(None, None, packed_decode=vllm_packed_decode, proj_conv=sglang_proj_conv,
                             proj_split=sglang_proj_split)
    if impl == "sglang":
        return C.ComposedOps(sglang_causal_conv1d_fn, sglang_causal_conv1d_update, packed_decode=vllm_packed_decode,
                             qkv_split=sglang_qkv_split, gating=sglang_gating, qk_prepare=sglang_qk_prepare,
                             fi_chunk_gated_delta_rule=sglang_fi_chunk_gated_delta_rule)
    if impl == "sglang_qla":
        return C.ComposedOps(sglang_causal_conv1d_fn, sglang_causal_conv1d_update, qkv_split=sglang_qkv_split,
                             gating=sglang_gating)
    if impl == "vllm":
        return C.ComposedOps(vllm_causal_conv1d_fn, vllm_causal_conv1d_update,
                             fi_chunk_gated_delta_rule=vllm_fi_chunk_gated_delta_rule,
                             post_conv_prep=vllm_post_conv_prep, packed_decode=vllm_packed_decode,
                             sigmoid_gating_update=vllm_sigmoid_gating_update)
    conv = (fla_causal_conv1d, fla_causal_conv1d_update)
    if impl == "fla":
        return C.ComposedOps(*conv, fla_chunk_gated_delta_rule, fla_fused_recurrent_gated_delta_rule)
    return C.ComposedOps(*conv, fi_chunk_gated_delta_rule=fi_chunk_gated_delta_rule, fi_decode=fi_decode)


# ---------------------------------------------------------------------------------------------
# The composed layers against qla_serve's CPU path (gdn_layer_forward)
# ---------------------------------------------------------------------------------------------

def _case(state_dtype=torch.float32, io_dtype=torch.float32, row="d3+70+9+1+2", layout="paged", nsets=2):
    return L.LayerCase(2, 4, L.parse_row(row), state_dtype, "cpu", nsets=nsets, seed=1, io_dtype=io_dtype,
                       layout=layout)


def _calls(case, impls=("qla", "fla", "flashinfer", "vllm"), ops=None):
    calls = {}
    for impl in impls:
        if impl == "qla":
            calls[impl] = L.qla_call(case, L.qla_step(case, 0))
        else:
            calls[impl] = C.composed_call(impl, case, C.composed_step(case, 0, impl), (ops or standin_ops)(impl))
    return calls


def test_case_inputs_are_realistic():
    case = _case()
    g = -torch.exp(case.A_log) * F.softplus(case.a.float() + case.dt_bias)
    assert (g <= 0).all() and g.min() > -3 and (g[:, 0].abs() < 1e-4).all() and (g[:, 1:].abs() > 1e-6).all()
    assert (case.mixed_qkv != 0).all() and case.mixed_qkv.float().std() > 0.5
    assert (case.ssm_state[1:] != 0).all() and (case.conv_state[1:] != 0).all()
    flat = [s for ids in case.slot_sets for s in ids]
    assert len(set(flat)) == len(flat) and L.NULL_SLOT not in flat
    assert case.ssm_state.shape[0] > len(flat)
    assert case.has_initial_state == [True, False, True, False]


@pytest.mark.parametrize("layout", ["paged", "compact"])
def test_composed_layers_match_qla_fp32(layout):
    """fp32 everywhere: qla_serve's CPU path (chunked reference) and the composed layers on the
    stand-ins (float64 recurrence) agree to fp32 rounding: outputs, SSM states and conv states of
    every sequence (3 decodes, a resumed 70-token prefill over two FLA chunks, a new 9-token one, a
    resumed 1-token one, a new 2-token one)."""
    case = _case(layout=layout)
    snap = case.snapshot()
    rec = L.run_check(case, _calls(case))
    assert all(torch.equal(b, s) for b, s in zip(case.buffers, snap)), "run_check must restore the caches"
    for impl in ("fla", "flashinfer", "vllm"):
        assert set(rec[impl]) == {"o_rel", "ssm_rel", "conv_rel"}, rec[impl]
        assert rec[impl]["o_rel"] < 2e-5 and rec[impl]["ssm_rel"] < 2e-5, rec[impl]
        assert rec[impl]["conv_rel"] < 1e-6, rec[impl]


def test_decay_draws():
    """--decay init draws bench prefill's decay rates, A = exp(A_log) in [1, 16] (the models' code
    initialises A ~ U(0, 16)); weak
    (the default) A in [e^-1, e^0.5]; a quarter of the heads at A_log = -12 in both."""
    weak, init = (L.LayerCase(2, 8, L.parse_row("d2"), torch.float32, "cpu", decay=d) for d in ("weak", "init"))
    for case, lo, hi in ((weak, math.exp(-1), math.exp(0.5)), (init, 1.0, 16.0)):
        A = torch.exp(case.A_log)
        assert (case.A_log[:2] == -12).all() and (A[2:] >= lo).all() and (A[2:] <= hi).all()
    assert torch.exp(init.A_log[2:]).mean() > 3 * torch.exp(weak.A_log[2:]).mean()
    with pytest.raises(ValueError, match="^decay: expected one of"):
        L.LayerCase(2, 8, L.parse_row("d2"), torch.float32, "cpu", decay="strong")
    assert _parser().parse_args(["--decay", "init"]).decay == "init" and _parser().parse_args([]).decay == "weak"


def test_composed_layers_match_qla_decode_only():
    """A decode-only step (each composition's decode path: vLLM's takes its packed decode kernel,
    not the conv over every row): fp32, as above."""
    case = _case(row="d5")
    x0 = case.mixed_qkv.clone()
    rec = L.run_check(case, _calls(case))
    assert torch.equal(case.mixed_qkv, x0), "vLLM's conv update writes over its own copy only"
    for impl in ("fla", "flashinfer", "vllm"):
        assert rec[impl]["o_rel"] < 2e-5 and rec[impl]["ssm_rel"] < 2e-5 and rec[impl]["conv_rel"] < 1e-6, rec[impl]


@pytest.mark.parametrize("state_dtype,io_dtype,tol", [(torch.float32, torch.float32, 2e-5),
                                                       (torch.bfloat16, torch.bfloat16, 2e-2)])
def test_sglang_decode_steps_match_qla(state_dtype, io_dtype, tol):
    """SGLang's decode step, with its own decode and with qla_serve's SGLang kernel, on SGLang's cache
    layout (conv [S, dim, W-1] window-contiguous), against qla's layer on the same layout; neither
    writes outside the step's slots nor over the layer's input."""
    case = _case(state_dtype, io_dtype, row="d5", layout="sglang")
    assert case.conv_state.is_contiguous() and case.conv_state.shape[1:] == (case.dim, L.CONV_WIDTH - 1)
    x0, ssm0, conv0 = case.mixed_qkv.clone(), case.ssm_state.clone(), case.conv_state.clone()
    rec = L.run_check(case, _calls(case, ("qla", "sglang", "sglang_qla")))
    for impl in ("sglang", "sglang_qla"):
        assert max(rec[impl].values()) < tol, (impl, rec[impl])
    assert torch.equal(case.mixed_qkv, x0)
    _calls(case, ("sglang_qla",))["sglang_qla"]()
    live = set(case.slot_sets[0])
    for s in range(case.ssm_state.shape[0]):
        same = torch.equal(case.ssm_state[s], ssm0[s]) and torch.equal(case.conv_state[s], conv0[s])
        assert same == (s not in live), s


@pytest.mark.parametrize("state_dtype,io_dtype,tol", [(torch.float32, torch.float32, 2e-5),
                                                       (torch.bfloat16, torch.bfloat16, 2e-2)])
def test_qwen35_decode_routes_match_qla(state_dtype, io_dtype, tol):
    """Qwen3.5's decode from the projections (qkvz = [q|k|v|z], ba = [b|a]): SGLang's fused split +
    conv with its decode or flashqla's, and SGLang's split before qla_serve's layer, against qla's
    layer on mixed_qkv, a, b; the projections hold exactly the case's inputs."""
    case = _case(state_dtype, io_dtype, row="d5", layout="sglang")
    qkvz, ba = C.qwen35_projections(case)
    assert torch.equal(qkvz[:, :case.dim], case.mixed_qkv) and torch.equal(ba, torch.cat([case.b, case.a], 1))
    rec = L.run_check(case, _calls(case, ("qla", *C.PROJECTION_IMPLS)))
    for impl in C.PROJECTION_IMPLS:
        assert max(rec[impl].values()) < tol, (impl, rec[impl])


@pytest.mark.parametrize("state_dtype,io_dtype,tol", [(torch.float32, torch.float32, 2e-5),
                                                       (torch.bfloat16, torch.bfloat16, 2e-2)])
def test_sglang_extends_match_qla(state_dtype, io_dtype, tol):
    """SGLang's extend with flashqla (its conv, split and gating, then the kernel class's extend on its
    batch plan) and SGLang's own (the same, then FlashInfer's prefill through its SM90 wrapper) on
    prefill-only rows: resumed and new requests of 70, 9, 1 and 2 tokens, against qla's layer on
    the same layout; outputs, SSM and conv states."""
    case = _case(state_dtype, io_dtype, row="70+9+1+2", layout="sglang")
    rec = L.run_check(case, _calls(case, ("qla", "sglang_qla", "sglang")))
    for impl in ("sglang_qla", "sglang"):
        assert max(rec[impl].values()) < tol, (impl, rec[impl])


def test_sglang_extend_without_flashinfer_is_refused():
    """SGLang's own extend runs FlashInfer's prefill (its SM90 default): where FlashInfer does not
    import, its rows are refused by name, not run another way."""
    case = _case(row="40+3", layout="sglang")
    import dataclasses

    ops = dataclasses.replace(standin_ops("sglang"), fi_chunk_gated_delta_rule=None)
    with pytest.raises(NotImplementedError, match="^sglang on prefill rows: needs FlashInfer"):
        _calls(case, ("sglang",), ops=lambda impl: ops)["sglang"]()


def test_sglang_impls_refuse_what_they_do_not_compose():
    """Prefill rows for SGLang's own (its FlashInfer prefill wrapper is not composed), mixed rows
    for sglang_qla (SGLang runs decodes and extends apart), vLLM's paged pool: a clear error each
    (recorded per impl by the bench)."""
    with pytest.raises(NotImplementedError, match="^sglang: decode-only or prefill-only rows"):
        _calls(_case(row="d2+40", layout="sglang"), ("sglang",))["sglang"]()
    with pytest.raises(NotImplementedError, match="^sglang_qla: decode-only or prefill-only rows"):
        _calls(_case(row="d2+40", layout="sglang"), ("sglang_qla",))["sglang_qla"]()
    with pytest.raises(ValueError, match=r"^sglang_qla: runs on SGLang's cache layout \(--pool sglang\)"):
        _calls(_case(row="d2"), ("sglang_qla",))
    assert "sglang" not in _parser().parse_args([]).impls
    assert _parser().parse_args(["--impls", "qla,sglang", "--pool", "sglang"]).impls == ["qla", "sglang"]


def test_composed_layers_match_qla_bf16():
    """bf16 inputs, conv cache and SSM pool (the GPU rows' dtypes): the same within bf16 rounding."""
    rec = L.run_check(*(lambda c: (c, _calls(c)))(_case(torch.bfloat16, torch.bfloat16)))
    for impl in ("fla", "flashinfer", "vllm"):
        assert max(rec[impl].values()) < 2e-2, rec[impl]


def test_composed_layers_update_only_their_slots():
    """The composed layers write the step's slots and nothing else (other slot sets, spare slots,
    the null slot), like qla_serve's layer."""
    for impl in ("fla", "flashinfer", "vllm"):
        case = _case(nsets=2)
        ssm0, conv0 = case.ssm_state.clone(), case.conv_state.clone()
        _calls(case, (impl,))[impl]()
        live = set(case.slot_sets[0])
        for s in range(case.ssm_state.shape[0]):
            same = torch.equal(case.ssm_state[s], ssm0[s]) and torch.equal(case.conv_state[s], conv0[s])
            assert same == (s not in live), (impl, s)
        assert torch.isfinite(case.out).all()


@pytest.mark.parametrize("row", ["s3x3", "s2x4+70+9"])
@pytest.mark.parametrize("layout", ["paged", "compact"])
def test_vllm_spec_steps_match_qla(row, layout):
    """vLLM's MTP steps (spec decodes alone, and beside a resumed 70-token and a new 9-token
    prefill): its Triton spec path composed on the stand-ins (the sliding-window conv from
    num_accepted - 1, each draft token's state into its own slot, the gathers and the scatter by
    the token indices) against qla_serve's CPU path through gdn_layer_forward on the step the vLLM
    adapter hands it (no token indices): outputs, every slot's SSM state and conv state agree to
    fp32 rounding, and only the step's slots change."""
    case = _case(row=row, layout=layout)
    assert case.conv_state.shape[-1] == L.CONV_WIDTH - 1 + case.row.spec_len - 1
    ssm0, conv0 = case.ssm_state.clone(), case.conv_state.clone()
    rec = L.run_check(case, _calls(case, ("qla", "vllm")))
    assert set(rec["vllm"]) == {"o_rel", "ssm_rel", "conv_rel"}, rec["vllm"]
    assert rec["vllm"]["o_rel"] < 2e-5 and rec["vllm"]["ssm_rel"] < 2e-5, rec["vllm"]
    assert rec["vllm"]["conv_rel"] < 1e-6, rec["vllm"]
    _calls(case, ("vllm",))["vllm"]()
    live = set(case.slot_sets[0])
    for s in range(case.ssm_state.shape[0]):
        if s not in live:
            assert torch.equal(case.ssm_state[s], ssm0[s]) and torch.equal(case.conv_state[s], conv0[s]), s
    spec_slots = case.slot_sets[0][:case.row.spec_tokens]
    assert all(not torch.equal(case.ssm_state[s], ssm0[s]) for s in spec_slots), "every draft position written"


def test_spec_rows_are_refused_by_the_other_compositions():
    """FLA's, FlashInfer's and SGLang's compositions have no speculative step: a clear error when
    called (recorded per impl by the bench), the step still built."""
    case = _case(row="s2x3+40")
    for impl in ("fla", "flashinfer"):
        with pytest.raises(NotImplementedError, match=f"^{impl}: composes no speculative"):
            _calls(case, (impl,))[impl]()


def test_check_sees_a_wrong_composition():
    """A composition error (the state handed over K-first instead of V-first) is a large difference."""
    def transposed(impl):
        ops = standin_ops(impl)

        def chunk(q, k, v, g, beta, initial_state=None, **kw):
            o, ht = fla_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state.transpose(-1, -2),
                                               **kw)
            return o, ht.transpose(-1, -2)
        return C.ComposedOps(ops.causal_conv1d, ops.causal_conv1d_update, chunk,
                             ops.fused_recurrent_gated_delta_rule)

    case = _case(row="40+8")                                    # a resumed and a new prefill
    rec = L.run_check(case, _calls(case, ("qla", "fla"), transposed))
    assert rec["fla"]["ssm_rel"] > 0.1 and rec["fla"]["o_rel"] > 1e-2


def test_check_reports_errors_per_impl():
    case = _case(row="d2")

    def broken():
        raise RuntimeError("boom")

    rec = L.run_check(case, {"qla": _calls(case, ("qla",))["qla"], "fla": broken})
    assert rec == {"fla": {"error": "RuntimeError: boom"}}


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

def test_tables():
    results = [{
        "heads": "2/8", "row": "d32", "state": "fp32", "qla_over_fla": 0.5,
        "impls": {"qla": {"gpu_us": 10.0, "timing": "graph", "host_wall_us": 80.0, "host_issue_us": 60.0,
                          "plan_host_us": 20.0},
                  "fla": {"gpu_us": 20.0, "timing": "graph", "host_wall_us": 90.0, "host_issue_us": 70.0,
                          "plan_host_us": 15.0},
                  "flashinfer": {"gpu_us": None, "timing": "n/a", "gpu_na": "not capturable: X",
                                 "host_wall_us": 50.0, "host_issue_us": 40.0, "plan_host_us": 15.0}},
        "check": {"fla": {"o_rel": 1e-3, "ssm_rel": 2e-3, "conv_rel": 0.0},
                  "flashinfer": {"error": "ValueError: no"}},
    }, {"heads": "4/16", "row": "1x8192", "state": "fp32",
        "impls": {"flashinfer": {"error": "not installed (ModuleNotFoundError: flashinfer)"}}}]
    t = L.format_table(results)
    assert "| 2/8 | d32 | fp32 | fla | 20.0 | graph | 90.0 | 70.0 | 15.0 | 0.500 |" in t
    assert "| flashinfer | n/a | n/a |" in t and "not capturable: X" in t and "not installed" in t
    c = L.format_check(results)
    assert "| 2/8 | d32 | fp32 | fla | 1.00e-03 | 2.00e-03 | 0.00e+00 |" in c and "ValueError: no" in c


# ---------------------------------------------------------------------------------------------
# The per-point plumbing with the GPU timing helpers stubbed (the figures themselves need a GPU)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def stub_gpu(monkeypatch):
    """torch.cuda.synchronize as a no-op and the timing helpers as stubs that run the calls once;
    the fourth graph (flashinfer, after qla's layer and step-id graphs and fla's) fails to capture."""
    from qla_serve.bench import decode as bdec
    from qla_serve.bench import prefill as bpre

    graphs = []

    def graph_time_us(torch_, fns, reps):
        graphs.append(len(fns))
        if len(graphs) == 4:
            raise RuntimeError("operation not permitted when stream is capturing")
        for f in fns:
            f()
        return 7.0 * len(graphs)

    def gpu_time_ms(fn, reps, graph_calls):
        fn()
        return 0.5, "graph", None

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bdec, "L2_FLUSH_BYTES", 1 << 20)
    monkeypatch.setattr(bdec, "_graph_time_us", graph_time_us)
    monkeypatch.setattr(bpre, "_gpu_time_ms", gpu_time_ms)
    monkeypatch.setattr(bpre, "_kernel_sum_ms", lambda fn, reps: 0.012)
    return graphs


def _args(*extra):
    return _parser().parse_args(["--host-reps", "2", "--plan-reps", "2", "--reps", "2", *extra])


@pytest.mark.parametrize("row", ["s2x3", "s2x3+40"])
def test_run_point_spec(stub_gpu, row):
    """A spec row through the bench (timing stubbed): qla and vllm timed and checked against each
    other, fla refusing it by name; a spec-only row takes the decode rows' graph timing."""
    ops = {i: standin_ops(i) for i in ("fla", "vllm")}
    rec = L.run_point(2, 4, L.parse_row(row), "fp32", _args("--check", "--impls", "qla,fla,vllm"), ops, {},
                      device="cpu")
    assert (rec["spec_decodes"], rec["tokens"]) == (2, 6 + ("+40" in row) * 40)
    assert rec["impls"]["qla"]["timing"] == "graph" and rec["impls"]["vllm"]["gpu_us"] > 0
    assert rec["impls"]["fla"]["error"].startswith("NotImplementedError: fla: composes no speculative")
    assert set(rec["check"]) == {"fla", "vllm"} and "composes no speculative" in rec["check"]["fla"]["error"]
    c = rec["check"]["vllm"]      # bf16 activations (the bench's): bf16 rounding, as the other rows' checks
    assert c["o_rel"] < 2e-2 and c["ssm_rel"] < 2e-2 and c["conv_rel"] < 1e-6, c


def test_spec_rows_refused_on_sglangs_pool(monkeypatch, capsys):
    """Spec rows are vLLM's MTP steps: asked for on SGLang's pool they are refused (exit 2) before
    anything runs; the default rows there leave them out."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert L.run(_parser().parse_args(["--pool", "sglang", "--rows", "d2,s2x3"])) == 2
    assert "rows with spec decodes (sNxD) are vLLM's MTP steps" in capsys.readouterr().out


def test_run_point_decode(stub_gpu):
    ops = {i: standin_ops(i) for i in ("fla", "flashinfer")}
    rec = L.run_point(2, 4, L.parse_row("d3"), "fp32", _args("--check"), ops, {}, device="cpu")
    assert (rec["heads"], rec["row"], rec["state"], rec["tokens"], rec["decodes"]) == ("2/4", "d3", "fp32", 3, 3)
    assert stub_gpu == [2, L.STEP_IDS_PER_GRAPH, 2, 2]   # a graph of 2 slot sets per impl; qla's step ids
    q, f, fi = (rec["impls"][i] for i in ("qla", "fla", "flashinfer"))
    assert (q["gpu_us"], q["timing"], f["gpu_us"], q["slot_sets"]) == (7.0, "graph", 21.0, 2)
    assert q["step_ids_gpu_us"] == 14.0 and "step_ids_gpu_us" not in f
    assert rec["qla_over_fla"] == 0.333 and "qla_over_flashinfer" not in rec
    assert fi["gpu_us"] is None and fi["timing"] == "n/a" and "stream is capturing" in fi["gpu_na"]
    assert fi["profiler_us"] == 12.0
    for x in (q, f, fi):
        assert x["host_wall_us"] >= x["host_issue_us"] > 0 and x["plan_host_us"] > 0
    assert max(v for c in rec["check"].values() for v in c.values()) < 2e-5


def test_run_point_prefill_and_missing_impl(stub_gpu):
    ops = {"fla": standin_ops("fla")}
    missing = {"flashinfer": "not installed (ModuleNotFoundError: No module named 'flashinfer')"}
    rec = L.run_point(2, 4, L.parse_row("d1+20+5"), "bf16", _args("--check"), ops, missing, device="cpu")
    assert stub_gpu == [L.STEP_IDS_PER_GRAPH]          # qla's step ids (prefill rows: no layer graphs)
    assert rec["impls"]["qla"]["gpu_us"] == rec["impls"]["fla"]["gpu_us"] == 500.0
    assert rec["impls"]["qla"]["slot_sets"] == 1 and rec["qla_over_fla"] == 1.0
    assert rec["impls"]["flashinfer"] == {"error": missing["flashinfer"]}
    assert set(rec["check"]) == {"fla"} and rec["check"]["fla"]["o_rel"] < 2e-2


def test_report_writes_json_and_says_why_no_plot(tmp_path, capsys, stub_gpu):
    import json

    rec = L.run_point(2, 4, L.parse_row("9"), "fp32", _args(), {"fla": standin_ops("fla")}, {}, device="cpu")
    args = _args("--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"), "--impls", "qla,fla")
    meta = {"commit": source_commit(), "date": "now", "gpu": "cpu"}
    L.report([rec], meta, args)
    out = capsys.readouterr().out
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["gpu"] == "cpu" and d["results"][0]["impls"]["fla"]["gpu_us"] == 500.0
    assert d["commit"] is None or len(d["commit"].split("+")[0]) == 40
    assert "| 2/4 | 9 | fp32 | qla |" in out
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "r.png").exists()
    except ImportError:
        assert "matplotlib not installed" in out
