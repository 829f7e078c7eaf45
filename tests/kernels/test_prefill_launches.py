"""Host side of the Hopper prefill: which kernels one call launches, in which order, with which
arguments (kernels/hopper/prefill_launch.prefill). CPU only.

The compiled kernels cannot run without a GPU, so here each launch goes to a recording stand-in
(launch_check.record_launches: the only stand-in in this file) instead of the TileLang kernel;
everything else is real: the plan, its segment tables, the workspaces, the kernel switches, and
the program each variant builds (prefill_api.build, uncompiled). Every recorded argument list is
matched, by position, against that program's parameters (count, dtypes, ranks, extents and
strides: launch_check.check_arguments), so an argument missing, extra, out of order or misshapen
fails here rather than on the H200.
The kernels themselves run in tests/kernels/test_prefill_gpu.py.
"""

import pytest
import torch

import qla_serve
from qla_serve.bench.prefill import ROWS
from qla_serve.kernels.hopper import prefill_api as P
from qla_serve.kernels.hopper import prefill_launch as PL
from qla_serve.plan import force_plan

from launch_check import check_arguments, record_launches  # tests/kernels/launch_check.py

HV, HK = 8, 2


@pytest.fixture
def launches(monkeypatch):
    """Replace every kernel launch by a recorder: a list of (variant, {param name: argument}),
    each launch checked against the program the variant builds (launch_check.py)."""
    record_launches(monkeypatch)   # tilelang.compile returns the program; caches start empty
    calls = []

    def fake_fn(variant, target):
        program = P.build(variant, target).func

        def launch(*args):
            calls.append((variant, check_arguments(program, args, variant["name"])))
        return launch

    monkeypatch.setattr(PL, "_fn", fake_fn)
    # the package defaults, whatever the environment says; tests that need v8 switch to it
    monkeypatch.setattr(P, "GATE_WARMUP", True)
    monkeypatch.setattr(P, "MAIN_IMPL", "vfirst")
    monkeypatch.setattr(P, "PREP_HEADS", 0)
    monkeypatch.setattr(P, "PERSISTENT", True)
    return calls


def _call(lens, v_split, segment_chunks, cp, inputs=None, maps_v_split=None, checkpoints=None):
    T = sum(lens)
    q = torch.randn(T, HK, 128, dtype=torch.bfloat16)
    k = torch.randn(T, HK, 128, dtype=torch.bfloat16)
    v = torch.randn(T, HV, 128, dtype=torch.bfloat16)
    g = torch.zeros(T, HV)
    beta = torch.ones(T, HV)
    pool = torch.zeros(len(lens) + 1, HV, 128, 128)
    slots = torch.arange(len(lens), dtype=torch.int32)
    out = torch.empty_like(v)
    plan = qla_serve.plan_prefill(lens, HV, HK, device="cpu", cp="off", arch="sm90",
                                  supported_strategies={"plain", "vsplit"})
    strategy = "cp" if segment_chunks else ("plain" if v_split == 1 else "vsplit")
    plan = force_plan(plan, strategy, v_split, segment_chunks, cp,
                      maps_v_split=(maps_v_split or v_split) if segment_chunks else None)
    if inputs is not None:
        inputs.update(q=q, k=k, v=v)
    PL.prefill(q, k, v, g, beta, pool, slots, plan, has_initial_state=None, scale=None, out=out,
               checkpoints=checkpoints)
    return plan


def _sequence(calls):
    return [(v["op"].replace("prefill_", ""), v.get("mode", ""),
             (v.get("impl", "v8") + ("+persistent" if v.get("persistent") else "")) if v["op"] == "prefill_main"
             else "") for v, _ in calls]


@pytest.mark.parametrize("v_split", [1, 2])
def test_plain_call_is_prep_then_persistent_main(launches, v_split):
    """Plain and V-split plans: stage 1, then the V-first stage 2 on the persistent grid, its
    units' sequences longest first and one CTA per SM (fewer where there are fewer units)."""
    plan = _call([300, 0, 65], v_split, 0, None)
    assert _sequence(launches) == [("prep", "", ""), ("main", "output", "vfirst+persistent")]
    main = launches[1][1]
    assert main["items"].tolist() == [0, 2, 1]
    assert main["ctas"].shape == (min(3 * HV * v_split, plan.sm_count),)


