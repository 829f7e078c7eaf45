"""Compile-only tests of the layer's conv kernels (kernels/hopper/conv.py) and verify_slots
(decode.py), plus their variant bookkeeping (plain CPU). CI compiles the variants
kernel_variants() lists for 2/8 heads in bf16, for sm_90a and sm_100a."""

import importlib

import pytest

C = importlib.import_module("qla_serve.kernels.hopper.conv")
D = importlib.import_module("qla_serve.kernels.hopper.decode")

HV, HK = 8, 2
BF16 = [v for v in C.kernel_variants(HV, HK) if v["io_dtype"] == "bfloat16" and v["bias"]]


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("variant", BF16, ids=lambda v: v["name"])
def test_conv_variant_compiles(variant, target):
    src = C.build(variant, target).get_kernel_source()
    # SiLU where it convolves: tanh.approx in the prefill (conv.SILU_FORM), __expf in decode and spec
    # (and in the prefill conv's decode CTAs: conv_decode's arithmetic, bit for bit)
    assert (src.count("qla_tanh_approx(") > 1) == (variant["op"] == "conv_prefill")
    assert ("__expf(" in src) == (variant["op"] in ("conv_decode", "conv_spec", "conv_verify")
                                  or variant.get("decodes", False))
    assert "int sc0, int sc1, int sc2" in src        # any conv-state strides: either layout
    if variant["op"] == "conv_prefill":
        assert "__shfl_xor_sync" in src and "half_t* __restrict__ Qo" in src   # q/k L2 norm, fp16 out
        assert "Cu[((int64_t)mid)]" in src            # sequences found from cu_seqlens, no index tensors
        assert "int ntok" in src and "int walk" in src    # a half-warp walks several token groups
        # rows through a per-thread cp.async ring, waited for STAGES - 1 steps later: no barrier;
        # pieces of 2 x lane_channels bytes, addressed from one row offset (conv.PREFILL_ROW_OFFSETS)
        # (under an L2::evict_first policy where conv.PREFILL_LOAD_HINT says so)
        piece = 2 * variant.get("lane_channels", 8)
        rows = "qla_cp_async_rows_ef" if variant.get("load_hint") else "qla_cp_async_rows"
        copy = f"{rows}<{piece}, " if variant.get("row_offsets") else f"cp_async_gs_conditional<{piece}>"
        assert copy in src and f"cp_async_wait<{C.STAGES - 1}>" in src
        assert "__syncthreads" not in src
    if variant["op"] in ("conv_spec", "conv_verify"):
        assert f"float win[{3 + variant['draft']}];" in src   # history + D draft inputs in registers
    if variant["op"] == "conv_verify":   # SGLang's per-draft window scratch, any strides
        assert "int si0, int si1, int si2, int si3" in src
    # conv_decode, conv_spec, conv_verify and conv_prefill without window CTAs let the kernel
    # launched as their programmatic dependent (decode; verify_slots; verify; the conv-state
    # write-back's after_conv form) start early; that one waits before it reads (decode,
    # verify_slots, verify) or writes (the write-back) what the conv touches. With window CTAs
    # conv_prefill writes the windows itself: nothing follows it as a dependent.
    triggers = variant["op"] in ("conv_decode", "conv_spec", "conv_verify") or \
        (variant["op"] == "conv_prefill" and not variant.get("window_ctas"))
    assert ("cudaTriggerProgrammaticLaunchCompletion();" in src) == triggers
    assert ("cudaGridDependencySynchronize();" in src) == bool(variant.get("after_conv"))


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
def test_verify_slots_compiles(target):
    v = next(v for v in D.kernel_variants(HV, HK) if v["op"] == "verify_slots")
    src = D.build(v, target).get_kernel_source()
    assert "Slots" in src and "Acc" in src and "Inter" not in src   # no intermediate buffer


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("silu_form", ["tanh", "ex2"])
def test_conv_prefill_compiles(target, silu_form):
    """conv_prefill's default form (run on the H200 by test_layer_ops_gpu.py): the gates in the
    grid's first column of CTAs (one gate expression, there only), the walkers' warp vote that
    picks the straight-line steps (conv.FAST_STEPS), 4 CTAs per SM kept by a launch bound, no
    block barrier; its SiLU by tanh.approx on halved weights (conv.SILU_FORM), or by ex2.approx
    and rcp.approx (the form before it, kept for A/B runs; its variant name unchanged)."""
    v = C.variant("conv_prefill", HV, HK, 4, "bfloat16", "bfloat16", qk_out="float16", ab="bfloat16",
                  param="float32", gbias="bfloat16", fast_steps=True, silu_form=silu_form)
    assert v["name"].endswith(("_fs_tanh" if silu_form == "tanh" else "_fs") + ("_wc" if C.WINDOW_CTAS else ""))
    src = C.build(v, target).get_kernel_source()
    assert "__all_sync" in src and "__launch_bounds__(128, 4)" in src and "__syncthreads" not in src
    assert src.count("log1pf(") == 1 and "blockIdx.y) == 0" in src
    # the helpers' definitions once each; the walkers call one of them
    tanh_calls, ex2_calls = src.count("qla_tanh_approx(") - 1, src.count("qla_ex2_ftz(") - 1
    assert (tanh_calls > 0, ex2_calls > 0) == (silu_form == "tanh", silu_form == "ex2")
    assert ("* 0x1p-1f" in src) == (silu_form == "tanh")   # the halved weights and bias


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("lanes,offsets", [(4, False), (8, True), (4, True)])
def test_conv_prefill_fixed_forms_compile(target, lanes, offsets):
    """conv_prefill's forms besides the plain one (conv.PREFILL_LANE_CHANNELS 4 or "auto",
    conv.PREFILL_ROW_OFFSETS: the defaults since session 51; run on the H200 by
    test_layer_ops_gpu.py): with 4 channels per lane 8-byte cp.async pieces, a warp per row (the
    L2 norm over 32 lanes: 5 xor-shuffles) and 8 CTAs per SM kept by the launch bound (64
    registers); with row offsets the rows' cp.async from one offset (the helper imported only
    then: the plain form's source is the one that ran before them)."""
    v = C.variant("conv_prefill", HV, HK, 4, "bfloat16", "bfloat16", qk_out="float16", ab="bfloat16",
                  param="float32", gbias="float32", lane_channels=lanes, row_offsets=offsets)
    assert v["name"].endswith(("_lc4" if lanes == 4 else "_wc") + ("_ro" if offsets else ""))
    src = C.build(v, target).get_kernel_source()
    piece = 2 * lanes
    assert (f"qla_cp_async_rows<{piece}, 4, 256>(" in src) == offsets
    assert (f"cp_async_gs_conditional<{piece}>" in src) == (not offsets)
    assert f"__launch_bounds__(128, {4 if lanes == 8 else 8})" in src and "__syncthreads" not in src
    assert f"for (int m = 0; m < {4 if lanes == 8 else 5}; ++m)" in src   # the L2 norm's xor-shuffles
    default = C.variant("conv_prefill", HV, HK, 4, "bfloat16", "bfloat16", qk_out="float16", ab="bfloat16",
                        param="float32", gbias="float32")
    assert "qla_cp_async_rows" not in C.build(default, target).get_kernel_source()
    with pytest.raises(ValueError, match="lane_channels"):
        C.variant("conv_prefill", HV, HK, 4, "bfloat16", "bfloat16", ab="bfloat16", param="float32",
                  gbias="float32", lane_channels=2)


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("lanes", [4, 8])
def test_conv_prefill_load_hint_compiles(target, lanes):
    """conv_prefill's row copies under an L2::evict_first cache policy (conv.PREFILL_LOAD_HINT,
    the default since session 53; its outputs bit-identical to the form without, on an H100:
    benchmarks/data/conv_load_hint_h100.txt): one createpolicy and cp.async with .L2::cache_hint
    (16-byte cg pieces at 8 channels a lane, 8-byte ca pieces at 4), the helper imported only in
    that form."""
    def form(hint):
        return C.variant("conv_prefill", HV, HK, 4, "bfloat16", "bfloat16", qk_out="float16", ab="bfloat16",
                         param="float32", gbias="float32", lane_channels=lanes, row_offsets=True, load_hint=hint)
    v = form("evict_first")
    assert v["name"].endswith("_ro_ef") and v["load_hint"] == "evict_first"
    src = C.build(v, target).get_kernel_source()
    piece = 2 * lanes
    assert f"qla_cp_async_rows_ef<{piece}, 4, 256>(" in src
    assert "createpolicy.fractional.L2::evict_first.b64" in src
    assert f"cp.async.{'cg' if lanes == 8 else 'ca'}.shared.global.L2::cache_hint" in src
    plain = C.build(form(None), target).get_kernel_source()
    assert "qla_cp_async_rows_ef" not in plain and "createpolicy" not in plain


