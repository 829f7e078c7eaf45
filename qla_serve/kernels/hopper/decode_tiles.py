"""Decode and verify tiles (decode.py's kernels): the tile grammar (:func:`parse_tile`), the
per-pool-dtype choices measured on the H200 by rows = sequences x v-heads (DECODE_TILES,
AFTER_CONV_TILES, VERIFY_TILES; benchmarks/decode.md), the cards whose decode tiles were measured
apart (CARD_DECODE_TILES: the H100) and the pick per call (:func:`decode_tile`);
STATE_IO_SOURCE, the CUDA helpers behind the tiles' cache hints.
"""

from typing import NamedTuple

from .common import HEAD_DIM

_LANES = 8            # lanes per state row unless the tile names another count ("l16", "l32")
_WARPS = 4
_MAX_STATE_REGS = 64  # state values per thread (R rows x 128 / L columns)


class Tile(NamedTuple):
    """A decode / verify tile (:func:`parse_tile`)."""
    rows: int          # state rows per block
    warps: int         # warps per block
    qk_smem: bool      # q/k staged in shared memory instead of registers
    min_blocks: int    # min-blocks-per-SM hint (0: none)
    lanes: int         # lanes per state row
    load_hint: str     # cache hint of the state's loads: "" (none), "cg", "cs" or "lu"
    store_hint: str    # ... and of its stores: "" (none), "cg" or "cs"
    pipe_tiles: int = 1   # decode: row tiles a block walks, the next ones' state by cp.async ("-p<T>")
    pipe_stages: int = 0  # ... through a ring of this many tiles in shared memory (0: no ring)
    early: bool = False   # decode: the gates before the slot id, v preloaded after the state ("-e")
    out_smem: bool = False  # decode: the block's outputs gathered in shared memory, one coalesced store ("-o")


