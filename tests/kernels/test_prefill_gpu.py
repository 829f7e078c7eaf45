"""GPU tests of the TileLang prefill kernels (qla_serve.kernels.hopper.prefill) against the
float64 per-token recurrence (qla_serve.kernels.reference.recurrent_gdn, the truth).

Every check draws fresh random inputs: unit-norm q/k and v as strided views of one fused
projection (as engines pass them), realistic gates g = -exp(A_log) * softplus(x + dt_bias) with a
quarter of the heads at g = 0, beta in (0.01, 0.99); pools are strided (stride(0) > one slot),
poisoned outside the batch's live slots (those must stay bit-identical) and `out` is filled with
NaN first (every row must be written). Sequences with slot id < 0 are padding: their rows are
computed from a zero state, nothing is read or written in the pool.

Tolerances (relative L2 over the whole tensor): 2e-3 for outputs and fp32-pool final states.
A bf16 output alone is 1.6e-3 from the exact one (bf16 rounding), so the kernel's own error must
stay near 1e-3. bf16 pools store the state rounded to bf16 (unit roundoff 2^-9): 6e-3 there.
"""

import json
import math
import os
import random

import pytest
import torch

from gdn_inputs import rel_err as rel
from qla_serve.kernels import reference

pytestmark = pytest.mark.gpu

HD = 128
TOL = 2e-3
TOL_BF16_STATE = 6e-3
HEADS = [(2, 8), (4, 16), (8, 24), (16, 32), (16, 64)]


def _mod():
    from qla_serve.kernels.hopper import prefill_api as mod
    return mod


def _launch():
    from qla_serve.kernels.hopper import prefill_launch
    return prefill_launch


@pytest.fixture(autouse=True)
def _kernel_switches(monkeypatch):
    """The package defaults, whatever the environment says: gate warmup on (plans with
    cp="auto" take it, cp="exact" plans never do), the V-first stage 2 at v_split 1 and 2
    (v_split 4 runs v8), stage 1's heads per CTA by its rule and its default solve (mma.sync;
    test_prep_solves runs both), two heads solved at once where a CTA has two or four (PREP_PAIR;
    test_prep_pair_solve_matches_one_head_at_a_time runs both). The CP passes' launch form
    (CP_PDL) is read from no environment: the package's. test_v8_main and the sanitizer case
    switch to v8 themselves, test_prep_heads_per_cta forces the heads,
    test_cp_pdl_matches_plain_launches runs both launch forms. Plain and V-split plans run their
    V-first stage 2 on the persistent grid (PERSISTENT); test_persistent_matches_unit_grid runs
    both grids. The one-launch prefill (FUSED) is off, as in the package; the fused tests and
    test_checkpoints' "fused" row turn it on."""
    monkeypatch.setattr(_mod(), "PERSISTENT", True)
    monkeypatch.setattr(_mod(), "GATE_WARMUP", True)
    monkeypatch.setattr(_mod(), "MAIN_IMPL", "vfirst")
    monkeypatch.setattr(_mod(), "PREP_HEADS", 0)
    monkeypatch.setattr(_mod(), "PREP_SOLVE", _mod().PREP_SOLVE_DEFAULT)
    monkeypatch.setattr(_mod(), "PREP_PAIR", True)
    monkeypatch.setattr(_mod(), "FUSED", False)
    monkeypatch.setattr(_mod(), "FUSED_PINGPONG", False)


