"""Compile-only tests of the decode / verify kernels (TileLang + nvcc, no GPU), plus the
host-side variant bookkeeping (plain CPU).

CI compiles every variant kernel_variants() lists for 2/8 heads (both ops, pool and io dtypes,
gating forms, l2norm on and off; ~3 minutes on 2 cores), plus the other tile family that
benchmarks can force, for sm_90a and sm_100a.
"""

import importlib
import json

import pytest
import torch

# The package exports a function named `decode`; the submodule comes from sys.modules.
dec = importlib.import_module("qla_serve.kernels.hopper.decode")

HV, HK = 8, 2


# Every listed variant, plus the other tile families that QLA_DECODE_TILE / TILE_OVERRIDE select
# for benchmarks: q/k staged in shared memory with an occupancy hint, and wider rows (16 or 32
# lanes per state row) for both pool dtypes.
VARIANTS = dec.kernel_variants(HV, HK) + [
    dec._variant("decode", HV, HK, "bfloat16", pool, "ab", "bfloat16", "float32", True, tile)
    for pool, tile in (("float32", "bv32s-mb8"), ("float32", "bv16l32-mb12"), ("bfloat16", "bv16l32"),
                       ("bfloat16", "bv32l16s"), ("float32", "bv32l16-cg"), ("bfloat16", "bv16l32-cs"),
                       ("float32", "bv32l16-lcs"), ("bfloat16", "bv32l16-lcg-scs"), ("bfloat16", "bv32-scs"))]
# Pipelined tiles (-p<T>[s<S>]): blocks walking several row tiles, state through a cp.async ring.
PIPELINED = [dec._variant("decode", HV, HK, "bfloat16", pool, "ab", "bfloat16", "float32", True, tile, after_conv=ac)
             for pool, tile, ac in (("float32", "bv16l16-cs-p2", False), ("bfloat16", "bv16l16-cs-p8s3", False),
                                    ("float32", "bv16l16-cs-p4", True), ("bfloat16", "bv32l16s-p4s4", False))]


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("variant", PIPELINED, ids=lambda v: v["name"])
def test_pipelined_tiles_compile_to_a_cp_async_ring(variant, target):
    """The state reaches the registers through cp.async copies into shared memory, each thread
    waiting on its own groups (no block barrier); the stores keep the tile's hint."""
    src = dec.build(variant, target).get_kernel_source()
    body = src.split('extern "C" __global__')[-1]
    tile = dec.parse_tile(variant["tile"])
    assert "tl::cp_async_gs<" in body and f"tl::cp_async_wait<{tile.pipe_stages - 1}>" in body
    assert "__syncthreads" not in body
    assert ("qla_st_state_cs" in body) == (tile.store_hint == "cs")
    assert ("cudaGridDependencySynchronize();" in src) == variant.get("after_conv", False)


# Early tiles (-e): the gates before the slot id, v in registers after the state loads.
EARLY = [dec._variant("decode", HV, HK, "bfloat16", "float32", "ab", "bfloat16", "float32", True, tile)
         for tile in ("bv16l16-cs-e", "bv8l32-cs-p8s3-e")]


@pytest.mark.compile
@pytest.mark.parametrize("variant", EARLY, ids=lambda v: v["name"])
def test_early_tiles_load_the_gates_before_the_slot_and_v_once(variant):
    """An early tile computes the gates from a, b, A_log, dt_bias before it reads the slot id (the
    plain tile: after the q/k norms, behind the slot id and the state loads), and reads each of
    its thread's v values once, before the first row's reductions (the plain tile: one read per
    row, between them). Decode only, and not in the conv's dependent form."""
    plain = dict(variant, tile=variant["tile"].removesuffix("-e"), name=variant["name"].removesuffix("-e"))
    for v, early in ((variant, True), (plain, False)):
        body = dec.build(v, "sm_90a").get_kernel_source().split('extern "C" __global__')[-1]
        assert (body.index("A_log[") < body.index("Slots[")) == early, v["name"]
        first_v, first_shuffle = body.index("Vt["), body.index("__shfl_xor_sync")
        assert (first_v < first_shuffle) == early, v["name"]
    for op, after_conv in (("verify", False), ("decode", True)):
        bad = dec._variant(op, HV, HK, "bfloat16", "float32", "ab", "bfloat16", "float32", True, "bv16l16-cs-e",
                           after_conv=after_conv)
        with pytest.raises(ValueError, match="early form"):
            dec.build(bad, "sm_90a")


