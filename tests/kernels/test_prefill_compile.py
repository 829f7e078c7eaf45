"""Compile-only tests of the TileLang prefill kernels (marker `compile`: nvcc, no GPU).

Every variant of one head pair (8/24 qk/v heads: prep in both forms, V-first and v8 stage 2 for every io
and pool dtype, split and mode, the CP scan and warmup finder; 30 compiles, ~2 minutes on 2 cores)
compiles for sm_90a, and every prefill variant of the Blackwell module (28) for sm_100a; a few
representatives are also checked for their resources (registers, shared memory, spills: the
occupancy each kernel's launch bounds claim). Compiling builds real cubins through nvcc and
TileLang's cache, so a lowering or ptxas error fails here.
"""

import json
import re
import sys
from pathlib import Path

import pytest

from qla_serve.kernels.hopper import prefill_api as P
from qla_serve.kernels.hopper import prefill_launch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kernel_report  # noqa: E402  (benchmarks/kernel_report.py: the offline resource report)

pytestmark = pytest.mark.compile


def test_kernel_variants_are_json_and_unique():
    vs = P.kernel_variants(24, 8)
    assert json.loads(json.dumps(vs)) == vs
    names = [v["name"] for v in vs]
    assert len(set(names)) == len(names)
    assert {v["v_split"] for v in vs if v["op"] == "prefill_main"} == {1, 2, 4}
    assert {v["mode"] for v in vs if v["op"] == "prefill_main"} == {"output", "maps"}
    with pytest.raises(ValueError, match="num_v_heads"):
        P.kernel_variants(10, 4)


def test_package_union_and_dispatch():
    from qla_serve.kernels import hopper

    names = {v["name"] for v in hopper.kernel_variants(8, 2)}
    assert {v["name"] for v in P.kernel_variants(8, 2)} <= names
    assert hopper.ARCH == "sm_90a"
    assert hopper.SUPPORTED_STRATEGIES == {"plain", "vsplit", "cp"}


REPRESENTATIVES = [
    P.prep_variant(8, 2, "bfloat16"),
    P.prep_variant(8, 2, "bfloat16", "m"),
    P.prep_variant(8, 2, "bfloat16", "m", packed=True),
    P.main_variant(8, 2, "bfloat16", "float32", 1),
    P.main_variant(8, 2, "bfloat16", "bfloat16", 4),
    P.main_variant(8, 2, "float16", "float32", 2),
    P.main_variant(8, 2, "bfloat16", "float32", 1, "maps"),
]


@pytest.mark.parametrize("variant", REPRESENTATIVES, ids=lambda v: v["name"])
def test_compiles_sm90a(variant):
    kern = P.build(variant, "sm_90a")
    src = kern.get_kernel_source()
    assert "wgmma" in src, "expected Hopper tensor-core (wgmma) code"
    if variant["op"] == "prefill_main":
        assert "tma_load" in src, "expected TMA tile loads in the chunk walk"
        assert "mbarrier" in src or ".arrive()" in src, "expected the warp-specialised kernel (mbarriers)"
        assert "warpgroup_reg_dealloc" in src, "expected the producer warpgroup to give registers back"
        # "maps" (CP pass 1) stores the walked state to the segment maps; "output" only reads them.
        assert bool(re.search(r"maps\[[^;]*\] = h_f\[", src)) == (variant["mode"] == "maps")
    else:
        # prep v11: 4 CTAs per SM (<= 128 registers, <= 56 KB of shared memory each), and q, k, v
        # enter the tensor cores as loaded: no fp16 tile is made in shared memory.
        # form "m" (no U0/Wk tiles, 34 KB): 5 CTAs per SM; the shared memory of each form fits its
        # CTAs per SM (228 KB per SM, 1 KB of it reserved per CTA)
        ctas = PREP_CTAS_PER_SM[variant.get("form", "uw")]
        assert f"__launch_bounds__(128, {ctas})" in src
        smem = kernel_report.launch_dynamic_smem(kern.get_host_source(), threads=128)
        assert smem is not None and smem <= 56 * 1024 and ctas * (smem + 1024) <= 228 * 1024, \
            f"prep takes {smem} bytes of shared memory: fewer than {ctas} CTAs per SM"
        assert "DataType::kBFloat16" in src, "expected bf16 wgmma on the raw q/k/v tiles"
        # the fp16 copies go to two distinct buffers (one shared annotation object once bound
        # both parameters to kh: q's copy overwrote k's, caught only on the H200)
        assert re.search(r"\(qh \+", src) and re.search(r"\(kh \+", src), "expected stores to both qh and kh"
        # form "uw" stores P, U0 and -Wk (and loads v for U0); form "m" never reads v and stores
        # P and M, or packed P^T into mbuf's tile, then adds M's strict lower triangle into it
        # (a TMA reduce) and writes M's diagonal apart
        stores = set(re.findall(r"tma_store\((\w+)_desc", src))
        adds = set(re.findall(r"tma_store_add\((\w+)_desc", src))
        loads_v = "tma_load(v_desc" in src
        if variant.get("packed"):
            assert stores == {"mbuf"} and adds == {"mbuf"} and not loads_v, (stores, adds)
            assert re.search(r"dbuf\[", src), "expected M's diagonal stored"
        elif variant.get("form", "uw") == "m":
            assert stores == {"pbuf", "mbuf"} and not adds and not loads_v, (stores, adds)
            assert "dbuf[" not in src
        else:
            assert stores == {"pbuf", "ubuf", "wbuf"} and not adds and loads_v, (stores, adds)