def make_case(lens, Hk, Hv, *, io=torch.bfloat16, qk=None, gen, dev="cuda"):
    """q, k, v as strided views of one projection in io (q/k in qk where given: fp16 q/k beside
    bf16 v, rounded once from the fp32 unit-norm rows, as gdn_prefill_inputs makes them)."""
    T = sum(lens)
    width = (2 * Hk + Hv) * HD + 64
    proj = torch.randn(T, width, generator=gen, device=dev)
    q32 = reference.l2norm(proj[:, : Hk * HD].view(T, Hk, HD))
    k32 = reference.l2norm(proj[:, Hk * HD: 2 * Hk * HD].view(T, Hk, HD))
    proj[:, : Hk * HD] = q32.reshape(T, Hk * HD)
    proj[:, Hk * HD: 2 * Hk * HD] = k32.reshape(T, Hk * HD)
    proj = proj.to(io)
    q = proj[:, : Hk * HD].view(T, Hk, HD)
    k = proj[:, Hk * HD: 2 * Hk * HD].view(T, Hk, HD)
    v = proj[:, 2 * Hk * HD: (2 * Hk + Hv) * HD].view(T, Hv, HD)
    if qk is not None and qk != io:
        qk_proj = torch.cat([q32.reshape(T, -1), k32.reshape(T, -1), proj[:, :64].float()], 1).to(qk)
        q, k = qk_proj[:, : Hk * HD].view(T, Hk, HD), qk_proj[:, Hk * HD: 2 * Hk * HD].view(T, Hk, HD)
    A_log = torch.log(torch.rand(Hv, generator=gen, device=dev) * 15 + 1)
    dt = torch.rand(Hv, generator=gen, device=dev) * 0.099 + 0.001
    x = torch.randn(T, Hv, generator=gen, device=dev)
    g = -torch.exp(A_log) * torch.nn.functional.softplus(x + torch.log(torch.expm1(dt)))
    g[:, : max(1, Hv // 4)] = 0.0  # a quarter of the heads do not decay
    beta = torch.rand(T, Hv, generator=gen, device=dev) * 0.98 + 0.01
    return q, k, v, g.contiguous(), beta


def make_pool(S, Hv, dtype, gen, pad=512, dev="cuda"):
    """Pool [S, Hv, 128, 128] with stride(0) = Hv*128*128 + pad, random states (poison)."""
    slot = Hv * HD * HD + pad
    flat = (torch.randn(S * slot, generator=gen, device=dev) * 0.3).to(dtype)
    return flat.as_strided((S, Hv, HD, HD), (slot, HD * HD, HD, 1))


def make_plan(lens, Hv, Hk, v_split, segment_chunks=0, cp=None, maps_v_split=None):
    """A plan forced to v_split (and, with segment_chunks > 0, to the "cp" strategy with
    segments of that many chunks), whatever the cost model would pick. cp: the mode the kernels
    see ("auto": cut segments may use gate warmup; default "exact" for a cut). The CP maps pass
    runs at maps_v_split, default v_split (not the planner's rule, so that each test runs the
    split it names)."""
    import qla_serve
    from qla_serve.plan import force_plan
    plan = qla_serve.plan_prefill(lens, Hv, Hk, device="cuda", cp="off", arch="sm90",
                                  supported_strategies={"plain", "vsplit"})
    strategy = "cp" if segment_chunks else ("plain" if v_split == 1 else "vsplit")
    return force_plan(plan, strategy, v_split, segment_chunks, cp,
                      maps_v_split=(maps_v_split or v_split) if segment_chunks else None)


def run_case(lens, Hk, Hv, *, pool_dtype=torch.float32, v_split=2, io=torch.bfloat16, qk=None, seed=0,
             pad_frac=0.0, init_frac=0.8, all_init=False, extra_slots=3, segment_chunks=0, cp=None,
             maps_v_split=None):
    """One prefill call on fresh random inputs, checked against the float64 recurrence (see the
    module docstring). io is v's and the output's dtype, qk q/k's (None: io). Returns (o rel err,
    state rel err, the plan, g)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    N = len(lens)
    q, k, v, g, beta = make_case(lens, Hk, Hv, io=io, qk=qk, gen=gen)
    S = N + extra_slots
    pool = make_pool(S, Hv, pool_dtype, gen)
    ids = list(range(S))
    rng.shuffle(ids)
    slot_ids = [ids[i] if rng.random() >= pad_frac else -1 for i in range(N)]
    has = [rng.random() < init_frac for _ in range(N)]
    slot_t = torch.tensor(slot_ids, dtype=torch.int32, device="cuda")
    has_t = None if all_init else torch.tensor(has, dtype=torch.bool, device="cuda")
    if all_init:
        has = [True] * N
    before = pool.clone()
    init = torch.zeros(N, Hv, HD, HD, dtype=torch.float64, device="cuda")
    for i, s in enumerate(slot_ids):
        if s >= 0 and has[i]:
            init[i] = pool[s].double()
    T = sum(lens)
    out = torch.full((T, Hv, HD), float("nan"), dtype=io, device="cuda")
    plan = make_plan(lens, Hv, Hk, v_split, segment_chunks, cp, maps_v_split)
    _launch().prefill(q, k, v, g, beta, pool, slot_t, plan, has_initial_state=has_t,
                      scale=HD ** -0.5, out=out)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    o_ref, s_ref = reference.recurrent_gdn(q.double(), k.double(), v.double(), g.double(),
                                           beta.double(), cu, init, HD ** -0.5)
    assert not torch.isnan(out).any(), "output rows left unwritten or NaN"
    e_o = rel(out, o_ref) if T else 0.0
    live = [i for i, s in enumerate(slot_ids) if s >= 0]
    e_s = 0.0
    if live:
        idx = torch.tensor([slot_ids[i] for i in live], device="cuda")
        got = pool[idx]
        assert not torch.isnan(got).any()
        e_s = rel(got, s_ref[live])
    untouched = sorted(set(range(S)) - {s for s in slot_ids if s >= 0})
    if untouched:
        u = torch.tensor(untouched, device="cuda")
        assert torch.equal(pool[u].view(torch.int16 if pool_dtype == torch.bfloat16 else torch.int32),
                           before[u].view(torch.int16 if pool_dtype == torch.bfloat16 else torch.int32)), \
            "slots outside the batch changed"
    tol_s = TOL if pool_dtype == torch.float32 else TOL_BF16_STATE
    io_label = str(io).split(".")[-1] + ("" if qk in (None, io) else "+qk-" + str(qk).split(".")[-1])
    _record_errors(e_o, e_s, Hk, Hv, pool_dtype, io_label, v_split, len(lens), T)
    assert e_o <= TOL, f"o rel L2 {e_o:.3e} > {TOL}"
    assert e_s <= tol_s, f"state rel L2 {e_s:.3e} > {tol_s}"
    return e_o, e_s, plan, g


def _record_errors(e_o, e_s, Hk, Hv, pool_dtype, io, v_split, nseq, ntok):
    """With QLA_ERRORS_JSONL set (scripts/gpu_prefill.sh sets it), append this case's errors as
    one JSON line, so a device run leaves the figures and not only pass/fail."""
    path = os.environ.get("QLA_ERRORS_JSONL")
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                            "heads": f"{Hk}/{Hv}", "pool": str(pool_dtype).split(".")[-1],
                            "io": str(io).split(".")[-1], "v_split": v_split, "seqs": nseq,
                            "tokens": ntok, "o_rel_l2": e_o, "state_rel_l2": e_s}) + "\n")


EDGE_LENS = [0, 1, 63, 64, 65, 130, 7, 200]


@pytest.mark.parametrize("Hk,Hv", HEADS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_heads_edge_lengths(Hk, Hv, pool_dtype):
    """Lengths 0, 1, 63, 64, 65 (and a few more) in one batch, some padding slots, mixed
    has_initial_state, for every head pair and both pool dtypes, v_split 2."""
    e = run_case(EDGE_LENS, Hk, Hv, pool_dtype=pool_dtype, seed=Hv * 7 + Hk, pad_frac=0.2)
    print(f"heads {Hk}/{Hv} pool {pool_dtype}: o {e[0]:.2e} state {e[1]:.2e}")


@pytest.mark.parametrize("v_split", [1, 2, 4])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vsplit(v_split, pool_dtype):
    e = run_case([300, 65, 0, 1, 129], 2, 8, pool_dtype=pool_dtype, v_split=v_split, seed=v_split)
    print(f"v_split {v_split} pool {pool_dtype}: o {e[0]:.2e} state {e[1]:.2e}")


def test_fp16_io_all_initial():
    e = run_case([100, 64, 1, 0, 333], 4, 16, io=torch.float16, all_init=True, seed=5)
    print(f"fp16 io: o {e[0]:.2e} state {e[1]:.2e}")


@pytest.mark.parametrize("Hk,Hv,v_split", [(2, 8, 1), (2, 8, 2), (2, 8, 4), (16, 64, 1)])
def test_fp16_qk_beside_bf16_v(Hk, Hv, v_split):
    """fp16 q/k beside bf16 v (what gdn_prefill_inputs(..., qk_dtype=torch.float16) hands the
    engine layers' prefill): stage 1 reads q/k as they are and writes no fp16 copies, stage 2
    reads them directly; bf16 output. Edge lengths, padding, both pools; then CP with the exact
    path and with gate warmup (V-first at v_split 1/2, v8 with prep form uw at 4)."""
    for pool_dtype in (torch.float32, torch.bfloat16):
        e = run_case(EDGE_LENS, Hk, Hv, pool_dtype=pool_dtype, v_split=v_split, qk=torch.float16,
                     seed=900 + v_split + Hv, pad_frac=0.2)
        print(f"fp16 q/k, bf16 v, {Hk}/{Hv} v_split {v_split} pool {pool_dtype}: o {e[0]:.2e} state {e[1]:.2e}")
    lens = [64 * 29 + 17, 0, 64 * 3, 1, 64 * 7, 200]
    for cp in ("exact", "auto"):
        e = run_case(lens, Hk, Hv, v_split=v_split, qk=torch.float16, seed=910 + v_split + Hv, pad_frac=0.2,
                     segment_chunks=3, cp=cp)
        print(f"fp16 q/k, bf16 v, {Hk}/{Hv} v_split {v_split} cp {cp}: o {e[0]:.2e} state {e[1]:.2e}")


@pytest.mark.parametrize("Hk,Hv,heads", [(2, 8, 2), (2, 8, 4), (16, 32, 2), (16, 64, 4)])
def test_prep_heads_per_cta(Hk, Hv, heads, monkeypatch):
    """Stage 1 with several v-heads per CTA (prefill_api.PREP_HEADS forced; the rule picks it
    only for large enough calls): edge lengths with padding and both pools, fp16 q/k beside
    bf16 v under CP with gate warmup, against the float64 recurrence; and the same errors, to
    the last bit, as one head per CTA on the same inputs (each head's operations are the same;
    on the H200 the outputs were bit-equal in 120 of 120 bench calls, benchmarks/prefill.md v27)."""
    cases = [dict(lens=EDGE_LENS, pool_dtype=torch.float32, pad_frac=0.2),
             dict(lens=EDGE_LENS, pool_dtype=torch.bfloat16, pad_frac=0.2),
             dict(lens=[64 * 29 + 17, 0, 64 * 3, 1, 64 * 7, 200], qk=torch.float16, v_split=1, pad_frac=0.2,
                  segment_chunks=3, cp="auto")]
    for i, case in enumerate(cases):
        lens = case.pop("lens")
        errors = {}
        for n in (heads, 1):
            monkeypatch.setattr(_mod(), "PREP_HEADS", n)
            errors[n] = run_case(lens, Hk, Hv, seed=1200 + i + Hv, **case)[:2]
        print(f"{Hk}/{Hv} heads per CTA {heads}, case {i}: o {errors[heads][0]:.2e} state {errors[heads][1]:.2e}")
        assert errors[heads] == errors[1]


@pytest.mark.parametrize("Hk,Hv,heads", [(2, 8, 1), (2, 8, 4), (4, 16, 2), (16, 32, 1), (16, 64, 4)])
def test_prep_solves(Hk, Hv, heads, monkeypatch):
    """Stage 1's two solves (prefill_api.PREP_SOLVE: the wgmma products, the mma.sync block
    substitution of csrc/block_solve.cuh) against the float64 recurrence on the same inputs:
    edge lengths with padding at both pools, bf16 and fp16 q/k, one and several heads per CTA,
    CP with gate warmup (M of cut chunks). The two round differently (fp16 operands at other
    points: reference.blocked_solve / block_substitution_solve), so each is held to the
    tolerance, not to the other's bits."""
    monkeypatch.setattr(_mod(), "PREP_HEADS", heads)
    cases = [dict(lens=EDGE_LENS, pool_dtype=torch.float32, pad_frac=0.2, v_split=1),
             dict(lens=EDGE_LENS, pool_dtype=torch.bfloat16, pad_frac=0.2, qk=torch.float16, v_split=2),
             dict(lens=[64 * 29 + 17, 0, 64 * 3, 1, 64 * 7, 200], qk=torch.float16, v_split=1, pad_frac=0.2,
                  segment_chunks=3, cp="auto")]
    for i, case in enumerate(cases):
        lens = case.pop("lens")
        for solve in _mod().PREP_SOLVES:
            monkeypatch.setattr(_mod(), "PREP_SOLVE", solve)
            e = run_case(lens, Hk, Hv, seed=1300 + i + Hv, **dict(case))
            print(f"{Hk}/{Hv} heads per CTA {heads}, case {i}, solve {solve}: o {e[0]:.2e} state {e[1]:.2e}")


PREP_PAIR_CASES = [  # (lens, Hk, Hv, heads per CTA, v_split, q/k dtype, segment chunks)
    (EDGE_LENS, 2, 8, 2, 1, torch.float16, 0),
    (EDGE_LENS, 2, 8, 4, 2, None, 0),  # bf16 q/k: the fp16 copies written on the way
    ([512] * 40, 16, 64, 4, 1, torch.float16, 0),
    ([64 * 29 + 17, 0, 64 * 3, 1, 64 * 7, 200], 4, 16, 2, 1, torch.float16, 3),  # CP: P and M apart
]


@pytest.mark.parametrize("case", PREP_PAIR_CASES,
                         ids=lambda c: f"{len(c[0])}seq-{c[1]}-{c[2]}-h{c[3]}-vs{c[4]}-cp{c[6]}")
def test_prep_pair_solve_matches_one_head_at_a_time(case, monkeypatch):
    """Stage 1 solving two heads at once (prefill_api.PREP_PAIR: warps 0-1 one head, 2-3 the
    other, csrc/block_solve_pair.cuh) writes every stage-1 output bit for bit as solving them one
    after the other does (the same operations per head), on edge lengths with padding, bf16 and
    fp16 q/k, two and four heads per CTA, packed and apart (a CP plan); and the call meets the
    float64 recurrence."""
    lens, Hk, Hv, heads, v_split, qk, segment_chunks = case
    monkeypatch.setattr(_mod(), "PREP_HEADS", heads)
    cp = "exact" if segment_chunks else None
    outputs = {}
    for pair in (False, True):
        monkeypatch.setattr(_mod(), "PREP_PAIR", pair)
        e = run_case(lens, Hk, Hv, qk=qk, v_split=v_split, seed=1500 + Hv + heads, pad_frac=0.2,
                     segment_chunks=segment_chunks, cp=cp)
        plan = e[2]
        packed = _mod().packed_tiles(plan.strategy, "vfirst", plan.v_split)
        nchunks, stage1 = _launch()._plan_scratch(plan, Hv, "m", packed, torch.device("cuda"))
        outputs[pair] = [t[:nchunks].clone() for t in stage1 if t.shape[0] == max(nchunks, 1)]
        print(f"{Hk}/{Hv} heads {heads} pair {pair}: o {e[0]:.2e} state {e[1]:.2e}")
    for a, b in zip(outputs[False], outputs[True], strict=True):
        assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                           b.view(torch.int16 if b.element_size() == 2 else torch.int32))


PERSISTENT_CASES = [  # (lens, Hk, Hv, v_split, q/k dtype, pool dtype, padding, checkpoints)
    (EDGE_LENS, 2, 8, 1, torch.float16, torch.float32, 0.2, False),
    (EDGE_LENS, 2, 8, 2, None, torch.bfloat16, 0.2, False),
    ([3000] + [17, 64, 0, 513, 1, 200] * 6, 4, 16, 1, torch.float16, torch.float32, 0.1, False),
    ([512] * 40, 16, 64, 1, torch.float16, torch.bfloat16, 0.0, False),  # 2560 units: ~19 per CTA
    ([300, 1000, 64 * 20 + 5, 0, 64, 700], 2, 8, 1, None, torch.float32, 0.0, True),
]


@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=lambda c: f"{len(c[0])}seq-{c[1]}-{c[2]}-vs{c[3]}")
def test_persistent_matches_unit_grid(case, monkeypatch):
    """The persistent stage 2 (one CTA per SM walking (sequence, head, value block) units, ring
    stages and O tiles continuing across units, longest sequences first) against the grid of a
    CTA per unit on the same inputs: outputs, final states and checkpoint states bit-identical
    (the same operations per unit), both against the float64 recurrence, other slots untouched.
    PERSISTENT_MAX_MEAN_CHUNKS and PERSISTENT_UNIT_SAVING are lifted so that every case, long and
    ragged batches too, takes the grid."""
    lens, Hk, Hv, vs, qk, pool_dtype, pad, ckpt = case
    gen = torch.Generator(device="cuda").manual_seed(1700 + Hv + vs)
    q, k, v, g, beta = make_case(lens, Hk, Hv, qk=qk, gen=gen)
    N = len(lens)
    S = 2 * N + 2
    pool0 = make_pool(S, Hv, pool_dtype, gen)
    rng = random.Random(17 + N)
    slot_ids = [i if rng.random() >= pad else -1 for i in range(N)]
    has = torch.tensor([rng.random() < 0.8 for _ in range(N)], device="cuda")
    dev = dict(dtype=torch.int32, device="cuda")
    checkpoints = None
    if ckpt:  # a checkpoint slot after chunk 2 of every sequence with more than two chunks
        chunks = [2 if n > 128 else 0 for n in lens]
        checkpoints = (torch.tensor(chunks, **dev), torch.tensor([N + i for i in range(N)], **dev))
    results = {}
    monkeypatch.setattr(_mod(), "PERSISTENT_MAX_MEAN_CHUNKS", 1 << 20)
    monkeypatch.setattr(_mod(), "PERSISTENT_UNIT_SAVING", float("inf"))
    for persistent in (True, False):
        monkeypatch.setattr(_mod(), "PERSISTENT", persistent)
        pool = pool0.clone()
        out = torch.full((sum(lens), Hv, HD), float("nan"), dtype=v.dtype, device="cuda")
        plan = make_plan(lens, Hv, Hk, vs)
        _launch().prefill(q, k, v, g, beta, pool, torch.tensor(slot_ids, **dev), plan, has_initial_state=has,
                          scale=HD ** -0.5, out=out, checkpoints=checkpoints)
        assert not torch.isnan(out).any(), "output rows left unwritten or NaN"
        results[persistent] = (out, pool)
    bits = torch.int16 if pool_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(results[True][0], results[False][0]), "outputs differ between the grids"
    assert torch.equal(results[True][1].view(bits), results[False][1].view(bits)), "pool slots differ between the grids"
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    init = torch.zeros(N, Hv, HD, HD, dtype=torch.float64, device="cuda")
    for i, s_ in enumerate(slot_ids):
        if s_ >= 0 and bool(has[i]):
            init[i] = pool0[s_].double()
    o_ref, s_ref = reference.recurrent_gdn(q.double(), k.double(), v.double(), g.double(), beta.double(), cu, init,
                                           HD ** -0.5)
    assert rel(results[True][0], o_ref) <= TOL
    live = [i for i, s_ in enumerate(slot_ids) if s_ >= 0]
    tol_s = TOL if pool_dtype == torch.float32 else TOL_BF16_STATE
    assert rel(results[True][1][torch.tensor([slot_ids[i] for i in live], device="cuda")], s_ref[live]) <= tol_s
    written = {slot_ids[i] for i in live} | ({N + i for i in range(N) if lens[i] > 128} if ckpt else set())
    untouched = torch.tensor(sorted(set(range(S)) - written), device="cuda")
    assert torch.equal(results[True][1][untouched].view(bits), pool0[untouched].view(bits)), \
        "slots outside the batch changed"