@pytest.mark.parametrize("v_split,lens,switch", [(1, [300, 0, 65], False), (2, [300, 0, 65], False),
                                                  (1, [64 * 9, 64 * 8, 64 * 8], True)])
def test_unit_grid_when_persistent_is_off(launches, monkeypatch, v_split, lens, switch):
    """A CTA per unit where PERSISTENT is off, or where the sequences average more than
    PERSISTENT_MAX_MEAN_CHUNKS chunks (here 25 chunks over 3 sequences)."""
    monkeypatch.setattr(P, "PERSISTENT", switch)
    _call(lens, v_split, 0, None)
    assert _sequence(launches) == [("prep", "", ""), ("main", "output", "vfirst")]
    main = launches[1][1]
    assert (main["use_items"], main["use_warmup"]) == (0, 0)


# the bench's mixed8192 row: one 32-chunk sequence among 25 shorter ones (5.4 chunks on average)
MIXED8192 = ROWS["mixed8192"]


def test_unit_grid_for_a_ragged_batch(launches):
    """A CTA per unit where the persistent grid's static dealing would load one CTA well past
    the longest unit: at 2/8, v_split 2 (the planner's plan for it), the CTA that takes the
    32-chunk sequence's first unit also takes one unit of each later round (38 chunks against 32;
    H200: 0.0866 ms against 0.0764). A uniform batch of the same mean stays persistent (every CTA
    walks 3 or 4 units either way)."""
    _call(MIXED8192, 2, 0, None)
    assert _sequence(launches) == [("prep", "", ""), ("main", "output", "vfirst")]
    launches.clear()
    _call([320] * 26, 2, 0, None)
    assert _sequence(launches) == [("prep", "", ""), ("main", "output", "vfirst+persistent")]


def test_static_dealing_chunks_against_the_dealing():
    """static_dealing_chunks (runs of equal chunk counts, a difference array) against dealing
    every unit to CTA u % ncta one by one, on random batches; and the rule on the H200's A/B:
    16/64's mixed8192 (64 units per sequence, 12.6 per CTA) stays persistent (0.317 ms against
    0.331 per unit), 4/16's goes per unit, 64x512 stays persistent."""
    import collections
    import random

    rng = random.Random(0)
    for _ in range(500):
        chunks = sorted((rng.randint(0, 40) for _ in range(rng.randint(1, 30))), reverse=True)
        units, ncta = rng.choice([1, 3, 8, 16, 64, 200]), rng.randint(1, 140)
        loads = [0] * ncta
        for u, c in enumerate(c for c in chunks for _ in range(units)):
            loads[u % ncta] += c
        runs = sorted(collections.Counter(chunks).items(), reverse=True)
        assert P.static_dealing_chunks(runs, units, ncta) == max(loads), (chunks, units, ncta)
    assert P.persistent_applies("plain", "vfirst", MIXED8192, 64, 132)       # 16/64, plain
    assert not P.persistent_applies("plain", "vfirst", MIXED8192, 16, 132)   # 4/16 (0.131 / 0.117 ms)
    assert P.persistent_applies("plain", "vfirst", [512] * 64, 8, 132)
    assert not P.persistent_applies("cp", "vfirst", [512] * 64, 8, 132)


def test_cp_exact_launches_no_warmup(launches):
    _call([64 * 10, 100], 1, 3, "exact")
    assert _sequence(launches) == [("prep", "", ""), ("main", "maps", "vfirst"), ("cp_scan", "", ""),
                                   ("main", "output", "vfirst")]
    assert all(args.get("use_warmup", 0) == 0 for _, args in launches)


