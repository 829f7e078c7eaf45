"""gdn_prefill's checkpoints (vLLM 0.33's align-mode prefix caching, docs/vllm_checkpoints.md) on
the reference path (CPU; the truth in float64): the state after min(64 * chunks[s], len_s) tokens of sequence s
lands in pool slot slots[s], against the per-token recurrence over that prefix; outputs, final
states and other slots are those of a call without checkpoints. The TileLang kernels run the same
contract in tests/kernels/test_prefill_gpu.py::test_checkpoints (marker gpu)."""

import pytest
import torch

import qla_serve
from gdn_inputs import make_inputs, rel_err
from qla_serve.kernels import reference

HK, HV = 2, 4
LENS = [300, 1000, 64 * 20 + 5, 0, 64, 700, 130]
CHUNKS = [4, 0, 13, 0, 1, 9, 3]      # 3 x 64 > 130: the state after all 130 tokens
SLOTS = [7, 8, 9, -1, 10, -1, 11]    # -1: no checkpoint (vLLM's null block)


def _call(cp: str, checkpoints):
    q, k, v, g, beta = make_inputs(LENS, HK, HV, dtype=torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    pool = torch.randn(14, HV, 128, 128, generator=gen) * 0.3
    slot_ids = torch.arange(len(LENS), dtype=torch.int32)
    has = torch.tensor([True, False, True, False, True, True, False])
    plan = qla_serve.plan_prefill(LENS, HV, HK, device="cpu", cp=cp)
    before = pool.clone()
    out = qla_serve.gdn_prefill(q, k, v, g, beta, pool, slot_ids, plan, has_initial_state=has,
                                checkpoints=checkpoints)
    return (q, k, v, g, beta), before, pool, out, has


@pytest.mark.parametrize("cp", ["off", "exact"])
def test_checkpoint_states_match_the_recurrence(cp):
    ck = (torch.tensor(CHUNKS), torch.tensor(SLOTS, dtype=torch.int32))
    inputs, before, pool, out, has = _call(cp, ck)
    _, _, pool_plain, out_plain, _ = _call(cp, None)
    assert torch.equal(out, out_plain)
    assert torch.equal(pool[: len(LENS)], pool_plain[: len(LENS)])
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    written = set()
    for s, (c, slot) in enumerate(zip(CHUNKS, SLOTS)):
        if slot < 0 or c == 0:
            continue
        n = min(64 * c, LENS[s])
        rows = slice(cu[s], cu[s] + n)
        init = before[s:s + 1].double() if has[s] else None
        _, want = reference.recurrent_gdn(*(x[rows].double() for x in inputs), [0, n], init, 128 ** -0.5)
        assert rel_err(pool[slot], want[0]) < 1e-5, f"checkpoint of sequence {s}"
        written.add(slot)
    others = [i for i in range(pool.shape[0]) if i >= len(LENS) and i not in written]
    assert torch.equal(pool[others], before[others])


def test_checkpoint_arguments_are_checked():
    q, k, v, g, beta = make_inputs([100, 50], HK, HV, dtype=torch.float32)
    pool = torch.zeros(4, HV, 128, 128)
    plan = qla_serve.plan_prefill([100, 50], HV, HK, device="cpu")
    ids = torch.tensor([0, 1], dtype=torch.int32)
    ok = torch.tensor([1, 0], dtype=torch.int32)
    for bad, match in ((ok, "pair of tensors"), ((ok,), "pair of tensors"),
                       ((ok, torch.tensor([2, 3, 1], dtype=torch.int32)), r"checkpoints\[1\]"),
                       ((ok.float(), ok), r"checkpoints\[0\]"),
                       ((ok, torch.tensor([4, -1], dtype=torch.int32)), r"checkpoints\[1\] \(slots\): expected ids < 4")):
        with pytest.raises((TypeError, ValueError), match=match):
            qla_serve.gdn_prefill(q, k, v, g, beta, pool, ids, plan, checkpoints=bad)


def test_conv_checkpoint_arguments_are_checked():
    """layer_ops.causal_conv_checkpoints names a bad argument before touching the conv state."""
    from qla_serve import layer_ops

    x = torch.randn(150, (2 * HK + HV) * 128)
    conv = torch.zeros(4, x.shape[1], 3)
    cu = torch.tensor([0, 100, 150], dtype=torch.int32)
    slots = torch.tensor([2, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="chunks"):
        layer_ops.causal_conv_checkpoints(x, conv, slots, torch.tensor([1], dtype=torch.int32), cu,
                                          width=4, num_v_heads=HV)
    with pytest.raises(ValueError, match="slot_ids"):
        layer_ops.causal_conv_checkpoints(x, conv, torch.tensor([5, -1], dtype=torch.int32),
                                          torch.tensor([1, 0], dtype=torch.int32), cu, width=4, num_v_heads=HV)
    chunks = torch.tensor([1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="table"):    # a table of other sequences
        layer_ops.causal_conv_checkpoints(x, conv, slots, chunks, cu, width=4, num_v_heads=HV,
                                          table=layer_ops.checkpoint_conv_table(slots[:1], chunks[:1], cu[:2]))
    assert not conv.any()
    layer_ops.causal_conv_checkpoints(x, conv, slots, chunks, cu, width=4, num_v_heads=HV)
    assert torch.equal(conv[2].t(), x[61:64])           # the 3 inputs before token 64
    assert not conv[[0, 1, 3]].any()
    again = torch.zeros_like(conv)                      # the same with the step's kept table
    layer_ops.causal_conv_checkpoints(x, again, slots, chunks, cu, width=4, num_v_heads=HV,
                                      table=layer_ops.checkpoint_conv_table(slots, chunks, cu))
    assert torch.equal(again, conv)