@pytest.mark.parametrize("form", ["m", "uw"])
def test_prep_fp16_qk_beside_bf16_v(form):
    """fp16 q/k beside bf16 v (QK_V_DTYPES; the engine layers' form): Q K^T and K K^T in fp16 on
    the tiles as loaded, no fp16 copies written (stage 2 reads q/k themselves), the same CTAs
    per SM; form "uw" meets V in bf16 and K in fp16 (two hi + lo pairs). Names: the one-dtype
    variants keep theirs."""
    variant = P.prep_variant(8, 2, "bfloat16", form, "float16")
    assert variant["name"].endswith("_qkfloat16")
    assert P.prep_variant(8, 2, "bfloat16", form, "bfloat16") == P.prep_variant(8, 2, "bfloat16", form)
    assert variant in P.kernel_variants(8, 2)
    with pytest.raises(ValueError, match="q/k dtype bfloat16 with v dtype float16"):
        P.prep_variant(8, 2, "float16", form, "bfloat16")
    kern = P.build(variant, "sm_90a")
    src = kern.get_kernel_source()
    assert "DataType::kFloat16" in src
    assert not re.search(r"\(qh \+", src) and not re.search(r"\(kh \+", src), "no fp16 copies of fp16 q/k"
    assert ("DataType::kBFloat16" in src) == (form == "uw"), "only M V meets a bf16 tile"
    ctas = PREP_CTAS_PER_SM[form]
    assert f"__launch_bounds__(128, {ctas})" in src
    smem = kernel_report.launch_dynamic_smem(kern.get_host_source(), threads=128)
    assert smem is not None and ctas * (smem + 1024) <= 228 * 1024, smem


PREP_CTAS_PER_SM = {"uw": 4, "m": 5}
# ptxas spill stores allowed per form: form "m" at 5 CTAs per SM (<= 102 registers) spills 16
# bytes (four values kept across the solve: a handful of STL/LDL in the whole kernel, no loop).
PREP_SPILL_BYTES = {"uw": 0, "m": 16}


@pytest.mark.parametrize("form", ["uw", "m"])
def test_prep_fits_its_ctas_per_sm(tmp_path, form):
    """ptxas on prep's source (benchmarks/kernel_report.py): the registers that fit the form's
    CTAs per SM, and no more spilled than recorded. v11's first layout needed 146 registers; at
    __launch_bounds__(128, 4) ptxas then spills instead of failing, so only this check notices."""
    kern = P.build(P.prep_variant(8, 2, "bfloat16", form), "sm_90a")
    usage, _ = kernel_report.ptxas(kern.get_kernel_source(), "sm_90a", tmp_path)
    assert usage["registers"] * 128 * PREP_CTAS_PER_SM[form] <= 65536, usage
    assert usage["spill_store_bytes"] <= PREP_SPILL_BYTES[form], usage