# Output-gathering tiles (-o): the block's outputs through shared memory, one contiguous store.
GATHERING = [dec._variant("decode", HV, HK, "bfloat16", "float32", "ab", "bfloat16", "float32", True, tile)
             for tile in ("bv16l16-cs-o", "bv8l32-cs-p8s3-e-o")]


@pytest.mark.compile
@pytest.mark.parametrize("variant", GATHERING, ids=lambda v: v["name"])
def test_gathering_tiles_store_the_outputs_once_per_block(variant):
    """A gathering tile stores its block's outputs after one block barrier, each of the block's
    first PT * BV threads one row (the plain tile: a store per row from the row's first lane, no
    barrier); the rest of the program is the plain tile's. Decode only."""
    tile = dec.parse_tile(variant["tile"])
    plain = dict(variant, tile=variant["tile"].removesuffix("-o"), name=variant["name"].removesuffix("-o"))
    body = dec.build(variant, "sm_90a").get_kernel_source().split('extern "C" __global__')[-1]
    plain_body = dec.build(plain, "sm_90a").get_kernel_source().split('extern "C" __global__')[-1]
    assert body.count("__syncthreads();") == 1 and "__syncthreads" not in plain_body
    gathered = body[body.index("__syncthreads();"):]
    assert f"if (((int)threadIdx.x) < {tile.pipe_tiles * tile.rows})" in gathered.split("} else {")[0]
    assert "Out[" in gathered.split("} else {")[0]
    bad = dec._variant("verify", HV, HK, "bfloat16", "float32", "ab", "bfloat16", "float32", True, "bv16l16-cs-o")
    with pytest.raises(ValueError, match="output-gathering form"):
        dec.build(bad, "sm_90a")


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v["name"])
def test_variant_compiles(variant, target):
    kernel = dec.build(variant, target)
    src = kernel.get_kernel_source()
    # The state must move in 16-byte vectors (the kernel is memory-bound): fp32 pools as
    # float4, bf16 pools as uint4 (8 x bf16). A scalar fallback would halve the bandwidth.
    # bf16 pools at 32 lanes per row hold 4 columns per lane: 8-byte vectors (uint2).
    tile = dec.parse_tile(variant["tile"]) if variant["op"] != "commit" else dec.parse_tile("bv32")
    lanes = tile.lanes
    vec = "float4" if variant["pool_dtype"] == "float32" else ("uint2" if lanes == 32 else "uint4")
    # cache hints: the state moves through STATE_IO_SOURCE's helpers that way, else as vectors
    body = src.split('extern "C" __global__')[-1]   # the kernel, after the imported helpers
    # (a pipelined tile's state loads are cp.async copies: no load hint there)
    for way, hint in (("ld", "" if tile.pipe_stages else tile.load_hint), ("st", tile.store_hint)):
        assert (f"qla_{way}_state_{hint}" in body) == bool(hint)
    assert ("tl::cp_async_gs<" in body) == bool(tile.pipe_stages)
    if not (tile.load_hint or tile.store_hint):
        assert f"*({vec}*)(Pool" in src, "state accesses are not vectorised"
    # Batch is dynamic: one compile for every B / T (no literal batch in the launch grid).
    assert ("int B" in src) if variant["op"] == "decode" else ("int N" in src)
    # The layer's form waits for its conv grid (programmatic dependent launch); TileLang then
    # leaves __restrict__ off the pointers.
    after_conv = variant.get("after_conv", False)
    assert ("cudaGridDependencySynchronize();" in src) == after_conv
    restrict = "" if after_conv else " __restrict__"
    if variant.get("gating") == "ab":  # A_log and dt_bias each read in its own dtype (no host upcast)
        c_type = {"float32": "float", "bfloat16": "bfloat16_t", "float16": "half_t"}
        assert f"const {c_type[variant['param_dtype']]}*{restrict} A_log" in src
        assert f"const {c_type[variant['bias_dtype']]}*{restrict} dt_bias" in src