def test_prefill_load_hint_follows_the_row_offsets_form(monkeypatch):
    """The load hint rides on the row-offsets form's copy helper: the launch and kernel_variants take
    conv.PREFILL_LOAD_HINT there and none without row offsets (so turning PREFILL_ROW_OFFSETS off
    alone is a valid form); variant() refuses a hint without row offsets, or one it does not know."""
    monkeypatch.setattr(C, "PREFILL_LOAD_HINT", "evict_first")
    assert C.prefill_load_hint(True) == "evict_first" and C.prefill_load_hint(False) is None
    monkeypatch.setattr(C, "PREFILL_ROW_OFFSETS", False)
    assert all("load_hint" not in v for v in C.kernel_variants(HV, HK))
    monkeypatch.setattr(C, "PREFILL_ROW_OFFSETS", True)
    prefill = [v for v in C.kernel_variants(HV, HK) if v["op"] == "conv_prefill"]
    assert prefill and all(v["load_hint"] == "evict_first" and v["name"].endswith(("_ef", "_ef_dec")) for v in prefill)
    monkeypatch.setattr(C, "PREFILL_LOAD_HINT", None)
    assert all("load_hint" not in v for v in C.kernel_variants(HV, HK))
    common = dict(qk_out="float16", ab="bfloat16", param="float32", gbias="float32")
    with pytest.raises(ValueError, match="load_hint"):
        C.variant("conv_prefill", HV, HK, 4, "bfloat16", "bfloat16", load_hint="evict_first", **common)
    with pytest.raises(ValueError, match="load_hint"):
        C.variant("conv_prefill", HV, HK, 4, "bfloat16", "bfloat16", row_offsets=True, load_hint="evict_last",
                  **common)