@pytest.mark.parametrize("heads,packed", [(2, False), (4, True)])
def test_prep_heads_per_cta(tmp_path, heads, packed, monkeypatch):
    """Stage 1 with several v-heads per CTA (form "m"): Q K^T (K Q^T packed) once per CTA, each
    head's P and M stored (one TMA store per head and tile; packed: P^T's store and M's TMA
    reduce into one tile per head), four CTAs per SM (registers and shared memory: each head's
    tiles are allocated per head, so their lifetimes do not stack), named apart, listed where
    Hv / Hk allows them (this form, one head solved at a time, with PREP_PAIR off; test_prep_pair_solve
    has the pair's) and refused where not."""
    monkeypatch.setattr(P, "PREP_PAIR", False)
    variant = P.prep_variant(8, 2, "bfloat16", "m", "float16", heads, packed=packed)
    assert variant["name"].endswith(f"_qkfloat16_heads{heads}" + ("_pm" if packed else ""))
    assert variant in P.kernel_variants(8, 2)
    assert P.prep_variant(64, 16, "bfloat16", "m", "float16", heads, packed=packed) in P.kernel_variants(64, 16)
    kern = P.build(variant, "sm_90a")
    src = kern.get_kernel_source()
    if packed:
        assert src.count("tma_store(mbuf_desc") == heads and src.count("tma_store_add(mbuf_desc") == heads
        assert "pbuf_desc" not in src  # P^T goes packed into mbuf's tile
    else:
        assert src.count("tma_store(pbuf_desc") == heads and src.count("tma_store(mbuf_desc") == heads
        assert "tma_store_add" not in src
    assert "__launch_bounds__(128, 4)" in src
    smem = kernel_report.launch_dynamic_smem(kern.get_host_source(), threads=128)
    assert smem is not None and 4 * (smem + 1024) <= 228 * 1024, smem
    usage, _ = kernel_report.ptxas(src, "sm_90a", tmp_path)
    assert usage["registers"] * 128 * 4 <= 65536, usage
    assert usage["spill_store_bytes"] <= PREP_HEADS_SPILL_BYTES[heads], usage
    assert not any("heads_per_cta" in v for v in P.kernel_variants(24, 8))  # Hv / Hk = 3
    with pytest.raises(ValueError, match="heads_per_cta"):
        P.prep_variant(24, 8, "bfloat16", "m", None, 2)
    with pytest.raises(ValueError, match="heads_per_cta"):
        P.prep_variant(8, 2, "bfloat16", "uw", None, 2)


# ptxas spill stores of the grouped prep at four CTAs per SM (<= 128 registers).
PREP_HEADS_SPILL_BYTES = {2: 0, 4: 48}


@pytest.mark.parametrize("heads,packed", [(2, True), (4, False)])
def test_prep_pair_solve(tmp_path, heads, packed, monkeypatch):
    """Stage 1 solving two heads at once (pair_solve): one qla_block_solve_m_pair call per pair of
    heads and no single-head solve, csrc/block_solve_pair.cuh imported only there (the other
    variants' sources, and so their compile caches, unchanged), the CTAs per SM the grouped prep
    claims (five at two heads: <= 102 registers and <= 44 KB of shared memory; four at four), no
    spills, wgmma kept asynchronous; listed (for precompile) in place of the one-head-at-a-time
    variant while PREP_PAIR is on (the default), not when it is off; refused with one head."""
    variant = P.prep_variant(8, 2, "bfloat16", "m", "float16", heads, packed=packed, pair_solve=True)
    plain_variant = P.prep_variant(8, 2, "bfloat16", "m", "float16", heads, packed=packed)
    assert variant["name"] == plain_variant["name"] + "_pair"
    monkeypatch.setattr(P, "PREP_PAIR", False)
    assert variant not in P.kernel_variants(8, 2) and plain_variant in P.kernel_variants(8, 2)
    monkeypatch.setattr(P, "PREP_PAIR", True)
    assert variant in P.kernel_variants(8, 2) and plain_variant not in P.kernel_variants(8, 2)
    kern = P.build(variant, "sm_90a")
    src = kern.get_kernel_source()
    assert src.count("qla_block_solve_m_pair((") == heads // 2 and "qla_block_solve_m((" not in src
    plain = P.build(plain_variant, "sm_90a")
    assert "qla_block_solve_m_pair" not in plain.get_kernel_source()
    ctas = 5 if heads == 2 else 4
    smem = kernel_report.launch_dynamic_smem(kern.get_host_source(), threads=128)
    assert smem is not None and ctas * (smem + 2048) <= 228 * 1024, smem
    usage, _ = kernel_report.ptxas(src, "sm_90a", tmp_path)
    assert usage["registers"] * 128 * ctas <= 65536 and usage["spill_store_bytes"] == 0, usage
    assert not usage["wgmma_serialized"], usage
    with pytest.raises(ValueError, match="pair_solve"):
        P.prep_variant(8, 2, "bfloat16", "m", "float16", 1, pair_solve=True)