@pytest.mark.parametrize("switch_on", [False, True])
def test_cp_auto_launches_the_finder_only_when_switched_on(launches, monkeypatch, switch_on):
    monkeypatch.setattr(P, "GATE_WARMUP", switch_on)
    monkeypatch.setattr(P, "MAIN_IMPL", "v8")
    plan = _call([64 * 10, 100], 1, 4, "auto")
    seq = _sequence(launches)
    if not switch_on:  # QLA_SERVE_GATE_WARMUP=0: cp="auto" runs the exact path
        assert ("cp_warmup", "", "") not in seq
        return
    assert seq == [("prep", "", ""), ("cp_warmup", "", ""), ("main", "maps", "v8"), ("cp_scan", "", ""),
                   ("main", "output", "v8")]
    finder, maps_pass, scan, output = (args for _, args in launches[1:])
    tables = next(v for key, v in plan.kernel_cache.items() if key[0] == "hopper_prefill_cp")
    # the finder writes the very tensors the three passes read, and knows the cut and the cap
    assert finder["warm_start"] is output["warm_start"] is maps_pass["warm_start"]
    assert finder["need_maps"] is maps_pass["need_maps"] is scan["need_maps"]
    assert finder["warm_start"].shape == (tables.out_items.shape[0], HV)
    assert finder["need_maps"].shape == (tables.num_cut, HV)
    assert (finder["segment_chunks"], finder["max_warmup"]) == (4, 2)
    assert finder["cuts"] is tables.cuts and output["items"] is tables.out_items
    assert (maps_pass["use_warmup"], scan["use_warmup"], output["use_warmup"]) == (1, 1, 1)


@pytest.mark.parametrize("main_impl,v_split,impl", [("vfirst", 1, "vfirst"), ("vfirst", 2, "vfirst"),
                                                    ("vfirst", 4, "v8"), ("v8", 1, "v8"), ("v8", 2, "v8")])
def test_main_switch_selects_the_stage2_kernel(launches, monkeypatch, main_impl, v_split, impl):
    monkeypatch.setattr(P, "MAIN_IMPL", main_impl)
    _call([64 * 10, 100], v_split, 3, "exact")
    mains = [(mode, which) for op, mode, which in _sequence(launches) if op == "main"]
    assert mains == [("maps", impl), ("output", impl)]


@pytest.mark.parametrize("main_impl,v_split,segment_chunks", [("vfirst", 1, 0), ("vfirst", 2, 0), ("vfirst", 4, 0),
                                                              ("v8", 1, 0), ("vfirst", 1, 3), ("vfirst", 2, 3)])
def test_stage1_form_matches_the_stage2_kernel(launches, monkeypatch, main_impl, v_split, segment_chunks):
    """V-first reads M (prep form "m") and v itself: without a cut at v_split 1 packed, P^T and M
    in one tile with M's diagonal apart (stage 2's `pd`), on the persistent grid too; else (a cut,
    or V-split CTAs per head) P (`pd`) and M apart, in every pass. v8
    reads P, U0 and -Wk (form "uw"). The tiles stage 2 loads are the very tensors stage 1 wrote;
    the outputs not written are 1-row stand-ins."""
    monkeypatch.setattr(P, "MAIN_IMPL", main_impl)
    inputs = {}
    _call([300, 0, 65] if not segment_chunks else [64 * 10, 100], v_split, segment_chunks,
          "exact" if segment_chunks else None, inputs)
    (prep_v, prep), *mains = [(v, a) for v, a in launches if v["op"] in ("prefill_prep", "prefill_main")]
    impl = mains[-1][0].get("impl", "v8")
    packed = impl == "vfirst" and not segment_chunks and v_split == 1
    assert prep_v.get("form", "uw") == P.PREP_FORM[impl] and prep_v.get("packed", False) == packed
    chunks = 7 if not segment_chunks else 12  # 5 (300 tokens) + 2 (65); 10 + 2 (100)
    if impl == "vfirst":
        written, unread = (("mbuf", "dbuf"), ("pbuf", "ubuf", "wbuf")) if packed else \
            (("pbuf", "mbuf"), ("dbuf", "ubuf", "wbuf"))
    else:
        written, unread = ("pbuf", "ubuf", "wbuf"), ("mbuf", "dbuf")
    for name in written:
        assert prep[name].shape[0] == chunks, name
    for name in unread:
        assert prep[name].shape[0] == 1, name
    for main_v, main in mains:
        assert main_v.get("packed", False) == packed, main_v["name"]
        assert main["fbuf"] is prep["fbuf"]
        if impl == "vfirst":
            assert main["mbuf"] is prep["mbuf"] and main["pd"] is prep["dbuf" if packed else "pbuf"]
        else:
            assert all(main[name] is prep[name] for name in written)
        assert (main.get("values") is inputs["v"]) == (impl == "vfirst")