def test_tile_specs_parse_and_bad_ones_name_the_argument():
    """parse_tile: rows, warps, q/k staging, occupancy hint, lanes per row, cache hints, pipelining,
    the early and output-gathering forms; a thread must hold
    whole rows (a power of two of them) and at most 64 state values."""
    assert dec.parse_tile("bv32") == (32, 4, False, 0, 8, "", "", 1, 0, False, False)
    assert dec.parse_tile("bv16l32-mb12") == (16, 4, False, 12, 32, "", "", 1, 0, False, False)
    assert dec.parse_tile("bv8w1l16s-cs") == (8, 1, True, 0, 16, "cs", "cs", 1, 0, False, False)
    assert dec.parse_tile("bv32l16-lcg-scs") == (32, 4, False, 0, 16, "cg", "cs", 1, 0, False, False)
    assert dec.parse_tile("bv32-scs").store_hint == "cs" and dec.parse_tile("bv32-scs").load_hint == ""
    assert dec.parse_tile("bv4w1l32-cs") == (4, 1, False, 0, 32, "cs", "cs", 1, 0, False, False)
    assert dec.parse_tile("bv16l16-cs-p2")[7:9] == (2, 2) and dec.parse_tile("bv16l16-cs-p8s3")[7:9] == (8, 3)
    assert dec.parse_tile("bv16l16-cs")[7:9] == (1, 0)
    assert dec.parse_tile("bv16l16-cs-e") == (16, 4, False, 0, 16, "cs", "cs", 1, 0, True, False)
    assert dec.parse_tile("bv8l32-cs-p8s3-e")[7:] == (8, 3, True, False)
    assert dec.parse_tile("bv16l16-cs-o")[9:] == (False, True) and dec.parse_tile("bv8l32-cs-p8s3-e-o")[7:] == (8, 3, True, True)
    for bad in ("bv64w1", "bv8l32w4", "bv8w4", "bv16l4", "bv48", "bv64w1l32", "bv32-ca", "bv32-cs-lcg",
                "bv32-scs-lcg", "bv32-slu", "bv32-swt", "bv32e", "bv4", "bv4w2", "bv32p", "bv2w1l32",
                "bv64-p4", "bv16l16-p3", "bv16l16-p2s3", "bv16l16-p4s5", "bv16-p2-cs", "bv16-e-cs",
                "bv16-e-p2", "bv16-ee", "bv16-o-e", "bv16-oo", "bv16-o-p2"):
        with pytest.raises(ValueError, match="variant tile"):
            dec.parse_tile(bad)


def test_kernel_variants_are_unique_and_json_serialisable():
    vs = dec.kernel_variants(32, 16)
    names = [v["name"] for v in vs]
    # 16 fp32 decode x 2 tiles, 16 bf16 decode x 3, 32 verify x 2, 12 after_conv decode (bf16
    # pools: 2 tiles up to 256 rows, fp32: 1), 12 verify_slots x 2 tiles + 12 after_conv (1 tile up
    # to 64 rows), 12 after_conv verify (1 tile), 4 commit
    assert len(names) == len(set(names)) == 246
    assert sum(v.get("after_conv", False) for v in vs) == 42
    assert {v["op"] for v in vs if v.get("after_conv", False)} == {"decode", "verify", "verify_slots"}
    assert json.loads(json.dumps(vs)) == vs
    assert {v["pool_dtype"] for v in vs} == {"float32", "bfloat16"}
    assert {v["io_dtype"] for v in vs if v["op"] != "commit"} == {"bfloat16", "float16"}
    assert {v["op"] for v in vs} == {"decode", "verify", "verify_slots", "commit"}
    for pool in ("float32", "bfloat16"):
        for op in ("decode", "verify", "verify_slots"):
            for after_conv in (False, True):
                assert {v["tile"] for v in vs if v["op"] == op and v["pool_dtype"] == pool
                        and v.get("after_conv", False) == after_conv} == set(dec.decode_tiles(pool, after_conv, op))
    # the after_conv variants: only the tiles the layers' bounds reach (fp32 decode up to 256 rows:
    # bv16l16-cs, not bv32; verify up to 64 rows: bv16l16-cs, not bv8w1l16-cs)
    assert dec.decode_tiles("float32", True, "decode") == ["bv16l16-cs"]
    assert dec.decode_tiles("bfloat16", True, "decode") == ["bv16l16-cs", "bv64"]
    assert dec.decode_tiles("float32", True, "verify_slots") == ["bv16l16-cs"]
    assert dec.decode_tiles("bfloat16", False, "verify") == ["bv16l16-cs", "bv8w1l16-cs"]
    # SGLang's layers: A_log fp32 beside a dt_bias in the activation dtype, its own variant
    assert {(v["param_dtype"], v["bias_dtype"]) for v in vs if v.get("gating") == "ab"} == {
        ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
        ("float32", "bfloat16"), ("float32", "float16")}