def test_steps_per_walk():
    """Walks of up to SHORT_WALK_STEPS that leave ~CTAS_PER_SM CTAs per SM while the batch is
    small; QUICK_WALK_STEPS once it gives MANY_CTAS_PER_SM CTAs per SM of them (steps of GROUP
    tokens per walker, walkers_per_cta walkers per CTA); powers of two."""
    per_step = C.GROUP * C.walkers_per_cta(8)
    # 4 channels per lane: 4 walkers per CTA, so the same batch gives twice the CTA steps
    assert C.steps_per_walk(4096, 12, 132, 4) == C.steps_per_walk(8192, 12, 132)
    assert C.steps_per_walk(1, 12, 132) == 1
    assert C.steps_per_walk(4 * 512, 12, 132) == 4 * 512 // per_step * 12 // (132 * C.CTAS_PER_SM)
    assert C.steps_per_walk(32768, 12, 132) == C.SHORT_WALK_STEPS     # 2/8 heads: short walks
    assert C.steps_per_walk(32768, 96, 132) == C.QUICK_WALK_STEPS       # 16/64 heads: 186 CTAs per SM
    assert C.steps_per_walk(32768, 24, 132) == C.SHORT_WALK_STEPS       # 4/16 heads: 46
    assert C.steps_per_walk(16 * 512, 96, 132) == C.SHORT_WALK_STEPS
    assert C.steps_per_walk(16 * 512, 12, 132) == C.SHORT_WALK_STEPS    # 2/8 heads, 8192 tokens
    assert C.steps_per_walk(1024, 12, 132) == 1                         # 384 steps: 1.45 -> 1
    assert C.steps_per_walk(2048, 12, 132) == 2                         # a power of two (2.9 -> 2)
    assert C.steps_per_walk(4096, 12, 132) == 4                         # 5.8 -> 4