FUSED_CASES = [  # (lens, Hk, Hv, v dtype, pool dtype, padding, all slots initialised)
    (EDGE_LENS, 2, 8, torch.bfloat16, torch.float32, 0.2, False),
    (EDGE_LENS, 4, 16, torch.float16, torch.bfloat16, 0.2, False),
    ([8191], 2, 8, torch.bfloat16, torch.float32, 0.0, False),
    ([300, 1000, 64 * 20 + 5, 0, 64, 700], 8, 24, torch.bfloat16, torch.float32, 0.0, True),
    ([512] * 6 + [2048, 33], 16, 32, torch.bfloat16, torch.bfloat16, 0.1, False),
    ([2048, 1000, 64], 16, 64, torch.bfloat16, torch.float32, 0.0, False),
]


def _ran_fused(plan) -> bool:
    """Whether every prefill call on this plan resolved to the one-launch kernel."""
    launches = [x for x in plan.kernel_cache.values() if isinstance(x, _launch()._Launches)]
    return bool(launches) and all(x.fused is not None for x in launches)


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"{len(c[0])}seq-{c[1]}-{c[2]}-{str(c[3])[6:]}-{str(c[4])[6:]}")
def test_fused_matches_float64(case, monkeypatch):
    """The one-launch prefill (prefill_fused.py, FUSED) on plain plans with fp16 q / k (the
    layer's form): outputs and final states against the float64 recurrence, padding slots never
    touched, other slots bit-identical, every output row written (run_case); lengths that end
    mid-chunk, empty sequences, one chunk, a long sequence; the call took the fused kernel."""
    lens, Hk, Hv, io, pool_dtype, pad, all_init = case
    monkeypatch.setattr(_mod(), "FUSED", True)
    *_, plan, _ = run_case(lens, Hk, Hv, pool_dtype=pool_dtype, v_split=1, io=io, qk=torch.float16,
                           seed=6900 + Hv + len(lens), pad_frac=pad, all_init=all_init)
    assert _ran_fused(plan), "the call did not take the one-launch kernel"