@pytest.mark.parametrize("maps_split", [1, 2])
def test_maps_pass_split_may_differ_from_the_plan(launches, maps_split):
    """plan.maps_v_split: the maps pass at its own value split, the output pass at the plan's;
    both V-first, so both read the prep form "m"."""
    _call([64 * 10, 100], 1, 3, "exact", maps_v_split=maps_split)
    mains = [(v["mode"], v["v_split"]) for v, _ in launches if v["op"] == "prefill_main"]
    assert mains == [("maps", maps_split), ("output", 1)]


def test_maps_pass_split_must_read_the_plans_prep_form(launches):
    """v_split 4 runs v8 (prep form "uw"): not a maps split for a V-first plan."""
    with pytest.raises(ValueError, match="plan.maps_v_split: 4 runs v8"):
        _call([64 * 10, 100], 1, 3, "exact", maps_v_split=4)


def _resolved(plan):
    return [key for key in plan.kernel_cache if key[0] == "hopper_prefill_launches"]


def test_a_plans_later_calls_bind_their_own_tensors(launches, monkeypatch):
    """prefill_launch._Launches: a plan's launches are resolved on its first call and reused (every
    GDN layer of a step), but each call launches with its own tensors and flags; a call of
    another shape (has_initial_state given instead of None) or under another switch
    (GATE_WARMUP) gets launches of its own."""
    plan = _call([64 * 10, 100], 1, 3, "auto")
    first = list(launches)
    assert len(_resolved(plan)) == 1 and first[-1][1]["all_init"] == 1  # has_initial_state=None
    T = 64 * 10 + 100
    q2, k2, v2 = (torch.randn(T, h, 128, dtype=torch.bfloat16) for h in (HK, HK, HV))
    g, beta, out2 = torch.zeros(T, HV), torch.ones(T, HV), torch.empty(T, HV, 128, dtype=torch.bfloat16)
    pool2 = torch.zeros(3, HV, 128, 128)
    slots = torch.arange(2, dtype=torch.int32)
    flags = torch.tensor([True, False])

    def call():
        launches.clear()
        PL.prefill(q2, k2, v2, g, beta, pool2, slots, plan, has_initial_state=flags, scale=0.5, out=out2)

    call()
    assert _sequence(launches) == _sequence(first) and len(_resolved(plan)) == 2
    prep, main = launches[0][1], launches[-1][1]
    assert prep["q"] is q2 and prep["k"] is k2 and prep["scale"] == 0.5
    assert main["values"] is v2 and main["pool"] is pool2 and main["out"] is out2
    assert main["has_init"].data_ptr() == flags.data_ptr() and main["all_init"] == 0
    call()  # the same shape again: the second resolution is reused
    assert len(_resolved(plan)) == 2
    monkeypatch.setattr(P, "GATE_WARMUP", False)  # from now on this plan's calls drop the finder
    call()
    assert ("cp_warmup", "", "") in _sequence(first) and ("cp_warmup", "", "") not in _sequence(launches)


def test_misaligned_pool_rejected_before_any_launch(launches):
    """Stage 2 moves states in 8-byte pairs and assumes 16-byte slot strides (as decode does):
    a pool whose stride(0) is not a multiple of 16 bytes is refused by name, nothing launched."""
    lens, T = [100, 30], 130
    q, k, v = (torch.randn(T, h, 128, dtype=torch.bfloat16) for h in (HK, HK, HV))
    slot = HV * 128 * 128 + 1
    pool = torch.zeros(3 * slot).as_strided((3, HV, 128, 128), (slot, 128 * 128, 128, 1))
    plan = qla_serve.plan_prefill(lens, HV, HK, device="cpu", cp="off", arch="sm90",
                                  supported_strategies={"plain", "vsplit"})
    with pytest.raises(ValueError, match=r"pool: expected a 16-byte aligned base and a slot stride"):
        PL.prefill(q, k, v, torch.zeros(T, HV), torch.ones(T, HV), pool, torch.arange(2, dtype=torch.int32),
                   plan, has_initial_state=None, scale=None, out=torch.empty_like(v))
    assert launches == []


@pytest.mark.parametrize("lens,heads", [([64 * 128], 2), ([64 * 128] * 4, 4), ([64 * 144], 2), ([64 * 166], 4),
                                        ([300, 0, 65], 1)])
