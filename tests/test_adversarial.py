"""Adversarial inputs to the public API and the CLI (issue 26): each is refused with the
documented exception type and a message that names the argument, from host metadata, and the
pool (and intermediate states) outside the batch stay bit-identical -- nothing is written
before the checks pass. Runs on the CPU path; the kernel-facing layout rules are the same
functions on every path (_validate.py), so a call refused here is refused on the GPU too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import qla_serve
from qla_serve import _validate as V
from qla_serve.cli import main as cli_main
from qla_serve.kernels import reference as R

HK, HV, D = 1, 2, 3
LENS = [6, 4]
T = sum(LENS)
NO_CUDA = not torch.cuda.is_available()


def _pool(slots=4):
    return torch.randn(slots, HV, 128, 128, generator=torch.Generator().manual_seed(1))


def _prefill_args(**over):
    g = torch.Generator().manual_seed(0)
    a = dict(q=R.l2norm(torch.randn(T, HK, 128, generator=g)), k=R.l2norm(torch.randn(T, HK, 128, generator=g)),
             v=torch.randn(T, HV, 128, generator=g), g=-torch.rand(T, HV, generator=g) * 0.2,
             beta=torch.rand(T, HV, generator=g), pool=_pool(), slot_ids=torch.tensor([2, 0], dtype=torch.int32),
             plan=qla_serve.plan_prefill(LENS, HV, HK, device="cpu"))
    a.update(over)
    return a


def _prefill(a, **kw):
    return qla_serve.gdn_prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], a["pool"], a["slot_ids"], a["plan"], **kw)


def _step_args(B=3, **over):
    g = torch.Generator().manual_seed(2)
    a = dict(q=R.l2norm(torch.randn(B, HK, 128, generator=g)), k=R.l2norm(torch.randn(B, HK, 128, generator=g)),
             v=torch.randn(B, HV, 128, generator=g), pool=_pool(),
             slot_ids=torch.tensor([0, 2, -1], dtype=torch.int32)[:B], g=-torch.rand(B, HV, generator=g) * 0.2,
             beta=torch.rand(B, HV, generator=g))
    a.update(over)
    return a


def _decode(a, **kw):
    a = dict(a)
    return qla_serve.gdn_decode(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("pool"), a.pop("slot_ids"), **a, **kw)


def _commit_args(**over):
    a = dict(pool=_pool(), slot_ids=torch.tensor([1, 3], dtype=torch.int32),
             intermediate=torch.randn(2, D, HV, 128, 128), intermediate_ids=torch.tensor([0, 1], dtype=torch.int32),
             num_accepted=torch.tensor([1, 2], dtype=torch.int32))
    a.update(over)
    return a


def _verify_args(**over):
    g = torch.Generator().manual_seed(3)
    a = dict(q=R.l2norm(torch.randn(5, HK, 128, generator=g)), k=R.l2norm(torch.randn(5, HK, 128, generator=g)),
             v=torch.randn(5, HV, 128, generator=g), pool=_pool(), slot_ids=torch.tensor([1, 3], dtype=torch.int32),
             cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32), intermediate=torch.zeros(2, D, HV, 128, 128),
             intermediate_ids=torch.tensor([0, 1], dtype=torch.int32), g=-torch.rand(5, HV, generator=g) * 0.2,
             beta=torch.rand(5, HV, generator=g))
    a.update(over)
    return a


def _verify(a, **kw):
    a = dict(a)
    pos = [a.pop(n) for n in ("q", "k", "v", "pool", "slot_ids", "cu_seqlens", "intermediate", "intermediate_ids")]
    return qla_serve.gdn_verify(*pos, **a, **kw)


def _refused(fn, args, exc, name, **kw):
    """``fn(args, **kw)`` raises ``exc`` whose message starts by naming ``name``; the pool and
    the intermediate states are bit-identical afterwards."""
    kept = {k: args[k].clone() for k in ("pool", "intermediate") if isinstance(args.get(k), torch.Tensor)}
    with pytest.raises(exc) as info:
        fn(args, **kw)
    assert str(info.value).startswith(name), f"{name!r} not named first: {info.value}"
    for k, before in kept.items():
        assert torch.equal(args[k], before), f"{k} changed by a refused call"
    return str(info.value)


def _commit(a):
    return qla_serve.commit_verified(a["pool"], a["slot_ids"], a["intermediate"], a["intermediate_ids"],
                                     a["num_accepted"])


def _misaligned(shape, dtype=torch.float32):
    """A tensor of ``shape`` with unit inner stride whose base is 4 bytes off a 16-byte boundary."""
    n = int(np.prod(shape))
    return torch.randn(n + 1).to(dtype)[1:].view(shape)


# --------------------------------------------------------------------------- silent wrong answers

@pytest.mark.parametrize("over,exc,name", [
    (dict(intermediate=torch.randn(2, D, 1, 128, 128)), ValueError, "intermediate"),    # 1 head into 2
    (dict(intermediate=torch.randn(2, D, 3, 128, 128)), ValueError, "intermediate"),
    (dict(intermediate=torch.randn(2, D, HV, 128, 64)), ValueError, "intermediate"),
    (dict(intermediate=torch.randn(2, D, HV, 128, 128).bfloat16()), TypeError, "intermediate"),
    (dict(pool=_pool().half(), intermediate=torch.randn(2, D, HV, 128, 128).half()), TypeError, "pool"),
    (dict(pool=torch.randn(4, HV, 128)), ValueError, "pool"),
    (dict(pool=torch.randn(4, 0, 128, 128), intermediate=torch.randn(2, D, 0, 128, 128)), ValueError, "pool"),
    (dict(num_accepted=torch.tensor([-1, 2])), ValueError, "num_accepted"),
    (dict(num_accepted=torch.tensor([1, D + 1])), ValueError, "num_accepted"),
    (dict(num_accepted=torch.tensor([1.0, 2.0])), TypeError, "num_accepted"),
    (dict(num_accepted=torch.tensor([1])), ValueError, "num_accepted"),
    (dict(intermediate_ids=torch.tensor([0, 2], dtype=torch.int32)), ValueError, "intermediate_ids"),
    (dict(slot_ids=torch.tensor([1, 4], dtype=torch.int32)), ValueError, "slot_ids"),
    (dict(slot_ids=torch.tensor([-2**32, 3])), ValueError, "slot_ids"),
    (dict(slot_ids=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "slot_ids"),
    (dict(intermediate=torch.randn(2, D, HV, 128, 128).transpose(-1, -2)), ValueError, "intermediate"),
    (dict(intermediate=torch.randn(2 * D * HV * 16384 + 1).as_strided(
        (2, D, HV, 128, 128), (D * HV * 16384 + 1, HV * 16384, 16384, 128, 1))), ValueError, "intermediate"),
    (dict(pool=None), TypeError, "pool"),
    (dict(slot_ids=[1, 3]), TypeError, "slot_ids"),
])
def test_commit_verified_checks_pool_and_intermediate(over, exc, name):
    _refused(_commit, _commit_args(**over), exc, name)


def test_commit_messages_name_their_own_bounds():
    msg = _refused(_commit, _commit_args(num_accepted=torch.tensor([1, D + 1])), ValueError, "num_accepted")
    assert "intermediate.shape[1]" in msg and "slot count" not in msg
    msg = _refused(_commit, _commit_args(intermediate_ids=torch.tensor([0, 5])), ValueError, "intermediate_ids")
    assert "intermediate.shape[0]" in msg and "pool" not in msg
    msg = _refused(_commit, _commit_args(slot_ids=torch.tensor([1, 7])), ValueError, "slot_ids")
    assert "pool.shape[0]" in msg


def test_commit_verified_does_what_it_says():
    a = _commit_args(num_accepted=torch.tensor([0, 2]))
    want = a["pool"].clone()
    want[3] = a["intermediate"][1, 1]
    _commit(a)
    assert torch.equal(a["pool"], want)


@pytest.mark.parametrize("ids", [[-2**32, 0], [2, -2**32], [2**32, 0], [2, -2**31 - 1]])
def test_int64_ids_outside_int32_are_refused_not_narrowed(ids):
    """-2**32 narrowed to int32 is 0: slot 0 (outside the batch) would be read and written."""
    ids = torch.tensor(ids, dtype=torch.int64)
    _refused(_prefill, _prefill_args(slot_ids=ids), ValueError, "slot_ids")
    _refused(_decode, _step_args(B=2, slot_ids=ids), ValueError, "slot_ids")
    _refused(_verify, _verify_args(slot_ids=ids), ValueError, "slot_ids")
    _refused(_verify, _verify_args(intermediate_ids=ids), ValueError, "intermediate_ids")
    _refused(_commit, _commit_args(slot_ids=ids), ValueError, "slot_ids")


def test_int64_padding_ids_work_and_device_ids_never_alias_a_slot():
    a = _prefill_args(slot_ids=torch.tensor([-1, 1], dtype=torch.int64))
    before = a["pool"].clone()
    o = _prefill(a)
    assert torch.equal(a["pool"][[0, 2, 3]], before[[0, 2, 3]]) and not torch.equal(a["pool"][1], before[1])
    assert torch.count_nonzero(o[:6]) == 0  # the padding sequence's rows: zeros
    # ids the host cannot see (on a GPU) are clamped before narrowing: padding stays padding,
    # out of range stays out of range, never another slot
    got = V.int32_index(torch.tensor([-2**32, -5, 3, 2**32, 2**31 - 1]), torch.device("cpu"))
    assert got.dtype == torch.int32 and got.tolist() == [-1, -1, 3, 2**31 - 1, 2**31 - 1]
    same = torch.tensor([4, -1], dtype=torch.int32)
    assert V.int32_index(same, torch.device("cpu")) is same   # int32 ids: no copy, no launch


@pytest.mark.parametrize("lens,exc", [
    ([3.5], TypeError), ([3.0], TypeError), (torch.tensor([3.5]), TypeError), (["a"], TypeError),
    (None, TypeError), ("12", TypeError), (5, TypeError), ([True], TypeError), ([object()], TypeError),
    (torch.tensor([[3, 4]]), ValueError), ([3, -1], ValueError), ([2**31], ValueError),
    ([2**30, 2**30], ValueError), ([2**40], ValueError),
])
def test_plan_prefill_seq_lens(lens, exc):
    with pytest.raises(exc, match="^seq_lens: "):
        qla_serve.plan_prefill(lens, HV, HK, device="cpu", cp="auto")


def test_plan_prefill_takes_integer_kinds():
    for lens in ([3, 0], (3, 0), torch.tensor([3, 0]), np.array([3, 0]), [np.int64(3), 0], iter([3, 0])):
        assert qla_serve.plan_prefill(lens, HV, HK, device="cpu").seq_lens == (3, 0)
    assert qla_serve.plan_prefill([1], np.int64(8), np.int32(2), device="cpu").num_v_heads == 8
    big = qla_serve.plan_prefill([2**31 - 1], 8, 2, device="cpu")     # the largest batch it can index
    assert big.total_tokens == 2**31 - 1 and big.cu_seqlens[-1] == 2**31 - 1


# --------------------------------------------------------------------------- plan arguments

@pytest.mark.parametrize("kw,exc,name", [
    (dict(num_v_heads=0), ValueError, "num_v_heads"), (dict(num_k_heads=0), ValueError, "num_k_heads"),
    (dict(num_v_heads=True), TypeError, "num_v_heads"), (dict(num_k_heads=2.0), TypeError, "num_k_heads"),
    (dict(num_v_heads=3, num_k_heads=2), ValueError, "num_v_heads"),
    (dict(cp=None), ValueError, "cp"), (dict(cp="OFF"), ValueError, "cp"),
    (dict(sm_count=0), ValueError, "sm_count"), (dict(sm_count=1.5), TypeError, "sm_count"),
    (dict(supported_strategies={"bogus"}), ValueError, "supported_strategies"),
    (dict(supported_strategies=set()), ValueError, "supported_strategies"),
    (dict(supported_strategies="plain"), TypeError, "supported_strategies"),
    (dict(arch="sm91"), ValueError, "arch"),
    (dict(device="nonsense"), ValueError, "device"), (dict(device=1.5), TypeError, "device"),
])
def test_plan_prefill_arguments(kw, exc, name):
    args = dict(seq_lens=[5], num_v_heads=8, num_k_heads=2, device="cpu")
    args.update(kw)
    with pytest.raises(exc, match=f"^{name}: "):
        qla_serve.plan_prefill(**args)


@pytest.mark.parametrize("args,exc,name", [
    ((None, "plain", 1), TypeError, "plan"), (("cp", 1, 2.5), TypeError, "segment_chunks"),
    (("cp", True, 2), TypeError, "v_split"), (("vsplit", 3), ValueError, "v_split"),
    (("fast", 1), ValueError, "strategy"),
])
def test_force_plan_arguments(args, exc, name):
    from qla_serve.plan import force_plan

    plan = qla_serve.plan_prefill([5000], 8, 2, device="cpu")
    if args[0] is not None:
        args = (plan, *args)
    with pytest.raises(exc, match=f"^{name}: "):
        force_plan(*args)


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_plan_on_cuda_without_cuda_is_refused_by_name():
    with pytest.raises(ValueError, match="^device: .*CUDA is not available"):
        qla_serve.plan_prefill([5], 8, 2, device="cuda")
    with pytest.raises(ValueError, match="^device: "):
        qla_serve.StatePool(2, 2, device="cuda:0")


def test_a_plan_is_bound_to_its_device():
    plan = qla_serve.plan_prefill(LENS, HV, HK, device="meta")
    assert plan.device == torch.device("meta")
    assert {t.device.type for t in (plan.cu_seqlens, plan.chunk_offsets, plan.segments)} == {"meta"}
    assert plan.cu_seqlens_cpu == [0, 6, 10]                     # the host copy stays on the host
    _refused(_prefill, _prefill_args(plan=plan), ValueError, "plan")   # CPU tensors, meta plan


# --------------------------------------------------------------------------- the ops' arguments

@pytest.mark.parametrize("plan", [None, [0, 6, 10], {"cu_seqlens": [0, 6, 10]}, "plan"])
def test_plan_must_be_a_plan(plan):
    _refused(_prefill, _prefill_args(plan=plan), TypeError, "plan")


@pytest.mark.parametrize("scale,exc", [("x", TypeError), (True, TypeError), ([0.1], TypeError),
                                       (float("nan"), ValueError), (float("inf"), ValueError)])
def test_scale_is_a_finite_number(scale, exc):
    _refused(_prefill, _prefill_args(), exc, "scale", scale=scale)
    _refused(_decode, _step_args(), exc, "scale", scale=scale)
    _refused(_verify, _verify_args(), exc, "scale", scale=scale)


def test_scale_kinds_accepted():
    base = _decode(_step_args(), scale=0.5)
    for s in (np.float32(0.5), torch.tensor(0.5), 1 / 2):
        assert torch.equal(_decode(_step_args(), scale=s), base)


@pytest.mark.parametrize("flag", [None, "yes", 2, torch.tensor(True)])
def test_use_qk_l2norm_is_a_bool(flag):
    _refused(_decode, _step_args(), TypeError, "use_qk_l2norm", use_qk_l2norm=flag)


@pytest.mark.parametrize("over,name", [
    (dict(q=torch.randn(T, 0, 128), k=torch.randn(T, 0, 128)), "q"),
    (dict(v=torch.randn(T, 0, 128)), "v"),
])
def test_zero_heads(over, name):
    _refused(_prefill, _prefill_args(**over), ValueError, name)
    B = 3
    step = {n: (x[:B] if n in ("q", "k", "v") else x) for n, x in over.items()}
    _refused(_decode, _step_args(**step), ValueError, name)


def test_zero_value_heads_in_prefill_inputs():
    q = torch.randn(T, HK, 128)
    with pytest.raises(ValueError, match="^a: expected at least one value head"):
        qla_serve.gdn_prefill_inputs(q, q, torch.randn(T, 0), torch.randn(T, 0), torch.rand(0), torch.rand(0))
    with pytest.raises(TypeError, match="^qk_dtype: "):
        qla_serve.gdn_prefill_inputs(q, q, qk_dtype="float16")


# --------------------------------------------------------------------------- layouts the kernels need

def test_prefill_gates_must_be_contiguous():
    gt = (-torch.rand(HV, T)).t()
    _refused(_prefill, _prefill_args(g=gt), ValueError, "g")
    _refused(_prefill, _prefill_args(beta=torch.rand(HV, T).t()), ValueError, "beta")
    # decode / verify kernels read strided gates: accepted there
    B = 3
    _decode(_step_args(g=(-torch.rand(HV, B)).t(), beta=torch.rand(HV, B).t()))


@pytest.mark.parametrize("out", [
    torch.empty(T, HV, 256)[..., ::2],                        # inner stride 2
    _misaligned((T, HV, 128)),                                # base not 16-byte aligned
    torch.empty(T, HV, 129)[..., :128],                       # head stride 129 floats: not 16 bytes
])
def test_out_layout(out):
    _refused(_prefill, _prefill_args(), ValueError, "out", out=out)
    _refused(_decode, _step_args(), ValueError, "out", out=out[:3])
    _refused(_verify, _verify_args(), ValueError, "out", out=out[:5])


def test_qkv_layout():
    for name in ("q", "k"):
        _refused(_prefill, _prefill_args(**{name: _misaligned((T, HK, 128))}), ValueError, name)
        _refused(_decode, _step_args(**{name: _misaligned((3, HK, 128))}), ValueError, name)
    _refused(_prefill, _prefill_args(v=torch.randn(T, HV, 130)[..., 2:]), ValueError, "v")
    # views of one fused projection, as the engines pass them: accepted
    fused = torch.randn(T, (2 * HK + HV) * 128)
    q, k, v = fused[:, :128].view(T, HK, 128), fused[:, 128:256].view(T, HK, 128), fused[:, 256:].view(T, HV, 128)
    assert _prefill(_prefill_args(q=q, k=k, v=v)).shape == (T, HV, 128)


def test_pool_layout():
    slot = HV * 128 * 128
    buf = torch.zeros(4 * (slot + 1) + 1)
    odd_stride = buf.as_strided((4, HV, 128, 128), (slot + 1, 16384, 128, 1))      # 4-byte slot stride
    _refused(_prefill, _prefill_args(pool=odd_stride), ValueError, "pool")
    _refused(_decode, _step_args(pool=odd_stride), ValueError, "pool")
    _refused(_commit, _commit_args(pool=odd_stride), ValueError, "pool")
    odd_base = buf[1:1 + 4 * slot].view(4, HV, 128, 128)
    _refused(_decode, _step_args(pool=odd_base), ValueError, "pool")
    paged = torch.zeros(4, slot + 4).as_strided((4, HV, 128, 128), (slot + 4, 16384, 128, 1))  # vLLM pages
    _decode(_step_args(pool=paged))


def test_index_vectors_must_be_dense():
    strided = torch.tensor([2, 9, 0, 9], dtype=torch.int32)[::2]
    _refused(_prefill, _prefill_args(slot_ids=strided), ValueError, "slot_ids")
    _refused(_prefill, _prefill_args(), ValueError, "has_initial_state",
             has_initial_state=torch.tensor([True, False, True, False])[::2])
    _refused(_verify, _verify_args(intermediate_ids=torch.tensor([0, 9, 1, 9], dtype=torch.int32)[::2]),
             ValueError, "intermediate_ids")
    _refused(_verify, _verify_args(cu_seqlens=torch.tensor([0, 9, 2, 9, 5], dtype=torch.int32)[::2]),
             ValueError, "cu_seqlens")


def test_verify_intermediate_against_the_pool():
    _refused(_verify, _verify_args(intermediate=torch.zeros(2, D, 1, 128, 128)), ValueError, "intermediate")
    _refused(_verify, _verify_args(intermediate=torch.zeros(2, D, HV, 128, 128).transpose(-1, -2)),
             ValueError, "intermediate")
    msg = _refused(_verify, _verify_args(intermediate_ids=torch.tensor([0, 2], dtype=torch.int32)),
                   ValueError, "intermediate_ids")
    assert "intermediate.shape[0]" in msg and "pool" not in msg


# --------------------------------------------------------------------------- outputs and values

def test_prefill_padding_rows_are_zeros_like_decode():
    a = _prefill_args(slot_ids=torch.tensor([-1, 1], dtype=torch.int32))
    out = torch.full((T, HV, 128), 7.0)
    _prefill(a, out=out)
    assert torch.count_nonzero(out[:6]) == 0 and torch.count_nonzero(out[6:]) > 0
    o = _decode(_step_args())
    assert torch.count_nonzero(o[2]) == 0


def test_a_nan_stays_in_its_sequence_and_slot():
    """README: a non-finite k/v/g/beta poisons its head from the start of its 64-token chunk to
    the sequence's end, and its slot; other sequences and slots are untouched."""
    lens = [200, 100]
    g = torch.Generator().manual_seed(5)
    q, k = (R.l2norm(torch.randn(300, HK, 128, generator=g)) for _ in range(2))
    v, gg, beta = torch.randn(300, HV, 128, generator=g), -torch.rand(300, HV, generator=g) * 0.1, torch.rand(300, HV)
    v[100, 0, 5] = float("nan")
    pool = _pool()
    before = pool.clone()
    o = qla_serve.gdn_prefill(q, k, v, gg, beta, pool, torch.tensor([0, 1], dtype=torch.int32),
                              qla_serve.plan_prefill(lens, HV, HK, device="cpu"))
    bad = ~torch.isfinite(o).all(-1)
    assert bad[64:200, 0].all() and not bad[:64].any() and not bad[:, 1].any() and not bad[200:].any()
    assert not torch.isfinite(pool[0, 0]).all() and torch.isfinite(pool[0, 1]).all()
    assert torch.isfinite(pool[1]).all() and torch.equal(pool[2:], before[2:])