def test_after_conv_bounds_stay_within_the_listed_variants():
    """The layers launch the after_conv form up to their own row bounds; kernel_variants (what
    precompile builds) covers the tiles up to decode.AFTER_CONV_MAX_ROWS. A backend bound above it
    would compile a variant on a server's first call instead."""
    from qla_serve.backends import gdn_layer
    from qla_serve.backends.sglang import verify_layer
    assert gdn_layer.DECODE_AFTER_CONV_MAX_ROWS <= dec.AFTER_CONV_MAX_ROWS["decode"]
    assert gdn_layer.SPEC_AFTER_CONV_MAX_ROWS <= dec.AFTER_CONV_MAX_ROWS["verify_slots"]
    assert verify_layer.AFTER_CONV_MAX_ROWS <= dec.AFTER_CONV_MAX_ROWS["verify"]


def test_the_decode_tile_follows_the_row_count_and_precompile_lists_every_pick():
    """decode_tile by rows = sequences x v-heads (the after_conv form, the verify ops, the cards
    with tables of their own), and every variant the lookup can pick at any batch on any card is
    in kernel_variants (a deployment's precompile covers it, wherever it is built)."""
    for card, tables in (("", dec.DECODE_TILES), *dec.CARD_DECODE_TILES.items()):
        for pool, table in tables.items():
            bound, first = table[0]
            assert dec.decode_tile(pool, 1, card=card) == first
            if bound is not None:
                assert dec.decode_tile(pool, bound, card=card) == first
                assert dec.decode_tile(pool, bound + 1, card=card) == table[1][1]
            assert dec.decode_tile(pool, 10**7, card=card) == table[-1][1] and table[-1][0] is None
    assert dec.decode_tile("bfloat16", 256, after_conv=True) == dec.AFTER_CONV_TILES["bfloat16"][-1][1]
    assert dec.decode_tile("float32", 256, after_conv=True) == dec.decode_tile("float32", 256)
    for op in ("verify", "verify_slots"):
        assert dec.decode_tile("float32", 8, op=op) == dec.VERIFY_TILES["float32"][0][1] != dec.decode_tile(
            "float32", 10**5, op=op) == dec.VERIFY_TILES["float32"][-1][1]
    names = {v["name"] for v in dec.kernel_variants(HV, HK)}
    for v in dec.kernel_variants(HV, HK):
        if v["op"] != "commit":
            after = v.get("after_conv", False)
            for rows in (1, 64, 65, 128, 129, 256, 4096, 4097, 10**6):
                if after and rows > dec.AFTER_CONV_MAX_ROWS[v["op"]]:
                    continue              # the layers launch the plain form there
                for card in dec.CARDS:
                    tile = dec.decode_tile(v["pool_dtype"], rows, after, v["op"], card)
                    assert dec._variant(v["op"], HV, HK, v["io_dtype"], v["pool_dtype"], v["gating"], v["ab_dtype"],
                                        v["param_dtype"], v["l2norm"], tile, bias=v["bias_dtype"],
                                        after_conv=after)["name"] in names, (card, rows, v["name"])


def test_the_card_follows_the_cuda_device_name():
    """card_of: the H100s (SXM, PCIe, NVL names) take the H100 table; the H200 and other cards
    DECODE_TILES. Above 2048 fp32 rows the H100 takes FlashInfer's structure, the H200 its
    8-tile pipeline."""
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"):
        assert dec.card_of(name) == "H100"
    for name in ("NVIDIA H200", "NVIDIA GH200 480GB", "NVIDIA B200", ""):
        assert dec.card_of(name) == ""
    assert dec.decode_tile("float32", 2048, card="H100") == "bv16l16-cs" == dec.decode_tile("float32", 2048)
    assert dec.decode_tile("float32", 16384, card="H100") == "bv8l32-p2-e-o" != dec.decode_tile("float32", 16384)
    assert dec.decode_tile("bfloat16", 16384, card="H100") == "bv16l16-cs-p8s4-o"
    assert dec.decode_tile("bfloat16", 16384, card="H200") == dec.DECODE_TILES["bfloat16"][-1][1]