@pytest.mark.parametrize("heads", [1, 4])
def test_prep_mma_solve(tmp_path, heads, monkeypatch):
    """Stage 1's two solves (PREP_SOLVE): form "m" runs the mma.sync one (csrc/block_solve.cuh)
    by default under the form's names; its wgmma one is named "_wgmma" and listed by
    kernel_variants only when it is the solve in use; form "uw" has the wgmma solve only, under
    its names. The mma variant's source calls the helper and holds m16n8k16 products beside the
    Q K^T / K K^T wgmma (not serialized); it fits the CTAs per SM without spills and asks for no
    more shared memory than the wgmma one (it has no N, I - N, N^2 or B tiles; at one head the
    allocator overlaps those with others). With PREP_PAIR off, so that the four-head variant
    listed is this one-head-at-a-time form (test_prep_pair_solve has the pair's listing)."""
    monkeypatch.setattr(P, "PREP_PAIR", False)
    variant = P.prep_variant(8, 2, "bfloat16", "m", "float16", heads)
    assert variant == P.prep_variant(8, 2, "bfloat16", "m", "float16", heads, "mma")
    assert "solve" not in variant and variant in P.kernel_variants(8, 2)
    wgmma = P.prep_variant(8, 2, "bfloat16", "m", "float16", heads, "wgmma")
    assert wgmma["name"] == variant["name"] + "_wgmma" and wgmma not in P.kernel_variants(8, 2)
    monkeypatch.setattr(P, "PREP_SOLVE", "wgmma")
    assert wgmma in P.kernel_variants(8, 2) and variant not in P.kernel_variants(8, 2)
    assert P.prep_variant(8, 2, "bfloat16", "uw") == P.prep_variant(8, 2, "bfloat16", "uw", None, 1, "wgmma")
    assert "solve" not in P.prep_variant(8, 2, "bfloat16", "uw")
    with pytest.raises(ValueError, match="solve"):
        P.prep_variant(8, 2, "bfloat16", "uw", None, 1, "mma")
    with pytest.raises(ValueError, match="solve"):
        P.prep_variant(8, 2, "bfloat16", "m", None, 1, "cublas")
    kern = P.build(variant, "sm_90a")
    src = kern.get_kernel_source()
    assert src.count("qla_block_solve_m(") == heads + 1  # the definition and one call per head
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src and "wgmma" in src
    usage, _ = kernel_report.ptxas(src, "sm_90a", tmp_path)
    assert usage["registers"] * 128 * P.prefill_prep.ctas_per_sm("m", heads) <= 65536, usage
    assert usage["spill_store_bytes"] == 0 and not usage["wgmma_serialized"], usage
    base = P.build(wgmma, "sm_90a")
    assert "qla_block_solve_m" not in base.get_kernel_source()
    smem, base_smem = (kernel_report.launch_dynamic_smem(k.get_host_source(), threads=128) for k in (kern, base))
    assert smem <= base_smem, (smem, base_smem)