# --------------------------------------------------------------------------- StatePool

@pytest.mark.parametrize("n,exc", [(1.5, TypeError), ("1", TypeError), (True, TypeError), (None, TypeError),
                                   (-1, ValueError)])
def test_state_pool_allocate(n, exc):
    pool = qla_serve.StatePool(3, 2)
    with pytest.raises(exc, match="^n: "):
        pool.allocate(n)
    assert pool.num_free == 3


def test_state_pool_ids_are_ints():
    pool = qla_serve.StatePool(3, 2)
    pool.allocate(2)
    for ids in ([0.5], torch.tensor([1.0]), "0", 1):
        with pytest.raises(TypeError, match="^ids: "):
            pool.free(ids)
    assert pool.num_free == 1
    pool.free(np.array([1]))
    assert pool.num_free == 2
    for kw, exc in ((dict(num_slots=True), TypeError), (dict(num_slots=2.0), TypeError),
                    (dict(num_v_heads=0), ValueError), (dict(device="nonsense"), ValueError)):
        args = dict(num_slots=2, num_v_heads=2)
        args.update(kw)
        with pytest.raises(exc, match=f"^{next(iter(kw))}: "):
            qla_serve.StatePool(**args)
    with pytest.raises(TypeError, match="^num_v_heads: "):
        qla_serve.PoolView(torch.zeros(2, 2, 128, 128), "2")