def test_stage1_heads_per_cta_by_the_rule(launches, lens, heads):
    """The prep variant a call launches takes prep_heads_per_cta's choice for its chunk count
    (2/8 heads: two-head CTAs at 128 and 144 chunks, one wave of them at five per SM; four-head
    ones at 166 and 512; one head where one wave of one-head CTAs holds the call, 7 chunks here),
    solving two heads at a time where it has two or four (PREP_PAIR, the default)."""
    _call(lens, 2, 0, None)
    prep = launches[0][0]
    assert prep["op"] == "prefill_prep" and prep.get("heads_per_cta", 1) == heads
    assert prep.get("pair_solve", False) == (heads >= 2)


def test_heads_per_cta_rule(monkeypatch):
    """The rule against session 65's H100 measurements with the pair solve (benchmarks/prefill.md,
    "Stage 1's pair solve"): four heads per CTA measured fastest in stage 1 at 2/8 512 chunks,
    4/16 128 (one wave of four-head CTAs) and 512, 16/64 128 and 512 (by 2-16%); two heads at 2/8
    128 chunks (one wave of two-head CTAs: 5% faster in stage 1 and ~1% in the call than four,
    which the fit's lines alone would take there); the fewest heads whose CTAs fit one wave at
    the CTAs per SM their resources allow (one head: 5, two solved as a pair: 5, four: 4), else
    the lines; without the pair solve two heads count 4 per SM; 1 where Hv / Hk has no other
    divisor among the choices or the form is "uw", and a forced PREP_HEADS clipped to a divisor
    of Hv / Hk."""
    rule = P.prep_heads_per_cta
    assert [rule(8, 2, n, "m", 132) for n in (1, 82, 83, 128, 144, 165, 166, 512)] == [1, 1, 2, 2, 2, 2, 4, 4]
    assert [rule(64, 16, n, "m", 132) for n in (10, 11, 16, 20, 21, 128, 512)] == [1, 2, 2, 2, 4, 4, 4]
    assert [rule(16, 4, n, "m", 132) for n in (41, 42, 66, 82, 83, 128, 512)] == [1, 2, 2, 2, 4, 4, 4]
    assert {rule(24, 8, n, "m", 132) for n in (1, 128, 512, 4096)} == {1}
    assert rule(64, 16, 512, "uw", 132) == 1
    monkeypatch.setattr(P, "PREP_PAIR", False)
    assert [rule(8, 2, n, "m", 132) for n in (132, 133, 144)] == [2, 4, 4]


def test_forced_heads_per_cta_is_clipped(monkeypatch):
    monkeypatch.setattr(P, "PREP_HEADS", 4)
    assert P.prep_heads_per_cta(32, 16, 1, "m", 132) == 2  # Hv / Hk = 2
    assert P.prep_heads_per_cta(24, 8, 512, "m", 132) == 1  # Hv / Hk = 3
    monkeypatch.setattr(P, "PREP_HEADS", 1)
    assert P.prep_heads_per_cta(64, 16, 512, "m", 132) == 1
    monkeypatch.setenv("QLA_SERVE_PREP_HEADS", "3")
    with pytest.raises(ValueError, match="QLA_SERVE_PREP_HEADS"):
        P._prep_heads_from_env()


@pytest.mark.parametrize("segment_chunks", [0, 3])
def test_checkpoints_reach_the_output_pass_only(launches, segment_chunks):
    """Prefill checkpoints go to stage 2's output pass (use_ckpt 1, the chunk and slot tensors);
    the CP maps pass never writes them; without checkpoints the flag is 0."""
    ck = (torch.tensor([2, 0], dtype=torch.int32), torch.tensor([5, -1], dtype=torch.int32))
    _call([64 * 10, 100], 1, segment_chunks, "exact" if segment_chunks else None, checkpoints=ck)
    mains = [args for v, args in launches if v["op"] == "prefill_main"]
    output = mains[-1]
    assert output["use_ckpt"] == 1 and output["ckpt_chunk"] is ck[0] and output["ckpt_slot"] is ck[1]
    assert all(m["use_ckpt"] == 0 for m in mains[:-1])
    launches.clear()
    _call([64 * 10, 100], 1, segment_chunks, "exact" if segment_chunks else None)
    assert all(args["use_ckpt"] == 0 for v, args in launches if v["op"] == "prefill_main")