@pytest.mark.parametrize("case", [FUSED_CASES[0], FUSED_CASES[5]], ids=lambda c: f"{len(c[0])}seq-{c[1]}-{c[2]}")
def test_fused_pingpong_is_bit_identical(case, monkeypatch):
    """The one-launch prefill with its consumer warpgroups' ping-pong (FUSED_PINGPONG: they take
    turns to issue their wgmma) against without, on the same inputs: the same operations in
    another order of issue, so outputs and pool slots bit-identical; and the float64 check."""
    lens, Hk, Hv, io, pool_dtype, pad, all_init = case
    monkeypatch.setattr(_mod(), "FUSED", True)
    got = {}
    for pingpong in (False, True):
        monkeypatch.setattr(_mod(), "FUSED_PINGPONG", pingpong)
        gen = torch.Generator(device="cuda").manual_seed(6950 + Hv)
        q, k, v, g, beta = make_case(lens, Hk, Hv, io=io, qk=torch.float16, gen=gen)
        pool = make_pool(len(lens) + 2, Hv, pool_dtype, gen)
        pool0 = pool.clone()
        out = torch.full((sum(lens), Hv, HD), float("nan"), dtype=io, device="cuda")
        plan = make_plan(lens, Hv, Hk, 1)
        slots = torch.arange(len(lens), dtype=torch.int32, device="cuda")
        _launch().prefill(q, k, v, g, beta, pool, slots, plan, has_initial_state=None, scale=HD ** -0.5, out=out)
        assert _ran_fused(plan)
        got[pingpong] = (out, pool)
    assert torch.equal(got[True][0], got[False][0]), "outputs differ with the ping-pong"
    bits = torch.int16 if pool_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got[True][1].view(bits), got[False][1].view(bits)), "pool slots differ with the ping-pong"
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    init = torch.stack([pool0[i].double() for i in range(len(lens))])
    o_ref, s_ref = reference.recurrent_gdn(q.double(), k.double(), v.double(), g.double(), beta.double(), cu, init,
                                           HD ** -0.5)
    assert rel(got[True][0], o_ref) <= TOL
    assert rel(got[True][1][:len(lens)], s_ref) <= (TOL if pool_dtype == torch.float32 else TOL_BF16_STATE)


