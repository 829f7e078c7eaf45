"""GPU tests of the TileLang decode / verify kernels against the float64 reference.

Every check draws fresh random inputs with realistic gates (g in [-0.5, 0] with some heads at
g = 0, beta in (0, 1), unit-norm k unless the kernel normalises), runs the kernel module
(qla_serve.kernels.hopper.decode) directly, and compares with qla_serve.kernels.reference in
float64 on the same (bf16/fp16-rounded) inputs. Pools are poisoned outside the batch's slots
and must stay bit-identical there. Tolerances: relative L2 error <= 2e-3 for outputs and fp32
states; bf16 pools store states rounded to bf16 (unit roundoff 2^-9), bound 6e-3.
"""

import importlib

import pytest
import torch

from gdn_inputs import rel_err as rel
from qla_serve.kernels import reference

pytestmark = pytest.mark.gpu

HD = 128
TOL = 2e-3
TOL_BF16_STATE = 6e-3


def _mod():
    # The package exports a function named `decode`; the submodule comes from sys.modules.
    return importlib.import_module("qla_serve.kernels.hopper.decode")


def make_case(T, Hk, Hv, *, io=torch.bfloat16, gating="gb", l2norm=False, gen, dev="cuda"):
    """Inputs of T token rows. q, k, v are strided views of one fused projection
    [T, 2*Hk*128 + Hv*128 + 64] (as the engines pass them); a, b are views of a [T, 2*Hv] tensor.
    gating "gb" (fp32 g, beta), "ab" (raw a, b in io; A_log, dt_bias fp32) or "ab-sglang" (as
    "ab" with dt_bias in the io dtype: SGLang's layers)."""
    width = (2 * Hk + Hv) * HD + 64
    proj = torch.randn(T, width, generator=gen, device=dev).to(io)
    q = proj[:, : Hk * HD].view(T, Hk, HD)
    k = proj[:, Hk * HD: 2 * Hk * HD].view(T, Hk, HD)
    v = proj[:, 2 * Hk * HD: (2 * Hk + Hv) * HD].view(T, Hv, HD)
    if not l2norm:  # the kernel expects unit-norm q/k then: normalise in place (still strided)
        q.copy_(reference.l2norm(q.float()).to(io))
        k.copy_(reference.l2norm(k.float()).to(io))
    c = dict(q=q, k=k, v=v, g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None)
    if gating == "gb":
        g = -torch.rand(T, Hv, generator=gen, device=dev) * 0.5
        g[:, : max(1, Hv // 4)] = 0.0                      # heads that do not decay
        c["g"], c["beta"] = g, torch.rand(T, Hv, generator=gen, device=dev) * 0.98 + 0.01
    else:
        ab = (torch.randn(T, 2 * Hv, generator=gen, device=dev) * 0.7).to(io)
        c["a"], c["b"] = ab[:, :Hv], ab[:, Hv:]             # strided views
        c["A_log"] = torch.log(torch.rand(Hv, generator=gen, device=dev) * 15 + 1)
        dt = torch.rand(Hv, generator=gen, device=dev) * 0.099 + 0.001
        c["dt_bias"] = torch.log(torch.expm1(dt))           # softplus^-1
        if gating == "ab-sglang":
            c["dt_bias"] = c["dt_bias"].to(io)
    return c


def make_pool(S, Hv, dtype, gen, pad=512, dev="cuda"):
    """Pool [S, Hv, 128, 128] with stride(0) = Hv*128*128 + pad (vLLM-like pages), random states."""
    slot = Hv * HD * HD + pad
    base = torch.randn(S * slot, generator=gen, device=dev).mul_(0.3).to(dtype)
    return base.as_strided((S, Hv, HD, HD), (slot, HD * HD, HD, 1)), base


def ref_decode(c, pool, slots, l2norm, scale=None):
    """float64 reference: returns (out [B,Hv,128] f64, new pool states f64 copy)."""
    d = {k: (x.double() if torch.is_tensor(x) and k not in ("a", "b", "A_log", "dt_bias") else x)
         for k, x in c.items()}
    pool64 = pool.double()
    out = torch.empty(c["v"].shape, dtype=torch.float64, device=pool.device)
    reference.decode(d["q"], d["k"], d["v"], pool64, slots, g=d["g"], beta=d["beta"], a=c["a"],
                     b=c["b"], A_log=c["A_log"], dt_bias=c["dt_bias"], use_qk_l2norm=l2norm,
                     scale=scale, out=out)
    return out, pool64


def run_decode(c, pool, slots, l2norm, scale=None, out=None):
    if out is None:
        out = torch.full(c["v"].shape, float("nan"), dtype=c["q"].dtype, device=pool.device)
    _mod().decode(c["q"], c["k"], c["v"], pool, slots, g=c["g"], beta=c["beta"], a=c["a"],
                  b=c["b"], A_log=c["A_log"], dt_bias=c["dt_bias"], use_qk_l2norm=l2norm,
                  scale=scale, out=out)
    return out


def live_slots(B, S, gen, n_pad=0):
    """B distinct random slots of S (int32, cuda); n_pad of them replaced by -1."""
    slots = torch.randperm(S, generator=gen, device="cuda")[:B].to(torch.int32)
    if n_pad:
        slots[torch.randperm(B, generator=gen, device="cuda")[:n_pad]] = -1
    return slots


CASES = [
    # Hk, Hv, B, pool dtype, io dtype, gating, l2norm
    (2, 8, 1, torch.float32, torch.bfloat16, "gb", False),
    (2, 8, 37, torch.float32, torch.bfloat16, "ab", True),
    (2, 8, 64, torch.bfloat16, torch.bfloat16, "ab", True),
    (2, 8, 19, torch.float32, torch.bfloat16, "ab-sglang", True),
    (4, 16, 33, torch.float32, torch.float16, "gb", True),
    (16, 32, 20, torch.bfloat16, torch.bfloat16, "gb", False),
    (16, 64, 9, torch.float32, torch.bfloat16, "ab", False),
    (1, 1, 300, torch.float32, torch.bfloat16, "gb", False),
    # bf16 states, <= 128 rows: the small-batch entry of decode.DECODE_TILES (decode_tile)
    (2, 8, 5, torch.bfloat16, torch.bfloat16, "ab", True),
    (16, 32, 3, torch.bfloat16, torch.float16, "ab-sglang", True),
    # the pipelined entries of decode.DECODE_TILES: fp32 above 2048 rows, bf16 above 8192 (an
    # H100 takes CARD_DECODE_TILES["H100"]: bv8l32-p2-e-o, and the gathering bv16l16-cs-p8s4-o)
    (2, 8, 300, torch.float32, torch.bfloat16, "ab", True),
    (16, 32, 260, torch.bfloat16, torch.bfloat16, "ab-sglang", True),
]


@pytest.mark.parametrize("Hk,Hv,B,pdt,io,gating,l2", CASES)
def test_decode_matches_reference_and_leaves_other_slots(Hk, Hv, B, pdt, io, gating, l2):
    _check_decode(Hk, Hv, B, pdt, io, gating, l2)


def _check_decode(Hk, Hv, B, pdt, io, gating, l2):
    gen = torch.Generator(device="cuda").manual_seed(1000 + B * Hv)
    S = B + 13
    pool, base = make_pool(S, Hv, pdt, gen)
    slots = live_slots(B, S, gen, n_pad=min(3, B // 4))
    c = make_case(B, Hk, Hv, io=io, gating=gating, l2norm=l2, gen=gen)
    scale = None if Hv != 16 else 0.07
    ref_o, ref_pool = ref_decode(c, pool, slots, l2, scale)
    before = base.clone()
    out = run_decode(c, pool, slots, l2, scale)
    torch.cuda.synchronize()
    live = slots.long() >= 0
    assert not torch.isnan(out).any(), "NaN in the output"
    assert (out[~live] == 0).all(), "padding rows must be zero"
    assert rel(out[live], ref_o[live]) <= TOL
    ids = slots.long()[live]
    tol_s = TOL if pdt == torch.float32 else TOL_BF16_STATE
    assert rel(pool[ids], ref_pool[ids]) <= tol_s
    # Bit-identical everywhere except the live slots' [Hv,128,128] blocks (page padding included).
    touched = torch.zeros_like(base, dtype=torch.bool)
    view = touched.as_strided(pool.shape, pool.stride())
    view[ids] = True
    assert torch.equal(base[~touched].view(torch.uint8), before[~touched].view(torch.uint8))


@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16])
def test_many_decode_steps_follow_the_recurrence(pdt):
    """40 decode steps equal reference.recurrent_gdn over the 40-token sequences (float64)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    Hk, Hv, B, steps = 2, 8, 6, 40
    pool, _ = make_pool(B + 2, Hv, pdt, gen)
    slots = torch.tensor([3, 0, 7, 5, 1, 2], dtype=torch.int32, device="cuda")
    init = pool[slots.long()].double().clone()
    toks = [make_case(B, Hk, Hv, gating="ab", l2norm=True, gen=gen) for _ in range(steps)]
    for c in toks[1:]:           # the layer's A_log / dt_bias are fixed across steps
        c["A_log"], c["dt_bias"] = toks[0]["A_log"], toks[0]["dt_bias"]
    outs = [run_decode(c, pool, slots, True).clone() for c in toks]
    # Sequence-major packed tensors for the reference: token t of sequence i at i*steps + t.
    def pack(name):
        return torch.stack([c[name] for c in toks], 1).flatten(0, 1)
    q = reference.l2norm(pack("q").double())
    k = reference.l2norm(pack("k").double())
    g, beta = reference.fused_gating(pack("a"), pack("b"), toks[0]["A_log"], toks[0]["dt_bias"])
    cu = [i * steps for i in range(B + 1)]
    ref_o, ref_s = reference.recurrent_gdn(q, k, pack("v").double(), g.double(), beta.double(), cu, init)
    o = torch.stack(outs, 1).flatten(0, 1)
    assert not torch.isnan(o).any()
    # A bf16 pool rounds the state at every step (the float64 reference does not): 40 roundings
    # accumulate into the outputs and states (the reference itself, run with a bf16 pool, is
    # 4e-3 off in o).
    assert rel(o, ref_o) <= (TOL if pdt == torch.float32 else 1e-2)
    tol_s = TOL if pdt == torch.float32 else 2e-2
    assert rel(pool[slots.long()], ref_s) <= tol_s


def _verify_case(seq_lens, Hk, Hv, pdt, gating, l2, gen, D=None):
    N = len(seq_lens)
    D = D or max(max(seq_lens), 1)
    T = sum(seq_lens)
    cu = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    S = N + 5
    pool, base = make_pool(S, Hv, pdt, gen)
    slots = live_slots(N, S, gen)
    # [S', D, Hv, 128, 128] with a gap between intermediate slots (stride(0) > D*Hv*128*128).
    inter_full = torch.randn((N + 3) * (D * Hv * HD * HD + 256), generator=gen, device="cuda").to(pdt)
    inter = inter_full.as_strided((N + 3, D, Hv, HD, HD), (D * Hv * HD * HD + 256, Hv * HD * HD, HD * HD, HD, 1))
    iids = torch.randperm(N + 3, generator=gen, device="cuda")[:N].to(torch.int32)
    c = make_case(T, Hk, Hv, gating=gating, l2norm=l2, gen=gen)
    return N, D, cu, pool, base, slots, inter, inter_full, iids, c


@pytest.mark.parametrize("pdt,gating,l2", [(torch.float32, "ab", True), (torch.bfloat16, "gb", False),
                                            (torch.bfloat16, "ab-sglang", True)])
def test_verify_intermediates_equal_sequential_decode(pdt, gating, l2):
    _check_verify(pdt, gating, l2)


@pytest.mark.parametrize("tile", ["bv32", "bv64", "bv16", "bv32s-mb8", "bv16w2", "bv8w1s-mb32",
                                  "bv16l32", "bv16l32-mb12", "bv8l32-mb16", "bv32l16s", "bv32l32-mb8",
                                  "bv32l16", "bv32l16-cg", "bv16l32-cs", "bv16l16-cs", "bv8w1l16-cs",
                                  "bv4w1l32-cs", "bv4w1-cs"])
def test_every_tile_shape_is_correct(tile, monkeypatch):
    """The kernel's tile (state rows per block, q/k in registers or shared memory) is a
    per-dtype tuning choice: every tile must give the same, correct results."""
    monkeypatch.setattr(_mod(), "TILE_OVERRIDE", tile)
    _check_decode(2, 8, 37, torch.float32, torch.bfloat16, "ab", True)
    _check_decode(2, 8, 19, torch.bfloat16, torch.bfloat16, "gb", False)
    _check_verify(torch.float32, "ab", True)
    _check_verify(torch.bfloat16, "gb", False)


@pytest.mark.parametrize("tile", ["bv16l16-cs-p2", "bv16l16-cs-p8s4", "bv32l16-cs-p4", "bv16l16s-p4s4",
                                  "bv8w1l16-cs-p4", "bv8l32-cs-p8s3"])
def test_pipelined_decode_tiles_are_correct(tile, monkeypatch):
    """Decode tiles whose blocks walk several row tiles through a cp.async ring (-p<T>[s<S>]): the
    same checks as the plain tiles (padding rows, slots outside the batch bit-identical) on the
    head pairs whose k-heads serve 1, 2 and 4 v-heads, both pool dtypes."""
    monkeypatch.setattr(_mod(), "TILE_OVERRIDE", tile)
    _check_decode(2, 8, 37, torch.float32, torch.bfloat16, "ab", True)
    _check_decode(2, 8, 19, torch.bfloat16, torch.bfloat16, "gb", False)
    _check_decode(16, 32, 20, torch.float32, torch.float16, "ab-sglang", True)
    _check_decode(1, 1, 300, torch.bfloat16, torch.bfloat16, "ab", True)


@pytest.mark.parametrize("tile", ["bv16l16-cs-e", "bv32-e", "bv8l32-cs-p8s3-e", "bv16l16-cs-p8s4-e",
                                  "bv16l16-cs-o", "bv16l16-cs-e-o", "bv8l32-cs-p8s3-o", "bv4w1l32-cs-o",
                                  "bv16l16-cs-p8s4-o", "bv8l32-p2-e-o", "bv8l32-p4-e-o"])
def test_early_and_gathering_decode_tiles_are_correct(tile, monkeypatch):
    """Decode tiles that compute the gates before the slot id and hold v in registers (-e), or
    gather the block's outputs in shared memory for one contiguous store (-o): the pipelined
    tiles' checks (padding rows, slots outside the batch bit-identical, the float64 reference),
    plain and pipelined forms."""
    monkeypatch.setattr(_mod(), "TILE_OVERRIDE", tile)
    _check_decode(2, 8, 37, torch.float32, torch.bfloat16, "ab", True)
    _check_decode(2, 8, 19, torch.bfloat16, torch.bfloat16, "gb", False)
    _check_decode(16, 32, 20, torch.float32, torch.float16, "ab-sglang", True)
    _check_decode(1, 1, 300, torch.bfloat16, torch.bfloat16, "ab", True)


def _check_verify(pdt, gating, l2):
    gen = torch.Generator(device="cuda").manual_seed(11)
    Hk, Hv = 2, 8
    seq_lens = [4, 0, 1, 4, 3, 4, 2]
    N, D, cu, pool, base, slots, inter, inter_full, iids, c = _verify_case(seq_lens, Hk, Hv, pdt, gating, l2, gen)
    slots[5] = -1                 # a padding sequence (tokens still present in the batch)
    iids[6] = -1                  # padding by intermediate id too
    pool_before = base.clone()
    inter_before = inter_full.clone()
    out = torch.full(c["v"].shape, float("nan"), dtype=c["q"].dtype, device="cuda")
    _mod().verify(c["q"], c["k"], c["v"], pool, slots, cu, inter, iids, g=c["g"], beta=c["beta"],
                  a=c["a"], b=c["b"], A_log=c["A_log"], dt_bias=c["dt_bias"], use_qk_l2norm=l2,
                  scale=None, out=out)
    torch.cuda.synchronize()
    assert torch.equal(base.view(torch.uint8), pool_before.view(torch.uint8)), "verify must not write the pool"
    assert not torch.isnan(out).any()
    # Reference in float64 (intermediate in float64, same ids).
    d = {k: (x.double() if torch.is_tensor(x) and k in ("q", "k", "v", "g", "beta") else x) for k, x in c.items()}
    inter64 = torch.zeros((inter.shape[0],) + inter.shape[1:], dtype=torch.float64, device="cuda")
    out64 = torch.empty(c["v"].shape, dtype=torch.float64, device="cuda")
    reference.verify(d["q"], d["k"], d["v"], pool.double(), slots, cu, inter64, iids, g=d["g"],
                     beta=d["beta"], a=c["a"], b=c["b"], A_log=c["A_log"], dt_bias=c["dt_bias"],
                     use_qk_l2norm=l2, scale=None, out=out64)
    tol_s = TOL if pdt == torch.float32 else TOL_BF16_STATE
    assert rel(out, out64) <= TOL
    written = torch.zeros(inter.shape[:2], dtype=torch.bool, device="cuda")
    for i, n in enumerate(seq_lens):
        live = int(slots[i]) >= 0 and int(iids[i]) >= 0
        lo, hi = int(cu[i]), int(cu[i + 1])
        if not live:
            assert (out[lo:hi] == 0).all()
            continue
        written[int(iids[i]), :n] = True
        assert rel(inter[int(iids[i]), :n], inter64[int(iids[i]), :n]) <= tol_s
        # Sequential decode from a copy of the slot gives the same intermediate states.
        p2, _ = make_pool(1, Hv, pdt, gen)
        p2[0] = pool[int(slots[i])]
        s0 = torch.zeros(1, dtype=torch.int32, device="cuda")
        for j in range(n):
            t = lo + j
            cj = {k: (x[t:t + 1] if torch.is_tensor(x) and k not in ("A_log", "dt_bias") else x) for k, x in c.items()}
            oj = run_decode(cj, p2, s0, l2)
            # fp32: the same arithmetic in the same order. bf16: decode rounds the state to
            # bf16 between tokens, verify keeps it in fp32 registers, so they differ by roundings.
            tol_seq = 1e-6 if pdt == torch.float32 else TOL_BF16_STATE
            assert rel(p2[0], inter[int(iids[i]), j]) <= tol_seq
            assert rel(oj[0], out[t]) <= (1e-6 if pdt == torch.float32 else TOL_BF16_STATE)
    # Untouched intermediate entries (not written, or padding) are bit-identical.
    mask = torch.zeros_like(inter_full, dtype=torch.bool)
    mview = mask.as_strided(inter.shape, inter.stride())
    mview[written] = True
    assert torch.equal(inter_full[~mask].view(torch.uint8), inter_before[~mask].view(torch.uint8))


def test_decode_cuda_graph_replay_with_new_slots_and_values():
    """Capture one decode call, then refill the static inputs (new slot ids, q/k/v/a/b) and replay:
    each replay must give fresh results equal to the reference."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    Hk, Hv, B, S = 2, 8, 16, 40
    pool, base = make_pool(S, Hv, torch.float32, gen)
    static = make_case(B, Hk, Hv, gating="ab", l2norm=True, gen=gen)
    slots = live_slots(B, S, gen)
    out = torch.empty(B, Hv, HD, dtype=torch.bfloat16, device="cuda")
    run_decode(static, pool, slots, True, out=out)  # warm-up (compiles / loads the kernel)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            run_decode(static, pool, slots, True, out=out)
    torch.cuda.current_stream().wait_stream(s)
    for rep in range(3):
        fresh = make_case(B, Hk, Hv, gating="ab", l2norm=True, gen=gen)
        for name in ("q", "k", "v", "a", "b", "A_log", "dt_bias"):
            static[name].copy_(fresh[name])
        slots.copy_(live_slots(B, S, gen, n_pad=2 if rep == 1 else 0))
        out.fill_(float("nan"))
        ref_o, ref_pool = ref_decode(static, pool, slots, True)
        before = base.clone()
        graph.replay()
        torch.cuda.synchronize()
        live = slots.long() >= 0
        assert not torch.isnan(out).any()
        assert (out[~live] == 0).all()
        assert rel(out[live], ref_o[live]) <= TOL
        ids = slots.long()[live]
        assert rel(pool[ids], ref_pool[ids]) <= TOL
        touched = torch.zeros_like(base, dtype=torch.bool)
        touched.as_strided(pool.shape, pool.stride())[ids] = True
        assert torch.equal(base[~touched].view(torch.uint8), before[~touched].view(torch.uint8))


def test_decode_rejects_misaligned_pool_stride():
    gen = torch.Generator(device="cuda").manual_seed(5)
    Hv = 8
    slot = Hv * HD * HD + 2           # not a multiple of 4 fp32 elements
    base = torch.zeros(3 * slot, device="cuda")
    pool = base.as_strided((3, Hv, HD, HD), (slot, HD * HD, HD, 1))
    c = make_case(2, 2, Hv, gen=gen)
    with pytest.raises(ValueError, match="pool"):
        run_decode(c, pool, torch.tensor([0, 1], dtype=torch.int32, device="cuda"), False)


@pytest.mark.parametrize("pdt,acc_dtype", [(torch.float32, torch.int32), (torch.bfloat16, torch.int64)])
def test_commit_copies_the_accepted_state_and_nothing_else(pdt, acc_dtype):
    """commit_verified: pool[slot_i] = intermediate[iid_i, acc_i - 1] (bit-exact copy) for live
    sequences with acc_i > 0; padding slots / ids and acc = 0 leave everything untouched."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    Hv, N, D = 8, 6, 4
    pool, base = make_pool(N + 4, Hv, pdt, gen)
    slots = live_slots(N, N + 4, gen)
    slot_gap = D * Hv * HD * HD + 256
    inter_full = torch.randn((N + 2) * slot_gap, generator=gen, device="cuda").to(pdt)
    inter = inter_full.as_strided((N + 2, D, Hv, HD, HD), (slot_gap, Hv * HD * HD, HD * HD, HD, 1))
    iids = torch.randperm(N + 2, generator=gen, device="cuda")[:N].to(torch.int32)
    acc = torch.tensor([1, 4, 0, 2, 3, 1], dtype=acc_dtype, device="cuda")
    slots[5] = -1                              # padding slot
    iids[4] = -1                               # padding intermediate id
    before = base.clone()
    expect = pool.clone()
    for i in range(N):
        if int(slots[i]) >= 0 and int(iids[i]) >= 0 and int(acc[i]) > 0:
            expect[int(slots[i])] = inter[int(iids[i]), int(acc[i]) - 1]
    _mod().commit_verified(pool, slots, inter, iids, acc)
    torch.cuda.synchronize()
    assert torch.equal(pool, expect)
    touched = torch.zeros_like(base, dtype=torch.bool)
    touched.as_strided(pool.shape, pool.stride())[:] = True
    assert torch.equal(base[~touched].view(torch.uint8), before[~touched].view(torch.uint8))