def test_prefill_launch_form(monkeypatch):
    """PREFILL_LANE_CHANNELS "auto": 4 channels a lane where the 8-channel form's walker CTAs fill
    fewer than NARROW_LANE_WAVES waves (4 CTAs per SM), else 8; a fixed 8 or 4 as it is; the walk
    is steps_per_walk's for the lanes taken (at 4 lanes halved_walk's of it), or WALK_STEPS as it
    is; kernel_variants lists every form a call can take."""
    for fixed in (8, 4):
        monkeypatch.setattr(C, "PREFILL_LANE_CHANNELS", fixed)
        assert C.prefill_launch_form(8192, 12, 132)[0] == fixed
        assert {v.get("lane_channels", 8) for v in C.kernel_variants(8, 2) if v["op"] == "conv_prefill"} == {fixed}
    monkeypatch.setattr(C, "PREFILL_LANE_CHANNELS", "auto")
    # against NARROW_LANE_WAVES x 132 SMs x 4 CTAs = 1056 slots; 2/8 heads x 8192 tokens: 8-step
    # walks of 8 walkers x 4 tokens, 32 x 12 = 384 CTAs
    assert C.NARROW_LANE_WAVES == 2
    assert C.walker_ctas(8192, 12, C.steps_per_walk(8192, 12, 132, 8), 8) == 384
    assert C.prefill_launch_form(8192, 12, 132) == (4, C.steps_per_walk(8192, 12, 132, 4))
    assert C.prefill_launch_form(32768, 12, 132) == (8, C.steps_per_walk(32768, 12, 132, 8))
    # the 4-lane walk halved where the grid stays within one wave (halved_walk): 2/8 x 4096 at 8
    # steps is 384 CTAs, at 4 768 (of 1056 slots); 4/16 x 8192 at 8 steps is 1536: kept
    assert C.prefill_launch_form(4096, 12, 132) == (4, 4)
    assert C.prefill_launch_form(8192, 24, 132) == (4, 8)    # 4/16: 768 CTAs in the 8-channel form
    assert C.prefill_launch_form(8192, 96, 132)[0] == 8      # 16/64: 3072
    assert C.prefill_launch_form(512, 12, 132)[0] == 4
    assert C.prefill_launch_form(8192, 12, 32)[0] == 8       # 384 CTAs against 256 slots
    lanes = {v.get("lane_channels", 8) for v in C.kernel_variants(8, 2) if v["op"] == "conv_prefill"}
    assert lanes == {4, 8}
    monkeypatch.setattr(C, "HALVE_WALKS", False)
    assert C.prefill_launch_form(4096, 12, 132) == (4, 8)
    monkeypatch.setattr(C, "HALVE_WALKS", True)
    monkeypatch.setattr(C, "WALK_STEPS", 8)      # a set walk as it is
    assert C.prefill_launch_form(4096, 12, 132) == (4, 8)
    monkeypatch.setattr(C, "PREFILL_LANE_CHANNELS", 2)
    with pytest.raises(ValueError, match="PREFILL_LANE_CHANNELS"):
        C.prefill_launch_form(8192, 12, 132)