def test_many_sequences():
    rng = random.Random(11)
    lens = [rng.choice([0, 1, 5, 63, 64, 65, 100, 257]) for _ in range(64)]
    e = run_case(lens, 4, 16, seed=11, pad_frac=0.1)
    print(f"64 seqs: o {e[0]:.2e} state {e[1]:.2e}")


@pytest.mark.parametrize("L,v_split", [(8191, 1), (8191, 4), (32768, 2)])
def test_long(L, v_split):
    e = run_case([L], 2, 8, v_split=v_split, seed=L + v_split, init_frac=1.0)
    print(f"len {L} v_split {v_split}: o {e[0]:.2e} state {e[1]:.2e}")


@pytest.mark.parametrize("v_split", [1, 2, 4])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cp_exact(v_split, pool_dtype):
    """Context parallelism, exact path: sequences cut into segments of 3 chunks (up to 10
    segments: 9 map levels in the scan), beside uncut, empty and 1-token sequences, padding
    slots; a quarter of the heads have g = 0 (no decay: only the exact path is correct there)."""
    lens = [64 * 29 + 17, 0, 64 * 3, 1, 64 * 7, 200]
    e = run_case(lens, 2, 8, pool_dtype=pool_dtype, v_split=v_split, seed=500 + v_split,
                 pad_frac=0.2, segment_chunks=3)
    print(f"cp v_split {v_split} pool {pool_dtype}: o {e[0]:.2e} state {e[1]:.2e}")


@pytest.mark.parametrize("Hk,Hv", HEADS)
def test_cp_exact_heads_long(Hk, Hv):
    """CP on long sequences for every head pair: 8191 and 32768 tokens in segments of 64
    chunks, fp32 pool, every sequence with an initial state."""
    lens = [8191, 32768] if Hv <= 16 else [8191, 4097]
    e = run_case(lens, Hk, Hv, v_split=2, seed=600 + Hv, init_frac=1.0, segment_chunks=64)
    print(f"cp heads {Hk}/{Hv}: o {e[0]:.2e} state {e[1]:.2e}")


@pytest.mark.parametrize("cp", ["exact", "auto"])
def test_cp_maps_pass_at_its_own_split(cp):
    """plan.maps_v_split 2 under a v_split 1 plan (the planner's choice where the maps blocks fit
    on the SMs, plan._maps_v_split): the maps pass's two value halves must leave the maps the
    scan and the output pass read."""
    lens = [64 * 29 + 17, 0, 64 * 5, 1, 64 * 9, 200]
    e = run_case(lens, 2, 8, v_split=1, seed=900, pad_frac=0.2, segment_chunks=4, cp=cp, maps_v_split=2)
    print(f"cp {cp}, maps pass at v_split 2: o {e[0]:.2e} state {e[1]:.2e}")


def _expected_warm_starts(g_seq, first, cap):
    """What prefill_warmup.py must find for a segment starting at chunk ``first``: the
    reference's warmup start (reference.warmup_start_chunks) where it lies within ``cap`` chunks,
    else -1 (the exact path); plus, per head, whether the float64 decay sums come within 1e-3 of
    the threshold there (the kernel sums in fp32: a flip by one chunk is allowed only there)."""
    ref = reference.warmup_start_chunks(g_seq, first)
    per_chunk = torch.stack([g_seq[c * 64:(c + 1) * 64].sum(0) for c in range(first - cap, first)])
    back = per_chunk.flip(0).cumsum(0)  # decay of the last 1, 2, ..., cap chunks
    near = ((back - reference.WARMUP_LOG_DECAY).abs() < 1e-3).any(0)
    want = [w if w > 0 and first - w <= cap else -1 for w in ref]
    return want, near.tolist()


@pytest.mark.parametrize("v_split", [1, 2])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cp_warmup(v_split, pool_dtype):
    """Context parallelism with gate warmup (plan.cp "auto"): segments of 4 chunks, warmups of
    at most 2. With these gates (g = 0 on a quarter of the heads, -0.05 to -0.8 per token on the
    others) some heads warm up from a zero state and the rest take the exact path (maps pass,
    scan), in the same launches; the maps pass and the scan skip the (sequence, head) pairs that
    need no map, so an output item that ignored its warm start would read garbage. The finder's
    tables must match reference.warmup_start_chunks under the cap; o and states the float64
    recurrence (the e^-10 truncation is far below the tolerance)."""
    mod = _mod()
    lens = [64 * 29 + 17, 0, 64 * 5, 1, 64 * 9, 200]
    e_o, e_s, plan, g = run_case(lens, 2, 8, pool_dtype=pool_dtype, v_split=v_split, seed=700 + v_split,
                                 pad_frac=0.2, segment_chunks=4, cp="auto")
    cache = {key[0]: val for key, val in plan.kernel_cache.items()}
    tables, (warm_start, need_maps) = cache["hopper_prefill_cp"], cache["hopper_prefill_warm"]
    warm_start, need_maps = warm_start.cpu(), need_maps.cpu()
    cap, cu = mod.max_warmup_chunks(4), plan.cu_seqlens_cpu
    g64 = g.double().cpu()
    kinds = set()
    for j, (seq, nseg, base) in enumerate(tables.cuts.tolist()):
        need = [0] * 8
        for kseg in range(1, nseg):
            want, near = _expected_warm_starts(g64[cu[seq]:cu[seq + 1]], kseg * 4, cap)
            got = warm_start[base + kseg].tolist()
            for h in range(8):
                assert got[h] == want[h] or near[h], f"seq {seq} segment {kseg} head {h}: {got[h]} != {want[h]}"
                need[h] |= got[h] < 0
                kinds.add("exact" if got[h] < 0 else "warmup")
        assert need_maps[j].tolist() == need, f"need_maps of cut sequence {seq}"
    assert kinds == {"exact", "warmup"}, "the case must exercise both paths"
    print(f"cp warmup v_split {v_split} pool {pool_dtype}: o {e_o:.2e} state {e_s:.2e}")