# --------------------------------------------------------------------------- CLI

def _cli(argv, capsys):
    try:
        code = cli_main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.mark.parametrize("argv,flag,words", [
    (["plan", "--heads", "2/8", "--seqlens", "2147483648"], "--seqlens", "2147483647 tokens"),
    (["plan", "--heads", "2/8", "--seqlens", "1073741824,1073741824"], "--seqlens", "in all"),
    (["plan", "--heads", "2/8", "--seqlens", "-5,100"], "--seqlens", "lengths >= 0"),
    (["plan", "--heads", "2/8", "--seqlens", "-5"], "--seqlens", "lengths >= 0"),
    (["plan", "--heads", "2/8", "--seqlens", "3.5"], "--seqlens", "comma-separated ints"),
    (["plan", "--heads", "-2/8", "--seqlens", "5"], "--heads", "positive counts"),
    (["plan", "--heads", "2/8", "--seqlens", "5", "--sm-count", "0"], "--sm-count", "positive integer"),
    (["plan", "--heads", "2/8", "--seqlens", "5", "--sm-count", "-3"], "--sm-count", "positive integer"),
    (["plan", "--heads", "2/8", "--seqlens", "5", "--strategies", "plain,fast"], "--strategies", "comma list"),
    (["plan", "--heads", "2/8", "--seqlens", "5", "--max-rows", "-1"], "--max-rows", "integer >= 0"),
    (["demo", "--device", "nonsense"], "--device", "a device such as"),
])
def test_cli_bad_values_exit_2_naming_the_option(argv, flag, words, capsys):
    code, _, err = _cli(argv, capsys)
    assert code == 2 and flag in err and words in err, err
    assert "None" not in err and "sm_count" not in err and "expected one argument" not in err


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_cli_demo_on_cuda_without_cuda(capsys):
    code, _, err = _cli(["demo", "--device", "cuda"], capsys)
    assert code == 2 and "--device" in err and "CUDA is not available" in err


def test_cli_plan_largest_batch(capsys):
    code, out, _ = _cli(["plan", "--heads", "2/8", "--seqlens", "2147483647", "--json"], capsys)
    assert code == 0 and '"total_tokens": 2147483647' in out


def test_config_check_keeps_going_past_a_binary_file(tmp_path, capsys):
    good = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "deploy",
                        "qwen3.5-27b-tp2.yaml")
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    code, out, err = _cli(["config", "check", str(binary), good], capsys)
    assert code == 2
    assert f"{binary}: not a UTF-8 text file" in err
    assert f"OK {good}" in out


@pytest.mark.parametrize("content,code", [(None, 2), ("a: [\n", 2), (b"\xff\xfe\x00binary", 2),
                                          ("model: {}\n", 1)])
def test_config_check_and_render_agree_on_exit_codes(tmp_path, capsys, content, code):
    path = tmp_path / "cfg.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    for command in ("check", "render"):
        got, _, err = _cli(["config", command, str(path)], capsys)
        assert got == code, (command, err)
        assert str(path) in err
    got, _, _ = _cli(["precompile", "--config", str(path), "--list"], capsys)
    assert got == code