def test_halved_walk():
    """At 4 channels a lane, a walk of 2 x HALVED_WALK_MIN_STEPS steps or more is halved where
    the halved grid fits one wave of CTA slots (8 per SM), else kept."""
    assert C.HALVED_WALK_MIN_STEPS == 4 and C.min_blocks_per_sm(4) == 8
    assert C.walker_ctas(4096, 12, 4, 4) == 768 <= 132 * 8
    assert C.halved_walk(4096, 12, 132, 8) == 4         # 2/8 x 4096: 384 -> 768 CTAs
    assert C.halved_walk(2048, 24, 132, 8) == 4         # 4/16 x 2048: the same grid
    assert C.halved_walk(8192, 12, 132, 8) == 8         # 2/8 x 8192: 1536 at 4 steps, a second wave
    assert C.halved_walk(2048, 12, 132, 4) == 4         # 2 steps: shorter than the least halved walk
    assert C.halved_walk(4096, 12, 32, 8) == 8          # 32 SMs: 768 CTAs against 256 slots
    for tokens in (1, 64, 1000, 4096, 50000):
        for walk in (1, 2, 4, 8):
            assert C.halved_walk(tokens, 12, 132, walk) in (walk, walk // 2)


def test_conv_variants_are_unique_and_checked():
    vs = C.kernel_variants(32, 16)
    names = [v["name"] for v in vs]
    # io x bias x (3 prefill (gate params), 2 state (plain; after_conv without the prefill's window
    # CTAs), 2 decode (1 and
    # DECODE_SEQS sequences per thread), 3 spec, 3 SGLang verify)
    # with the window CTAs: no after_conv state, and each prefill conv with decode CTAs too
    # (each prefill conv in every lane form a call can take: conv.PREFILL_LANE_CHANNELS)
    lanes = len(C._lane_forms())
    assert len(names) == len(set(names)) == 2 * 2 * (3 * lanes * (1 + C.WINDOW_CTAS) + 9 + (not C.WINDOW_CTAS))
    assert sum(v.get("decodes", False) for v in vs) == 2 * 2 * 3 * lanes * C.WINDOW_CTAS
    assert all(v.get("window_ctas", False) == C.WINDOW_CTAS for v in vs if v["op"] == "conv_prefill")
    assert {v.get("seqs", 1) for v in vs if v["op"] == "conv_decode"} == {1, C.DECODE_SEQS}
    assert sum(v["op"] == "conv_verify" for v in vs) == 2 * 2 * 3
    from qla_serve.kernels import hopper
    listed = hopper.kernel_variants(32, 16)
    assert all(v in listed for v in vs)
    assert sum(v["op"] == "verify_slots" for v in listed) == 12 * 2 + 12   # plain: both tiles; after_conv: one
    with pytest.raises(ValueError, match="conv width"):
        C.variant("conv_decode", HV, HK, 9, "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="conv_state dtype"):
        C.variant("conv_decode", HV, HK, 4, "bfloat16", "int8")
    with pytest.raises(ValueError, match="draft depth"):
        C.variant("conv_spec", HV, HK, 4, "bfloat16", "bfloat16", draft=0)
    with pytest.raises(ValueError, match="draft depth"):
        C.variant("conv_verify", HV, HK, 4, "bfloat16", "bfloat16", draft=17)
    with pytest.raises(ValueError, match="decodes: conv_prefill convolves decode rows only in its window-CTA"):
        C.variant("conv_prefill", HV, HK, 4, "bfloat16", "bfloat16", qk_out="float16", ab="bfloat16",
                  param="float32", gbias="float32", window_ctas=False, decodes=True)
    with pytest.raises(ValueError, match="after_conv: only conv_prefill_state"):
        C.variant("conv_decode", HV, HK, 4, "bfloat16", "bfloat16", after_conv=True)
    with pytest.raises(ValueError, match="activation"):
        C.variant("conv_decode", HV, HK, 4, "bfloat16", "bfloat16", activation="gelu")
    with pytest.raises(ValueError, match="seqs"):
        C.variant("conv_decode", HV, HK, 4, "bfloat16", "bfloat16", seqs=3)
    with pytest.raises(ValueError, match="seqs"):
        C.variant("conv_spec", HV, HK, 4, "bfloat16", "bfloat16", draft=2, seqs=4)
    assert C.variant("conv_decode", HV, HK, 4, "bfloat16", "bfloat16", seqs=4)["name"].endswith("_s4")
    assert "seqs" not in C.variant("conv_decode", HV, HK, 4, "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="silu_form"):
        C.variant("conv_prefill", HV, HK, 4, "bfloat16", "bfloat16", ab="bfloat16", param="float32",
                  gbias="float32", silu_form="erf")
    # no SiLU, no form: the name and the kernel are the same whatever SILU_FORM says
    plain = C.variant("conv_prefill", HV, HK, 4, "bfloat16", "bfloat16", activation="none", ab="bfloat16",
                      param="float32", gbias="float32", silu_form="tanh")
    assert "silu_form" not in plain and not plain["name"].endswith("_tanh")


@pytest.mark.compile
@pytest.mark.parametrize("windows", [True, False])
def test_conv_prefill_window_ctas_compile(windows):
    """conv.WINDOW_CTAS: the window CTAs (grid columns past the walkers' token ranges) convolve the
    sequences' first W - 1 tokens from the conv state and write the new windows into it; the
    walkers then read no conv state. Without them, the walkers read the history taps and a second
    launch (conv_prefill_state) writes the windows back."""
    v = C.variant("conv_prefill", HV, HK, 4, "bfloat16", "bfloat16", qk_out="float16", ab="bfloat16",
                  param="float32", gbias="bfloat16", window_ctas=windows)
    assert v["name"].endswith("_wc") == windows
    src = C.build(v, "sm_90a").get_kernel_source()
    # the new windows stored into the conv state (bf16 here) from the window CTAs' registers
    assert ("] = ((bfloat16_t)win[" in src) == windows
    # the walkers' binary search reads a sequence's slot and history flag only without them
    assert ("HasInit[lo]" in src) == (not windows)