def test_cp_finder_long_warmups():
    """The warmup finder (prefill_warmup.py) alone, on warmups of up to 80 chunks (three 32-chunk
    windows of the warp scan): two cut sequences in segments of L = 160 chunks, per-chunk log
    decays drawn per head from ranges that end the walk in the first, second or third window, never
    (g = 0; too slow for the cap) or at once (an exp that underflowed to 0). warm_start must match
    the float64 walk (reference.warmup_start_chunks on gates with those chunk sums, as
    _expected_warm_starts caps it), items the finder does not own (segment 0, other sequences)
    stay untouched."""
    mod = _mod()
    gen = torch.Generator(device="cpu").manual_seed(4321)
    hv, L = 8, 160
    cap = mod.max_warmup_chunks(L)
    nchunks = [700, 3, 161]  # sequence 1 is uncut
    coffs = [0, 700, 703, 864]
    ranges = [(0.0, 0.0), (-0.14, -0.12), (-0.25, -0.2), (-0.9, -0.6), (-0.11, -0.09), (-0.3, 0.0),
              (-30.0, -12.0), (-1.0, 0.0)]  # (lo, hi) of each head's per-chunk log decay
    lo = torch.tensor([r[0] for r in ranges], dtype=torch.float64)
    hi = torch.tensor([r[1] for r in ranges], dtype=torch.float64)
    log_decay = lo + (hi - lo) * torch.rand(coffs[-1], hv, generator=gen, dtype=torch.float64)
    log_decay[150:153, 5] = -float("inf")  # exp underflowed (segment 1's walk meets it)
    fbuf = torch.randn(coffs[-1], hv, 2, 64, generator=gen)
    fbuf[:, :, 0, 63] = log_decay.exp().float()
    log_decay = fbuf[:, :, 0, 63].double().log()  # what the kernel reads, exactly
    nsegs = [(n + L - 1) // L for n in nchunks]
    cuts = [(0, nsegs[0], 1), (2, nsegs[2], 1 + nsegs[0] + 1)]  # item 0 and the uncut sequence's item are others'
    nitem = 1 + nsegs[0] + 1 + nsegs[2]
    dev = "cuda"
    warm_start = torch.full((nitem, hv), -7, dtype=torch.int32, device=dev)
    need_maps = torch.full((2, hv), -7, dtype=torch.int32, device=dev)
    finder = mod.build(mod.warmup_variant(hv))
    finder(fbuf.to(dev), torch.tensor(coffs, dtype=torch.int32, device=dev),
           torch.tensor(cuts, dtype=torch.int32, device=dev), warm_start, need_maps, L, cap)
    got, need = warm_start.cpu(), need_maps.cpu()
    owned = set()
    windows = set()
    for j, (seq, nseg, base) in enumerate(cuts):
        # Gates whose chunk sums are those decays: each chunk's on its first token.
        g_seq = torch.zeros(nchunks[seq] * 64, hv, dtype=torch.float64)
        g_seq[::64] = log_decay[coffs[seq]:coffs[seq + 1]]
        want_need = [0] * hv
        for k in range(1, nseg):
            owned.add(base + k)
            want, near = _expected_warm_starts(g_seq, k * L, cap)
            for h in range(hv):
                g_, w_ = int(got[base + k, h]), want[h]
                assert g_ == w_ or (near[h] and abs(g_ - w_) == 1), \
                    f"cut {j} segment {k} head {h}: warm_start {g_}, float64 walk {w_}"
                if w_ >= 0:
                    windows.add((k * L - 1 - w_) // 32)
                want_need[h] |= int(w_ < 0)
        assert need[j].tolist() == want_need, f"need_maps of cut {j}"
    assert windows >= {0, 1, 2}, f"the case must end walks in three windows, got {sorted(windows)}"
    for i in set(range(nitem)) - owned:
        assert (got[i] == -7).all(), f"warm_start row {i} is not the finder's and was written"


def test_cp_scan_kernel():
    """The CP scan (prefill_scan.py) alone against the float64 recurrence in the layout maps
    stores: X_k = X_{k-1} @ maps[m, h, 1] + maps[m, h, 0] (m = k * num_cut + j). Three cut
    sequences with 1, 12 and 2 maps, 8 heads. With use_warmup = 1 the pairs with need_maps 0
    must stay bit-identical (and every Phi, and the 1-map sequence, in all cases); then
    use_warmup = 0 scans every pair. Each run four times, with sm_count arguments (the
    persistent grid's size) that make the kernel choose 2, 4 and 8 rows of X per block (its
    choice depends on the pairs with work, which only the device knows), and with 5 blocks, each
    walking several pairs' row blocks through one ring."""
    mod = _mod()
    gen = torch.Generator(device="cuda").manual_seed(99)
    hv, levels = 8, [1, 12, 2]
    ncut = len(levels)
    maps0 = torch.randn(max(levels) * ncut, hv, 2, HD, HD, generator=gen, device="cuda")
    maps0[:, :, 1] *= 0.5 / math.sqrt(HD)  # transitions of norm about 1: the scan stays bounded
    need = torch.randint(0, 2, (ncut, hv), generator=gen, device="cuda", dtype=torch.int32)
    need[:, 0] = 1
    scan = mod.build(mod.scan_variant(hv))
    cut_levels = torch.tensor(levels, dtype=torch.int32, device="cuda")
    for use_warmup in (1, 0):
        nwork = sum(hv if not use_warmup else int(need[j].sum()) for j, n in enumerate(levels) if n > 1)
        want = reference.scan_segment_maps(maps0.double(), levels, skip=(need == 0) if use_warmup else None)
        for sm_count in (64 * nwork, 32 * nwork, 32 * nwork - 1, 5):  # 2, 4, 8, 8 rows per block
            maps = maps0.clone()
            scan(maps, cut_levels, need, use_warmup, sm_count)
            assert torch.equal(maps[:, :, 1], maps0[:, :, 1]), "the scan wrote a transition"
            for j, nlev in enumerate(levels):
                for h in range(hv):
                    assert torch.equal(maps[j, h, 0], maps0[j, h, 0])
                    for lvl in range(1, nlev):
                        m = lvl * ncut + j
                        if use_warmup and not need[j, h]:
                            assert torch.equal(maps[m, h, 0], maps0[m, h, 0]), f"skipped pair ({j}, {h}) written"
                            continue
                        err = rel(maps[m, h, 0], want[m, h, 0])
                        assert err < 1e-5, f"sm_count {sm_count}: cut {j} head {h} level {lvl}: rel err {err:.2e}"


@pytest.mark.parametrize("v_split", [1, 2])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_v8_main(v_split, pool_dtype, monkeypatch):
    """The v8 stage 2 at the splits where V-first is the default (prefill_api.MAIN_IMPL = "v8",
    QLA_SERVE_PREFILL_MAIN=v8): whole sequences (edge lengths, padding slots), then CP with the
    exact path and with gate warmup."""
    monkeypatch.setattr(_mod(), "MAIN_IMPL", "v8")
    e = run_case(EDGE_LENS, 2, 8, pool_dtype=pool_dtype, v_split=v_split, seed=800 + v_split, pad_frac=0.2)
    lens = [64 * 29 + 17, 0, 64 * 3, 1, 64 * 7, 200]
    for cp in ("exact", "auto"):
        e_cp = run_case(lens, 2, 8, pool_dtype=pool_dtype, v_split=v_split, seed=810 + v_split, pad_frac=0.2,
                        segment_chunks=3, cp=cp)
        print(f"v8 v_split {v_split} pool {pool_dtype} cp {cp}: o {e_cp[0]:.2e} state {e_cp[1]:.2e}")
    print(f"v8 v_split {v_split} pool {pool_dtype}: o {e[0]:.2e} state {e[1]:.2e}")


# (heads, pool dtype, v_split) combinations of the loop: those the tests above compile already
# (compiling is the dominant cost on the device), i.e. every head pair and pool with v_split 2
# and the 2/8 pair with v_split 4.
LOOP_COMBOS = [(h, p, 2) for h in HEADS for p in (torch.float32, torch.bfloat16)] + [
    ((2, 8), p, 4) for p in (torch.float32, torch.bfloat16)]


def test_randomized_loop():
    """200 iterations of random small batches (heads, lengths, pool dtype, v_split, padding,
    CP segments of 2-3 chunks or none; half of the CP iterations with gate warmup)."""
    rng = random.Random(1234)
    worst = [0.0, 0.0]
    for it in range(200):
        (Hk, Hv), pool_dtype, vs = rng.choice(LOOP_COMBOS)
        N = rng.randint(1, 8)
        lens = [rng.choice([0, 1, rng.randint(1, 200), rng.randint(1, 700)]) for _ in range(N)]
        L = rng.choice([0, 0, 2, 3])  # a third of the iterations take the CP path
        e = run_case(lens, Hk, Hv, pool_dtype=pool_dtype, v_split=vs, seed=10_000 + it, pad_frac=0.15,
                     segment_chunks=L, cp=rng.choice(["auto", "exact"]) if L else None)
        worst = [max(worst[0], e[0]), max(worst[1], e[1])]
    print(f"randomized loop worst: o {worst[0]:.2e} state {worst[1]:.2e}")


def test_no_sequences_touch_nothing():
    """A 0-length-only batch still writes final = initial state; no NaN anywhere."""
    run_case([0, 0, 0], 2, 8, seed=3)


def test_sanitizer_case(monkeypatch):
    """The small case scripts/gpu_prefill.sh also runs under compute-sanitizer memcheck and
    racecheck (SANITIZE=1); here it is a plain correctness check: 2/8 heads, v_split 2 and 4,
    lengths that end mid-chunk, padding slots, and the CP path (segments of 2 chunks: the maps
    pass, the scan and the output pass; exact, then with gate warmup), on the default stage-2
    kernels (V-first at v_split 1/2, v8 at 4); a v_split 1 plan whose maps pass runs at split 2
    (plan.maps_v_split); the one-launch prefill (FUSED) on a plain plan; then v8 at v_split 1
    with CP and warmup."""
    for vs in (2, 4):
        run_case([65, 1, 130], 2, 8, v_split=vs, seed=77 + vs, pad_frac=0.3)
    for cp in ("exact", "auto"):
        run_case([65, 1, 300], 2, 8, v_split=2, seed=79, pad_frac=0.3, segment_chunks=2, cp=cp)
    run_case([65, 1, 300], 2, 8, v_split=1, seed=81, pad_frac=0.3, segment_chunks=2, cp="auto", maps_v_split=2)
    monkeypatch.setattr(_mod(), "FUSED", True)  # the one-launch prefill (plain, fp16 q / k)
    run_case([65, 1, 130], 2, 8, v_split=1, qk=torch.float16, seed=83, pad_frac=0.3)
    monkeypatch.setattr(_mod(), "FUSED", False)
    monkeypatch.setattr(_mod(), "MAIN_IMPL", "v8")
    run_case([65, 1, 300], 2, 8, v_split=1, seed=80, pad_frac=0.3, segment_chunks=2, cp="auto")


@pytest.mark.parametrize("v_split,segment_chunks,cp,impl", [
    (1, 0, None, "vfirst"), (2, 0, None, "vfirst"), (4, 0, None, "v8"), (1, 0, None, "v8"),
    (1, 3, "exact", "vfirst"), (2, 3, "auto", "vfirst"), (1, 3, "exact", "v8"), (1, 0, None, "fused")])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_checkpoints(v_split, segment_chunks, cp, impl, pool_dtype, monkeypatch):
    """Prefill checkpoints (vLLM 0.33's align-mode prefix caching, docs/vllm_checkpoints.md): the
    state after chunks[s] * 64 tokens of sequence s lands in pool slot slots[s], from the item
    whose walk holds that boundary (whole sequences, V splits, CP segments exact and gate-warmed,
    both stage-2 kernels), against the float64 recurrence over each sequence's first chunks[s] *
    64 tokens; the outputs, final states and every other slot as without checkpoints. "fused":
    the one-launch prefill (FUSED, fp16 q / k)."""
    fused = impl == "fused"
    monkeypatch.setattr(_mod(), "MAIN_IMPL", "vfirst" if fused else impl)
    monkeypatch.setattr(_mod(), "FUSED", fused)
    Hk, Hv = 2, 8
    lens = [300, 1000, 64 * 20 + 5, 0, 64, 700]
    chunks = [4, 0, 13, 0, 1, 9]          # 0: none; 1 x 64 = the whole of sequence 4
    gen = torch.Generator(device="cuda").manual_seed(11 + v_split + segment_chunks)
    q, k, v, g, beta = make_case(lens, Hk, Hv, qk=torch.float16 if fused else None, gen=gen)
    N, S = len(lens), 2 * len(lens) + 2
    pool = make_pool(S, Hv, pool_dtype, gen)
    slot_ids = [0, 1, 2, 3, 4, 5]
    ck_slots = [7, 8, 9, -1, 10, -1]      # -1: no checkpoint slot (vLLM's null block), never written
    has = [True, False, True, False, True, True]
    before = pool.clone()
    init = torch.zeros(N, Hv, HD, HD, dtype=torch.float64, device="cuda")
    for i, s in enumerate(slot_ids):
        if has[i]:
            init[i] = pool[s].double()
    dev = dict(dtype=torch.int32, device="cuda")
    out = torch.full((sum(lens), Hv, HD), float("nan"), dtype=v.dtype, device="cuda")
    plan = make_plan(lens, Hv, Hk, v_split, segment_chunks, cp)
    _launch().prefill(q, k, v, g, beta, pool, torch.tensor(slot_ids, **dev), plan,
                      has_initial_state=torch.tensor(has, device="cuda"), scale=HD ** -0.5, out=out,
                      checkpoints=(torch.tensor(chunks, **dev), torch.tensor(ck_slots, **dev)))
    assert _ran_fused(plan) == fused
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    f64 = [x.double() for x in (q, k, v, g, beta)]
    o_ref, s_ref = reference.recurrent_gdn(*f64, cu, init, HD ** -0.5)
    tol_s = TOL if pool_dtype == torch.float32 else TOL_BF16_STATE
    assert rel(out, o_ref) <= TOL
    assert rel(pool[torch.tensor(slot_ids, device="cuda")], s_ref) <= tol_s
    # the truth at each checkpoint: the recurrence over the sequence's first chunks[s] * 64 tokens
    want = [(s, i) for i, s in enumerate(ck_slots) if s >= 0 and chunks[i] > 0]
    rows = [t for _, i in want for t in range(cu[i], cu[i] + 64 * chunks[i])]
    rows_t = torch.tensor(rows, device="cuda")
    cu_ck = [0]
    for _, i in want:
        cu_ck.append(cu_ck[-1] + 64 * chunks[i])
    _, ck_ref = reference.recurrent_gdn(*(x[rows_t] for x in f64), cu_ck, init[[i for _, i in want]], HD ** -0.5)
    got = pool[torch.tensor([s for s, _ in want], device="cuda")]
    assert not torch.isnan(got).any()
    assert rel(got, ck_ref) <= tol_s, f"checkpoint states rel L2 {rel(got, ck_ref):.3e}"
    untouched = sorted(set(range(S)) - set(slot_ids) - {s for s, _ in want})
    u = torch.tensor(untouched, device="cuda")
    bits = torch.int16 if pool_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(pool[u].view(bits), before[u].view(bits)), "slots outside the batch changed"


CP_CASES = [  # (lens, Hk, Hv, v_split, segment_chunks, cp, stage 2)
    ([64 * 29 + 17, 0, 64 * 5, 1, 64 * 9, 200], 2, 8, 1, 4, "exact", "vfirst"),  # maps, scan
    ([64 * 29 + 17, 0, 64 * 5, 1, 64 * 9, 200], 2, 8, 2, 4, "auto", "vfirst"),   # + warmup finder
    ([64 * 29 + 17, 0, 64 * 5, 1, 64 * 9, 200], 2, 8, 4, 4, "auto", "v8"),
    ([32768], 2, 8, 1, 32, "auto", "vfirst"),  # the long-prompt row: every pass busy
    ([8192] * 4, 4, 16, 1, 16, "exact", "vfirst"),
]


@pytest.mark.parametrize("case", CP_CASES, ids=lambda c: f"{len(c[0])}seq-{c[1]}-{c[2]}-vs{c[3]}-L{c[4]}-{c[5]}-{c[6]}")
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cp_pdl_matches_plain_launches(case, pool_dtype, monkeypatch):
    """The CP passes as programmatic dependent launches (prefill_api.CP_PDL: the finder, the
    maps pass and the scan each trigger the next launch and wait for the grid before) against
    the plain launches, which the float64 tests above check: outputs and pool bit-identical,
    eagerly and in a CUDA graph replayed three times (each replay from the same pool), padded
    slots and poisoned slots outside the batch included. A kernel that read its predecessor's
    output before the wait, or a grid that completed before the one it follows, would show as a
    difference (or as replay-to-replay variation) on these batches, the long one keeping every
    pass busy."""
    lens, Hk, Hv, vs, L, cp, impl = case
    mod = _mod()
    monkeypatch.setattr(mod, "MAIN_IMPL", impl)
    gen = torch.Generator(device="cuda").manual_seed(4242 + len(lens) + vs + L)
    q, k, v, g, beta = make_case(lens, Hk, Hv, gen=gen)
    N = len(lens)
    pool0 = make_pool(2 * N + 2, Hv, pool_dtype, gen)
    slots = torch.tensor([2 * i + 1 if i % 3 != 2 else -1 for i in range(N)], dtype=torch.int32, device="cuda")
    has = torch.tensor([i % 4 != 1 for i in range(N)], device="cuda")
    plan = make_plan(lens, Hv, Hk, vs, L, cp)

    def call(pool, out):
        _launch().prefill(q, k, v, g, beta, pool, slots, plan, has_initial_state=has, scale=HD ** -0.5, out=out)

    def fresh():
        return pool0.clone(), torch.full((sum(lens), Hv, HD), float("nan"), dtype=v.dtype, device="cuda")

    monkeypatch.setattr(mod, "CP_PDL", False)
    want_pool, want_out = fresh()
    call(want_pool, want_out)
    monkeypatch.setattr(mod, "CP_PDL", True)
    pool, out = fresh()
    call(pool, out)
    bits = torch.int16 if pool_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)), "eager: outputs differ"
    assert torch.equal(pool.view(bits), want_pool.view(bits)), "eager: pool differs"
    pool, out = fresh()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        call(pool, out)
    torch.cuda.current_stream().wait_stream(stream)
    for replay in range(3):
        pool.copy_(pool0)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)), f"replay {replay}: outputs differ"
        assert torch.equal(pool.view(bits), want_pool.view(bits)), f"replay {replay}: pool differs"