def test_swizzled_tile_layout_is_the_mma_solves():
    """csrc/block_solve.cuh addresses the [64, 64] fp16 tiles of make_swizzled_layout (which the
    TMA stores and TileLang's own stmatrix use) as the 128-byte swizzle, element (r, c) at
    r * 64 + ((c / 8) ^ (r % 8)) * 8 + c % 8: that is TileLang 0.1.12's layout."""
    from tilelang.layout import make_swizzled_layout
    from tvm import arith, tirx

    layout = make_swizzled_layout(tirx.decl_buffer((64, 64), "float16", scope="shared.dyn"))
    shape = [int(x) for x in layout.get_output_shape()]
    analyzer = arith.Analyzer()
    for r in range(64):
        for c in range(64):
            idx = [int(analyzer.simplify(x)) for x in layout.map_forward_index([r, c])]
            flat = 0
            for i, n in zip(idx, shape):
                flat = flat * n + i
            assert flat == r * 64 + (((c // 8) ^ (r % 8)) * 8) + c % 8, (r, c, idx)


# tensor-core calls in TileLang's CUDA (wgmma_ss/_rs, mma_sync, tl::mma...); "mma" alone would
# also match cudaTriggerProgrammaticLaunchCompletion, which the CP passes call (prefill_api.CP_PDL)
_TENSOR_CORE_OPS = re.compile(r"wgmma|mma_sync|\bmma\w*\(|::mma")


def test_compiles_cp_scan_sm90a():
    """The CP scan: fp32 FMAs on the CUDA cores (no tensor-core rounding), one launch."""
    src = P.build(P.scan_variant(8), "sm_90a").get_kernel_source()
    assert "gdn_prefill_cp_scan" in src and not _TENSOR_CORE_OPS.search(src)


def test_compiles_cp_warmup_sm90a():
    """The gate-warmup finder: a scalar walk per (segment, head) over stage 1's chunk decays
    (log of exp(gc[63])), compared with the -10 threshold; no tensor cores."""
    src = P.build(P.warmup_variant(8), "sm_90a").get_kernel_source()
    assert "gdn_prefill_cp_warmup" in src and not _TENSOR_CORE_OPS.search(src)
    assert "logf(" in src and "-1.000000e+01" in src, "expected log decays summed against -10"


def test_launches_go_to_the_kernels_host_function():
    """prefill_api launches through raw_launch.raw_function: the compiled host function itself
    (a tvm_ffi Function, not TileLang's Python adapter; behind launch_record.recordable, the
    launch replay's recording hook), which still checks its arguments. Here,
    with no GPU, that check is what runs: CPU tensors are refused by the host function by name,
    before any launch. (Whether the launch itself runs is test_prefill_gpu.py's business.)"""
    import torch
    import tvm_ffi

    fn = prefill_launch._kernel(P.warmup_variant(8), "sm_90a")
    assert isinstance(fn.raw, tvm_ffi.Function)
    fbuf = torch.zeros(4, 8, 2, 64)
    offsets, cuts = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([[0, 2, 0]], dtype=torch.int32)
    warm, need = torch.zeros(2, 8, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="gdn_prefill_cp_warmup input fbuf device_type mismatch"):
        fn(fbuf, offsets, cuts, warm, need, 2, 1)


@pytest.mark.parametrize("v_split,mode,packed", [(1, "output", True), (2, "output", False), (2, "maps", False)])
def test_compiles_vfirst_sm90a(v_split, mode, packed):
    """The V-first stage 2 (prefill_main_vfirst.py, the default at v_split 1/2): every chain GEMM takes its A
    operand from registers (wgmma_rs), nothing of the state is copied to shared memory, and the
    consumer warpgroups meet no named barrier. Packed (whole-sequence plans), two producer warps
    unpack stage 1's tile; the context-parallel passes read P and M apart."""
    variant = P.main_variant(8, 2, "bfloat16", "float32", v_split, mode, "vfirst", packed=packed)
    src = P.build(variant, "sm_90a").get_kernel_source()
    assert "gdn_prefill_main_vfirst" in src and "wgmma_rs" in src and "wgmma_ss" not in src
    # no barrier over the consumer threads anywhere (TileLang's automatic ones are off: every
    # handoff has its own mbarrier), only the one after the mbarriers' initialisation
    assert "hs_s" not in src and "__sync_thread_partial" not in src and src.count("__syncthreads()") == 1
    # a whole chunk's O leaves by TMA store (from the swizzled o_s, issued by the storer warp)
    assert ("tma_store(out_desc" in src) == (mode == "output")
    # V-first reads M (prep form "m") and v, never U0 / -Wk; packed: stage 1's P^T / M tile and
    # M's diagonal, unpacked by two producer warps (csrc/unpack_pm.cuh), else P (outputs) and M
    assert "tma_load(mbuf_desc" in src and "tma_load(values_desc" in src and "ubuf" not in src
    assert ("tma_load(pd_desc" in src) == (packed or mode == "output")
    call = re.search(r"qla_unpack_pm\((\(&.*)\);", src)
    assert bool(call) == packed and (not packed or call.group(1).endswith(", 1")), call
    assert ("warpgroup_reg_alloc" in src) == (v_split == 1), "setmaxnreg.inc only at 384 threads"


WGMMA_KERNELS = ([P.main_variant(8, 2, "bfloat16", "float32", vs, mode, "vfirst")
                  for vs in (1, 2) for mode in ("output", "maps")]
                 + [P.main_variant(8, 2, "bfloat16", "float32", 1, "output", "vfirst", packed=True)]
                 + [P.persistent_variant(8, 2, "bfloat16", "float32", vs, vs == 1) for vs in (1, 2)]
                 + [P.prep_variant(8, 2, "bfloat16", "m", "float16", heads, packed=pk)
                    for heads in (1, 4) for pk in (False, True)])


@pytest.mark.parametrize("variant", WGMMA_KERNELS, ids=lambda v: v["name"])
def test_wgmma_not_serialized(variant, tmp_path):
    """ptxas keeps the prefill's wgmma asynchronous: no C7515 remark. An instruction that writes
    a wgmma accumulator while another wgmma is in flight makes ptxas serialize every wgmma of the
    kernel, silently: v30's first form built P inside Q K^T's accumulator during R M^T and its
    chunk walk ran ~1.8x slower on the H200 (benchmarks/HISTORY.md, v30)."""
    usage, _ = kernel_report.ptxas(P.build(variant, "sm_90a").get_kernel_source(), "sm_90a", tmp_path)
    assert not usage["wgmma_serialized"], usage


@pytest.mark.parametrize("v_split,packed", [(1, True), (2, False), (1, False)])
def test_compiles_persistent_sm90a(v_split, packed):
    """The V-first stage 2 on the persistent grid: the same chain (A operands from registers, no
    barrier over the consumers, O by TMA store from the storer warp), one grid dimension (the
    length of ``ctas``), the units' sequences read from ``items``; packed (v_split 1, as
    prefill_api.packed_tiles takes it) stage 1's tile unpacked by two producer warps, else P and M
    loaded apart."""
    kern = P.build(P.persistent_variant(8, 2, "bfloat16", "float32", v_split, packed), "sm_90a")
    src = kern.get_kernel_source()
    assert "gdn_prefill_main_persistent" in src and "wgmma_rs" in src and "wgmma_ss" not in src
    assert "__sync_thread_partial" not in src and src.count("__syncthreads()") == 1
    assert "tma_store(out_desc" in src and "tma_load(mbuf_desc" in src and "items[" in src
    assert "tma_load(pd_desc" in src  # packed: M's diagonal, else P
    assert bool(re.search(r"qla_unpack_pm\(\(&.*, 1\);", src)) == packed
    assert "blockIdx.y" not in src and "blockIdx.z" not in src
    assert ("warpgroup_reg_alloc" in src) == (v_split == 1)


# ptxas spill stores allowed in the one-launch prefill: 12 bytes at session 69's build (nvcc 13.0;
# the next chunk's gate values held across the solve at 104 registers), consumers at 192.
FUSED_SPILL_BYTES = 16


@pytest.mark.parametrize("io,pool,pingpong", [("bfloat16", "float32", False), ("float16", "bfloat16", False),
                                              ("bfloat16", "float32", True)])
def test_compiles_fused_sm90a(io, pool, pingpong, tmp_path):
    """The one-launch prefill (prefill_fused.py): the chain's GEMMs take their A operand from
    registers (wgmma_rs) and the solve warpgroup's Q K^T and K K^T both operands from shared
    memory (wgmma_ss); the block solve writes the ring's M tile; setmaxnreg gives the consumers
    192 registers, the solve warpgroup 104 and the producer 24 (2 x 128 x 192 + 128 x 104 + 128 x
    24 = 65536); the only barrier over the whole CTA is the one after the mbarriers'
    initialisation, and the solve warpgroup's own barriers count its 128 threads; q, k and v
    arrive by TMA and no stage-1 workspace is read; ptxas keeps the wgmma asynchronous and
    spills at most FUSED_SPILL_BYTES; the shared memory fits one CTA per SM. pingpong: the
    consumer warpgroups also pass the issue turn on named barriers 2 and 3 (256 threads)."""
    kern = P.build(P.fused_variant(8, 2, io, pool, pingpong), "sm_90a")
    src = kern.get_kernel_source()
    assert "gdn_prefill_fused" in src and "wgmma_rs" in src and "wgmma_ss" in src
    assert re.search(r"qla_block_solve_m\(.*m_s\)\[", src), "the solve writes the ring's M tile"
    assert [int(n) for n in re.findall(r"warpgroup_reg_(?:alloc|dealloc)<(\d+)>", src)] == [192, 24, 104]
    assert src.count("__syncthreads()") == 1
    partial = set(re.findall(r"__sync_thread_partial\((.*?), (\d+)\);", src))
    assert {n for _, n in partial} == ({"128", "256"} if pingpong else {"128"}), partial
    assert ("named_barrier_arrive" in src) == pingpong
    for name in ("q_desc", "k_desc", "values_desc"):
        assert f"tma_load({name}" in src, name
    assert "mbuf" not in src and "fbuf" not in src and "tma_store(out_desc" in src
    usage, _ = kernel_report.ptxas(src, "sm_90a", tmp_path)
    assert not usage["wgmma_serialized"], usage
    assert usage["spill_store_bytes"] <= FUSED_SPILL_BYTES, usage
    smem = kernel_report.launch_dynamic_smem(kern.get_host_source(), threads=512)
    assert smem is not None and smem + 1024 <= 227 * 1024, smem


def test_fused_applies_to_plain_fp16_qk_plans_only(monkeypatch):
    """prefill_api.fused_applies: FUSED on, sm_90a, a plain plan (v_split 1) and fp16 q / k;
    the variant list holds the one-launch kernels (2 io x 2 pools) only while FUSED is on, and
    the switch is off unless QLA_SERVE_PREFILL_FUSED says 1."""
    monkeypatch.setattr(P, "FUSED", True)
    assert P.fused_applies("plain", 1, "float16")
    assert not P.fused_applies("plain", 1, "bfloat16")
    assert not P.fused_applies("vsplit", 2, "float16") and not P.fused_applies("cp", 1, "float16")
    assert not P.fused_applies("plain", 1, "float16", "sm_100a")
    fused = [v for v in P.kernel_variants(8, 2) if v["op"] == "prefill_fused"]
    assert sorted((v["io_dtype"], v["pool_dtype"]) for v in fused) == sorted(
        (io, pool) for io in P.IO_DTYPES for pool in P.POOL_DTYPES)
    monkeypatch.setattr(P, "FUSED", False)
    assert not P.fused_applies("plain", 1, "float16")
    assert not any(v["op"] == "prefill_fused" for v in P.kernel_variants(8, 2))
    monkeypatch.delenv("QLA_SERVE_PREFILL_FUSED", raising=False)
    assert P._switch_from_env("QLA_SERVE_PREFILL_FUSED", "0") is False
    monkeypatch.setenv("QLA_SERVE_PREFILL_FUSED", "1")
    assert P._switch_from_env("QLA_SERVE_PREFILL_FUSED", "0") is True


def test_vfirst_is_chosen_only_where_it_applies(monkeypatch):
    """MAIN_IMPL "vfirst" applies to v_split 1/2 on sm_90a; v_split 4 and sm_100a keep v8, and
    the sm_100a variant list never holds a wgmma-only kernel."""
    from qla_serve.kernels import blackwell

    monkeypatch.setattr(P, "MAIN_IMPL", "vfirst")
    assert [P.main_impl_for(vs) for vs in (1, 2, 4)] == ["vfirst", "vfirst", "v8"]
    assert P.main_impl_for(1, "sm_100a") == "v8"
    monkeypatch.setattr(P, "PERSISTENT", True)
    mains = [v for v in P.kernel_variants(8, 2) if v["op"] == "prefill_main"]
    # 2 io x 2 pools x 2 modes at each split: V-first at 1 and 2 (no v8 twin), v8 at 4; the
    # V-first output pass also packed at 1 (plans without a cut) and on the persistent grid (plain
    # and V-split plans) at 1 (packed) and 2, 2 io x 2 pools
    persistent = [v for v in mains if v.get("persistent")]
    assert sorted((v["v_split"], v["impl"], v["mode"]) for v in persistent) == sorted(
        [(1, "vfirst", "output")] * 4 + [(2, "vfirst", "output")] * 4)
    assert sorted((v["v_split"], v.get("impl", "v8")) for v in mains if not v.get("persistent")) == sorted(
        [(1, "vfirst")] * 12 + [(2, "vfirst")] * 8 + [(4, "v8")] * 8)
    assert sorted((v["v_split"], v["mode"], v.get("persistent", False)) for v in mains if v.get("packed")) == (
        [(1, "output", False)] * 4 + [(1, "output", True)] * 4)
    assert not any(v.get("impl") == "vfirst" for v in blackwell.kernel_variants(8, 2))
    monkeypatch.setattr(P, "MAIN_IMPL", "v8")
    assert not any(n.endswith("_vfirst") for n in (v["name"] for v in P.kernel_variants(8, 2)))
    with pytest.raises(ValueError, match="impl"):
        P.main_variant(8, 2, "bfloat16", "float32", 1, "output", "v9")
    monkeypatch.setenv("QLA_SERVE_PREFILL_MAIN", "v9")
    with pytest.raises(ValueError, match="QLA_SERVE_PREFILL_MAIN: expected one of"):
        P._main_impl_from_env()
    monkeypatch.setenv("QLA_SERVE_PREFILL_MAIN", " VFirst ")
    assert P._main_impl_from_env() == "vfirst"
    monkeypatch.delenv("QLA_SERVE_PREFILL_MAIN")
    assert P._main_impl_from_env() == "vfirst", "V-first is the default"


DEPENDENT_LAUNCHES = [
    P.main_variant(8, 2, "bfloat16", "float32", 1, "maps", "vfirst", pdl=True),
    P.main_variant(8, 2, "bfloat16", "bfloat16", 2, "maps", "vfirst", pdl=True),
    P.main_variant(8, 2, "bfloat16", "float32", 4, "maps", "v8", pdl=True),
    P.scan_variant(8, pdl=True),
    P.warmup_variant(8, pdl=True),
]


@pytest.mark.parametrize("variant", DEPENDENT_LAUNCHES, ids=lambda v: v["name"])
def test_dependent_launches_wait_before_they_touch_memory(variant):
    """prefill_api.CP_PDL's kernels (the CP passes): at the kernel's top level, outside any
    branch (so every thread of every block runs them), the next launch is triggered and then the
    grid before is waited for (griddepcontrol.wait); no global load or store, TMA or plain, comes
    before the wait. Without pdl neither call is there, and the names tell the forms apart."""
    src = P.build(variant, "sm_90a").get_kernel_source()
    head = re.search(r'extern "C" __global__ void __launch_bounds__[^{]*\{', src)
    assert head, "kernel definition not found"
    body = src[head.end():]
    params = re.findall(r"(\w+)\*\s*(?:__restrict__\s+)?(\w+)[,)]", head.group(0))
    descs = re.findall(r"CUtensorMap (\w+)", head.group(0))
    assert params
    wait = body.index("cudaGridDependencySynchronize();")
    assert body.index("cudaTriggerProgrammaticLaunchCompletion();") < wait
    # at the body's top level (TileLang puts closed blocks before it: the TMA descriptors'
    # prefetch, which reads the kernel's parameters, not the tensors)
    assert body[:wait].count("{") == body[:wait].count("}"), "the wait must not be inside a branch"
    touches = [m.start() for _, name in params for m in re.finditer(rf"\b{name}\b", body)]
    touches += [m.start() for name in descs for m in re.finditer(rf"(?<!prefetch_tma_descriptor\(){name}\b", body)]
    assert wait < min(touches), body[min(touches) - 200:min(touches) + 100]
    base = {k: v for k, v in variant.items() if k != "pdl"}
    base["name"] = variant["name"].removesuffix("_pdl")
    src0 = P.build(base, "sm_90a").get_kernel_source()
    assert "cudaGridDependencySynchronize" not in src0 and "cudaTriggerProgrammatic" not in src0


def test_cp_pdl_switch_names_the_cp_passes(monkeypatch):
    """CP_PDL decides the form of the CP passes that kernel_variants lists (the maps pass, the
    scan, the warmup finder; precompile and Docker builds compile what the launches ask for);
    stage 1 and the output pass are plain launches either way; each form keeps its own name."""
    for on in (False, True):
        monkeypatch.setattr(P, "CP_PDL", on)
        for v in P.kernel_variants(8, 2):
            cp_pass = v["op"] in ("prefill_cp_scan", "prefill_cp_warmup") or v.get("mode") == "maps"
            assert v.get("pdl", False) == (on and cp_pass) and v["name"].endswith("_pdl") == (on and cp_pass), v
    assert P.scan_variant(8, pdl=False)["name"] == "gdn_prefill_cp_scan_hv8"
    assert P.warmup_variant(8, pdl=True)["name"] == "gdn_prefill_cp_warmup_hv8_pdl"


@pytest.mark.parametrize("name", ["QLA_SERVE_GATE_WARMUP", "QLA_SERVE_PREFILL_PERSISTENT"])
def test_on_off_switches_from_env(monkeypatch, name):
    """QLA_SERVE_GATE_WARMUP, QLA_SERVE_PREFILL_PERSISTENT: on unless set to 0; anything but 0/1
    is refused by name."""
    monkeypatch.delenv(name, raising=False)
    assert P._switch_from_env(name) is True
    monkeypatch.setenv(name, "0")
    assert P._switch_from_env(name) is False
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name}: expected 0 or 1"):
        P._switch_from_env(name)


@pytest.mark.parametrize("variant", P.kernel_variants(24, 8), ids=lambda v: v["name"])
def test_compiles_sm90a_full_matrix(variant):
    P.build(variant, "sm_90a")


def _blackwell_prefill_variants():
    from qla_serve.kernels import blackwell
    return [v for v in blackwell.kernel_variants(24, 8) if v["op"].startswith("prefill")]


@pytest.mark.parametrize("variant", _blackwell_prefill_variants(), ids=lambda v: v["name"])
def test_compiles_sm100a_full_matrix(variant):
    """Blackwell: every prefill variant its module lists (prep form uw, v8 at every split and
    mode, the CP scan and finder), the same tile programs lowered for sm_100a without Hopper's
    wgmma (mma.sync + TMA); never run on Blackwell hardware."""
    from qla_serve.kernels import blackwell

    kern = blackwell.build(variant, "sm_100a")
    assert "wgmma" not in kern.get_kernel_source(), variant["name"]


def test_bad_target_rejected():
    with pytest.raises(ValueError, match="target"):
        P.build(P.prep_variant(8, 2, "bfloat16"), "sm_80")