def test_the_after_conv_form_never_picks_an_early_tile():
    """The early form (-e) is refused after the conv (its gates would load before the conv's
    writes are waited for); the after_conv rows, up to AFTER_CONV_MAX_ROWS, must pick a tile
    without it on every card (a card table's first entries serve them where AFTER_CONV_TILES has
    no table for the pool dtype)."""
    for card in dec.CARDS:
        for pool in ("float32", "bfloat16"):
            for op in ("decode", "verify", "verify_slots"):
                for rows in (1, 8, 64, 128, dec.AFTER_CONV_MAX_ROWS[op]):
                    tile = dec.decode_tile(pool, rows, after_conv=True, op=op, card=card)
                    assert not dec.parse_tile(tile).early, (card, pool, op, rows, tile)


def test_bad_variants_and_targets_are_rejected():
    v = dec.kernel_variants(HV, HK)[0]
    with pytest.raises(ValueError, match="target"):
        dec.build(v, "sm_80")
    with pytest.raises(ValueError, match="pool dtype"):
        dec.build(dict(v, pool_dtype="float16"), "sm_90a")
    with pytest.raises(ValueError, match="tile"):
        dec.build(dict(v, tile="bv48"), "sm_90a")
    with pytest.raises(ValueError, match="pipelined"):
        dec.build(dict(dec._variant("verify", HV, HK, "bfloat16", "float32", "gb", None, None, False), tile="bv16l16-p2"),
                  "sm_90a")
    with pytest.raises(ValueError, match="num_v_heads"):
        dec.kernel_variants(6, 4)


def test_unsupported_dtypes_raise_before_any_launch():
    """CPU tensors suffice: the dtype check runs on host metadata before device lookup."""
    q = torch.zeros(2, HK, 128, dtype=torch.bfloat16)
    pool = torch.zeros(3, HV, 128, 128, dtype=torch.float16)
    with pytest.raises(TypeError, match="pool"):
        dec.decode(q, q, torch.zeros(2, HV, 128, dtype=torch.bfloat16), pool,
                   torch.zeros(2, dtype=torch.int32), g=torch.zeros(2, HV), beta=torch.zeros(2, HV),
                   a=None, b=None, A_log=None, dt_bias=None, use_qk_l2norm=False, scale=None,
                   out=torch.zeros(2, HV, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alignment_checks_name_the_argument(dtype):
    """The host-side vector-access rules (plain CPU tensors: metadata only): pool and
    intermediate slot strides of whole 16-byte vectors, q/k strides of whole io vectors."""
    vec = 16 // torch.tensor([], dtype=dtype).element_size()
    pool = torch.zeros(3, 2, 128, 128, dtype=dtype)
    inter = torch.zeros(2, 3, 2, 128, 128, dtype=dtype)
    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    dec._check_alignment(8, pool, q, q, inter)  # engine layouts pass
    # a slot stride one element past a vector: pool (through both checks), then intermediate
    step = 2 * 128 * 128  # one slot's elements
    bad_pool = torch.zeros(3 * (step + 1), dtype=dtype).as_strided(pool.shape, (step + 1,) + pool.stride()[1:])
    with pytest.raises(ValueError, match="pool: .*stride"):
        dec.check_pool_alignment(bad_pool)
    with pytest.raises(ValueError, match="pool: .*stride"):
        dec._check_alignment(8, bad_pool, q, q, inter)
    bad_inter = torch.zeros(2 * 3 * step + vec, dtype=dtype).as_strided(
        inter.shape, (3 * step, step + 1) + inter.stride()[2:])
    with pytest.raises(ValueError, match=rf"intermediate: strides \(0, 1\) must be multiples of {vec} elements"):
        dec.check_intermediate_alignment(bad_inter)
    with pytest.raises(ValueError, match="intermediate: strides"):
        dec._check_alignment(8, pool, q, q, bad_inter)
    # q/k: a token stride off the io vector names the tensor
    bad_k = torch.zeros(4 * 2 * 128 + 4, dtype=torch.bfloat16).as_strided(q.shape, (2 * 128 + 1, 128, 1))
    with pytest.raises(ValueError, match="k: the decode kernels need token/head strides"):
        dec._check_alignment(8, pool, q, bad_k, inter)