def parse_tile(tile: str) -> Tile:
    """Tile spec "bv<rows>[w<warps>][l<lanes>][s][-mb<n>][-cg|-cs][-l<hint>][-s<hint>][-p<T>[s<S>]][-e][-o]".

    A warp covers 32 / lanes rows at a time; each thread holds R = rows * lanes / (32 * warps)
    rows (a power of two) x 128 / lanes columns of the state, at most 64 values. The cache hints
    are CUDA's load / store qualifiers on the state's vectors: "-cs" (streaming, evict first) or
    "-cg" (L2 only) for both, or "-l<cg|cs|lu>" and "-s<cg|cs>" apart. E.g. "bv32s-mb8", "bv8w1"
    (one warp, 8 rows: 16 blocks per head), "bv16l32" (a warp per row), "bv32l16-cs", "bv8w1l16-cs"
    (one warp, 8 rows of 16 lanes), "bv4w1l32" (one warp, 4 rows of 32 lanes: 32 blocks per head).
    "-p<T>[s<S>]" (decode only): a block walks T consecutive tiles of rows of its head (T divides
    128 / rows), each tile's state copied by cp.async into an S-deep ring in shared memory (S
    defaults to 2, at most T) S - 1 tiles ahead of the one it updates, so a block keeps state
    loads in flight while it computes and stores; the load hint does not apply to those copies.
    "-e" (decode only, not after the conv): the gates computed before the slot id's load and each
    thread's v values loaded into registers right after its state loads are issued, instead of
    after the q/k norms and once per row between the row's two reductions (FlashInfer's order;
    benchmarks/decode.md, "FlashInfer's fp32 edge").
    "-o" (decode only): each row's output goes to shared memory instead of a 2-byte global store
    from the row's first lane; after a block barrier the block's first threads store its rows'
    outputs as one contiguous run (FlashInfer gathers a CTA's 16 outputs the same way)."""
    import re
    m = re.fullmatch(r"bv(4|8|16|32|64)(?:w([124]))?(?:l(8|16|32))?(s?)(?:-mb(\d+))?"
                     r"(?:-(cg|cs)|(?:-l(cg|cs|lu))?(?:-s(cg|cs))?)(?:-p([248])(?:s([234]))?)?(-e)?(-o)?", str(tile))
    ok = bool(m)
    if ok:
        rows, warps, lanes = int(m.group(1)), int(m.group(2) or _WARPS), int(m.group(3) or _LANES)
        per_thread, rem = divmod(rows * lanes, 32 * warps)
        ok = not rem and per_thread in (1, 2, 4, 8, 16) and per_thread * HEAD_DIM // lanes <= _MAX_STATE_REGS
        pipe_tiles = int(m.group(9) or 1)
        pipe_stages = min(int(m.group(10) or 2), pipe_tiles) if m.group(9) else 0
        ok = ok and (HEAD_DIM // rows) % pipe_tiles == 0 and not (m.group(10) and pipe_stages < int(m.group(10)))
    if not ok:
        raise ValueError(f"variant tile: expected 'bv<4|8|16|32|64>[w<1|2|4>][l<8|16|32>][s][-mb<n>]"
                         f"[-cg|-cs|-l<cg|cs|lu>-s<cg|cs>][-p<2|4|8>[s<2|3|4>]][-e][-o]' whose threads each hold "
                         f"1, 2, 4, ... whole rows and at most {_MAX_STATE_REGS} state values (rows * lanes "
                         f"/ (32 * warps) rows of 128 / lanes), p tiles dividing 128 / rows, s stages <= p; "
                         f"got {tile!r}")
    return Tile(rows, warps, m.group(4) == "s", int(m.group(5) or 0), lanes,
                m.group(6) or m.group(7) or "", m.group(6) or m.group(8) or "", pipe_tiles, pipe_stages,
                bool(m.group(11)), bool(m.group(12)))


# The state's cache-hinted loads and stores (the tile's hints): CUDA's __ld<hint> / __st<hint> on
# 16-byte vectors (8-byte for bf16 at 32 lanes per row), the bf16 forms converting to and from
# the fp32 registers (round to nearest even, as the plain casts). fp32 states take the plain
# overloads, bf16 ones the templates (N values per vector).
STATE_IO_SOURCE = r"""
#include <cuda_bf16.h>
#define QLA_STATE_LD(H)                                                                        \
__device__ __forceinline__ void qla_ld_state_##H(float* d, const float* s) {                    \
  float4 v = __ld##H((const float4*)s); d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w;        \
}                                                                                              \
template <int N> __device__ __forceinline__ void qla_ld_state_##H(float* d, const void* s) {   \
  __nv_bfloat162 h[N / 2];                                                                     \
  if constexpr (N == 8) *(uint4*)h = __ld##H((const uint4*)s);                                 \
  else *(uint2*)h = __ld##H((const uint2*)s);                                                  \
  _Pragma("unroll") for (int i = 0; i < N / 2; ++i) {                                          \
    float2 f = __bfloat1622float2(h[i]); d[2 * i] = f.x; d[2 * i + 1] = f.y; }                 \
}
#define QLA_STATE_ST(H)                                                                        \
__device__ __forceinline__ void qla_st_state_##H(float* g, const float* s) {                    \
  __st##H((float4*)g, make_float4(s[0], s[1], s[2], s[3]));                                    \
}                                                                                              \
template <int N> __device__ __forceinline__ void qla_st_state_##H(void* g, const float* s) {   \
  __nv_bfloat162 h[N / 2];                                                                     \
  _Pragma("unroll") for (int i = 0; i < N / 2; ++i) h[i] = __floats2bfloat162_rn(s[2 * i], s[2 * i + 1]); \
  if constexpr (N == 8) __st##H((uint4*)g, *(uint4*)h);                                        \
  else __st##H((uint2*)g, *(uint2*)h);                                                         \
}
QLA_STATE_LD(cg)
QLA_STATE_LD(cs)
QLA_STATE_LD(lu)
QLA_STATE_ST(cg)
QLA_STATE_ST(cs)
"""


# Decode tiles by rows = sequences x v-heads (host metadata), per pool dtype: ((up to rows, tile),
# ..., (None, tile)), the first entry that holds. Measured on the H200 (benchmarks/decode.md,
# History of the runs, "Wider rows and streaming stores" (full write-up: `git show
# 460b141:benchmarks/decode.md`), 2026-12-03, beside FlashInfer 0.7.2 in one process): 16 lanes
# per state row (R rows x 8 columns per thread: fewer registers, more blocks per SM) and the
# state's loads and stores with the streaming hint (__ldcs / __stcs; the stores' hint is what
# counts). Kernel GPU us, old tile -> new (FlashInfer): bf16 2/8 B = 256 45.5 -> 38.8 (41.3),
# 16/32 B = 64 44.3 -> 37.8 (41.0), B = 256 159.0 -> 142.1 (148.8); fp32 2/8 B = 64 22.0 -> 20.7
# (20.9), B = 256 74.7 -> 72.7 (71.5), B = 1 2.8 -> 2.7 (3.6). A bf16 decode of a few sequences
# takes blocks of 16 rows: 2/8 B = 1 2.6 us, 16/32 B = 1 3.0 (FlashInfer 2.6 / 3.1). In the layer
# (layer_ab.py, one process): fp32 16/32 d256 (8192 rows) ran 302.6 us on bv16l16-cs against 297.5
# on bv32, so bv32 kept the largest fp32 batches then (d64, 2048 rows: 77.8 against 79.0).
# Above 2048 fp32 rows and 8192 bf16 rows, pipelined tiles (2026-12-04, benchmarks/decode.md
# History of the runs, "Pipelined tiles" (full write-up: `git show 460b141:benchmarks/decode.md`);
# three runs, kernel GPU us): fp32 bv8l32-cs-p8s3 (FlashInfer's layout, a warp
# per row, a block walking 8 tiles of 8 rows through a 3-deep cp.async ring): 16/32 B = 512
# 552 -> 542 (FlashInfer 529), B = 256 278 -> 273.5, 2/8 B = 512 143.7 -> 141.4, level at 2048
# rows; bf16 bv16l16-cs-p8s4: 16/32 B = 512 295-307 -> 279-281 (FlashInfer 292), level at 8192 rows.
DECODE_TILES = {
    "float32": ((2048, "bv16l16-cs"), (None, "bv8l32-cs-p8s3")),
    "bfloat16": ((128, "bv16l16-cs"), (8192, "bv32l16-cs"), (None, "bv16l16-cs-p8s4")),
}
# Cards whose standalone decode tiles were measured apart, by a substring of the CUDA device name
# (:func:`card_of`); every other card takes DECODE_TILES. The H100 entry was measured on the SXM
# card; the PCIe and NVL H100s take it by name, unmeasured. H100 80GB HBM3 (benchmarks/decode.md,
# "The H100's decode tiles", session 55: `bench decode` beside FlashInfer 0.7.2, two rounds,
# kernel GPU us): the pipelined fp32 tile that leads on the H200 trails bv16l16-cs there above
# 2048 rows (16/32 B = 512: 745.0 / 741.7 against 737.7 / 734.5), and FlashInfer's own structure
# (bv8l32-p2-e-o: 8-row tiles two to a block through a 2-stage ring, gates before the slot id, v
# in registers, outputs gathered, no cache hints) leads both from 4096 rows: 16/32 B = 512 735.7
# / 735.1 against 741.3 / 740.8 on bv16l16-cs (FlashInfer 740.9 / 743.6), B = 1024 1470.8 /
# 1466.1 against 1479.0 / 1479.5, 2/8 B = 1024 377.0 / 376.8 against 380.2 / 379.9; in the layer
# 16/32 d512 779 -> 769 us, 2/8 d1024 400 -> 393; below 4096 rows it trails bv16l16-cs by ~1%.
# The bf16 pipelined tile gains ~1% from gathering its 64 rows' outputs into one store (-o:
# 16/32 B = 512 378.7 -> 375.2, B = 1024 751.0 -> 745.7, 2/8 B = 2048 383.4 -> 380.5).
CARD_DECODE_TILES = {
    "H100": {
        "float32": ((2048, "bv16l16-cs"), (None, "bv8l32-p2-e-o")),
        "bfloat16": ((128, "bv16l16-cs"), (8192, "bv32l16-cs"), (None, "bv16l16-cs-p8s4-o")),
    },
}


# Every card key decode_tile takes: "" (DECODE_TILES) and the cards with tables of their own.
CARDS = ("", *CARD_DECODE_TILES)


def card_of(device_name: str) -> str:
    """The CARD_DECODE_TILES key of a CUDA device name ("NVIDIA H100 80GB HBM3" -> "H100"), or ""
    for the cards that take DECODE_TILES."""
    return next((card for card in CARD_DECODE_TILES if card in device_name), "")


# The layer's decode launched as the conv's programmatic dependent (after_conv; the layer runs it up
# to gdn_layer.DECODE_AFTER_CONV_MAX_ROWS = 256 rows): with bf16 states bv32l16-cs measured slower
# there than bv64 (2/8 d32, 256 rows: 9.8 against 9.3 us per layer call), the kernel alone not.
AFTER_CONV_TILES = {"bfloat16": ((128, "bv16l16-cs"), (None, "bv64"))}
# Verify and verify_slots tiles by rows = sequences x v-heads, both pool dtypes. Measured on the
# H200 (benchmarks/decode.md, "Verify tiles", 2026-12-03: benchmarks/verify_tiles.py, D = 2 and 4,
# 2/8 and 16/32 heads, ten tiles): from 128 rows one warp per block of 8 state rows of 16 lanes
# with streaming hints was the fastest or close to it (2/8, 16 requests x 4 drafts, bf16 states:
# 9.4 us against 12.1 on bv32 / 12.4 on bv64, the old defaults); up to 64 rows the decode's small
# tile, 0.1-0.3 us ahead of it (2/8 one request x 4 drafts, fp32: 5.3 against 5.5, bv32 6.2).
VERIFY_TILES = {pool: ((64, "bv16l16-cs"), (None, "bv8w1l16-cs")) for pool in ("float32", "bfloat16")}
# The most rows (sequences x v-heads) at which the engine layers launch each op as its conv's
# programmatic dependent (the after_conv form): backends/gdn_layer.DECODE_AFTER_CONV_MAX_ROWS and
# SPEC_AFTER_CONV_MAX_ROWS, backends/sglang/verify_layer.AFTER_CONV_MAX_ROWS, which stay within
# these (tests/kernels/test_decode_compile.py). kernel_variants lists the after_conv variants only
# in the tiles these rows reach.
AFTER_CONV_MAX_ROWS = {"decode": 256, "verify": 64, "verify_slots": 64}


def _tile_table(op: str, pool_dtype: str, after_conv: bool, card: str = "") -> tuple:
    if op != "decode":
        table = VERIFY_TILES
    elif after_conv and pool_dtype in AFTER_CONV_TILES:
        table = AFTER_CONV_TILES
    else:   # (the after_conv form reaches only the first entries, which the card tables keep)
        table = CARD_DECODE_TILES.get(card, DECODE_TILES)
    # (an unknown pool dtype gets a placeholder here; _check_variant names the argument)
    return table.get(pool_dtype, ((None, "bv32"),))


def decode_tile(pool_dtype: str, rows: int, after_conv: bool = False, op: str = "decode", card: str = "") -> str:
    """The op's tile for a call of ``rows`` = sequences x v-heads (host metadata) on ``card``
    (:func:`card_of`): the first entry of DECODE_TILES[pool_dtype] (CARD_DECODE_TILES[card]'s
    where it has one, AFTER_CONV_TILES for the after_conv form, VERIFY_TILES for verify /
    verify_slots) whose row bound holds."""
    for max_rows, tile in _tile_table(op, pool_dtype, after_conv, card):
        if max_rows is None or rows <= max_rows:
            return tile
    raise AssertionError(f"{op} tile table of {pool_dtype} has no open-ended last entry")


def decode_tiles(pool_dtype: str, after_conv: bool = False, op: str = "decode") -> list[str]:
    """Every tile :func:`decode_tile` can pick for this op, pool dtype and form on any card
    (precompile lists them all: a cache may be built away from the card that uses it); for the
    after_conv form, those of calls up to AFTER_CONV_MAX_ROWS[op] rows."""
    limit = AFTER_CONV_MAX_ROWS[op] if after_conv else None
    tiles = []
    for card in CARDS:
        for max_rows, tile in _tile_table(op, pool_dtype, after_conv, card):
            if tile not in tiles:
                tiles.append(tile)
            if max_rows is None or (limit is not None and limit <= max_rows):
                break
    return tiles


def default_tile(pool_dtype: str, op: str = "verify", num_v_heads: int = 1, after_conv: bool = False) -> str:
    """A variant's tile where none is named: the op's for one sequence
    (decode_tile(pool_dtype, num_v_heads, after_conv, op))."""
    return decode_tile(pool_dtype, num_v_heads, after_conv, op)
