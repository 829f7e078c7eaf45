"""GDN chunked prefill on Hopper (sm_90a): host side, the kernels.

Two TileLang kernels per call, four or five with CP (prefill_prep.py, prefill_main.py,
prefill_warmup.py, prefill_scan.py); one (prefill_fused.py) for plain plans with fp16 q/k where
the experimental FUSED switch is on:
  1. prep  grid (chunks, Hv / h):  everything state-free, fully parallel (h v-heads of one qk-head
                                   per CTA, prep_heads_per_cta): gate factors, the
                                   intra-chunk attention P, the gated inverse M (form "m", for
                                   V-first) or U0 = M V and Wk = M diag(exp(gc)) K (form "uw",
                                   for v8: PREP_FORM), and fp16 copies of bf16 q/k (once per
                                   qk-head)
  2. main  grid (v_split, Hv, N):  the sequential chunk walk (warp-specialised, two or three
                                   GEMMs per chunk on the chain) with the state in registers, pool slots
                                   read and written in place, every output row written.
                                   (MAIN_IMPL "vfirst", the default at v_split 1 and 2:
                                   prefill_main_vfirst.py, the same walk with the state
                                   transposed, every chain GEMM's A operand in registers, and
                                   V' = M (V - diag(exp gc) K S) formed from v and M.
                                   Plain and V-split plans of short sequences run it on a
                                   persistent grid of one CTA per SM, PERSISTENT:
                                   persistent_func.)
The HBM intermediates are the gate factors and P plus M (16.5 KB per chunk and v-head) or U0 and
Wk (40.5 KB), and the fp16 q/k copies (512 B per token and qk-head); V' and the per-chunk states
never leave the SM.

Strategies this module implements (the planner may only pick these): "plain" (v_split 1),
"vsplit" (v_split 2 or 4: the value dimension of each head split across CTAs; exact, same bits
for a sequence whatever else is in the batch) and "cp" (context parallelism over the plan's
segments of L chunks):
  2w. (plan.cp "auto" and GATE_WARMUP only) warmup finder (prefill_warmup.py, grid
      (num_cut, Hv)): per segment and head, the chunk its state walk may start from with a
      zero state (gate warmup: the history it drops is decayed by e^-10 or more), within
      max_warmup_chunks(L); -1 where the head's gates do not decay that fast (g = 0 heads):
      the exact path below. Found on the device from stage 1's gate factors, so the host never
      waits. plan.cp "exact": no warmup.
  2a. main "maps" grid (2 maps_v_split, Hv, G1) over every segment but a sequence's last: the
      state at the segment's end from its start (the pool's for the first segment, zero for the
      others) and the segment's transition Phi (the linear part: S_end = Phi S_start + B). Its
      split is plan.maps_v_split (the planner may make it 2 under a v_split 1 plan: the maps are
      whole 128-row tensors whatever the split, only the stage-1 form must match);
  2b. scan (prefill_scan.py, one launch, fp32): the true state at the end of every segment but
      the last, S_k = Phi_k S_{k-1} + B_k; V-first (X = S^T, as the pool stores it) that is
      X_k = X_{k-1} @ maps[k, 1] + maps[k, 0];
  2c. main "output" over all segments, in parallel, each starting from its true state (the
      exact path) or walking its warmup chunks first. A cut sequence's first segment starts
      from the maps pass's copy of its pool state: within one launch no item reads a pool slot
      that another item writes (the last segment writes it), whatever the block order.
With warmup, 2a and 2b skip the (sequence, head) pairs that no segment needs them for.
The algebra is reference.segmented_gdn's (the float64 oracle of the exact path) and
reference.warmup_gdn's (the gate warmup).

This module says what the kernels are: their variants and names (what `qla-serve precompile`
compiles), the module switches, the rules that pick a variant for a plan, and build, which
compiles a variant once per (heads, dtypes, v_split, mode) with an explicit target through
TileLang's disk cache (TILELANG_CACHE_DIR) and keeps it in an in-process dict.
prefill_launch.py runs them: `prefill`, the launches resolved once per plan.
"""

import collections
import itertools
import os
import threading

from . import prefill_fused, prefill_main, prefill_main_vfirst, prefill_prep, prefill_scan, prefill_warmup

ARCH = "sm_90a"
CHUNK = 64
SUPPORTED_STRATEGIES = frozenset({"plain", "vsplit", "cp"})
V_SPLITS = prefill_main.V_SPLITS  # (1, 2, 4)
MAIN_MODES = prefill_main.MODES  # ("output", "maps")
IO_DTYPES = ("bfloat16", "float16")
# (q/k dtype, v dtype) pairs a call may bring: one dtype, or fp16 q/k beside bf16 v (what
# gdn_prefill_inputs(..., qk_dtype=torch.float16) makes of a bf16 model's q/k: stage 2's
# operands are fp16, so stage 1 then writes no fp16 copies).
QK_V_DTYPES = (("bfloat16", "bfloat16"), ("float16", "float16"), ("float16", "bfloat16"))
POOL_DTYPES = ("float32", "bfloat16")


def _switch_from_env(name: str, default: str = "1") -> bool:
    """An on/off module switch from environment variable `name`: "1" or "0" (unset: default)."""
    flag = os.environ.get(name, default).strip()
    if flag not in ("0", "1"):
        raise ValueError(f"{name}: expected 0 or 1, got {flag!r}")
    return flag == "1"


# Gate warmup (prefill_warmup.py) for cut segments under cp="auto": on by default (validated on
# the H200: test_cp_warmup, the sanitizer case). QLA_SERVE_GATE_WARMUP=0 makes cp="auto" take
# the exact path like cp="exact". Read once at import; the GPU tests and
# `qla-serve bench prefill --gate-warmup on|off` set this flag instead.
GATE_WARMUP = _switch_from_env("QLA_SERVE_GATE_WARMUP")

# Which stage-2 kernel runs at v_split 1 and 2: "vfirst" (prefill_main_vfirst.py, the default:
# faster on every H200 bench row it applies to, benchmarks/prefill.md v9) or "v8"
# (prefill_main.py). v_split 4 and sm_100a always run v8. Read once at import from
# QLA_SERVE_PREFILL_MAIN; the GPU tests and `qla-serve bench prefill --main` set it instead.
MAIN_IMPLS = ("v8", "vfirst")
# The stage-1 outputs each stage-2 kernel reads (prefill_prep.prep_func's forms): v8 takes
# U0 and -Wk, V-first takes M and forms V' = M (V - diag(exp(gc)) K S) on its chain.
PREP_FORM = {"v8": "uw", "vfirst": "m"}


def _main_impl_from_env() -> str:
    impl = os.environ.get("QLA_SERVE_PREFILL_MAIN", "vfirst").strip().lower()
    if impl not in MAIN_IMPLS:
        raise ValueError(f"QLA_SERVE_PREFILL_MAIN: expected one of {MAIN_IMPLS}, got {impl!r}")
    return impl


MAIN_IMPL = _main_impl_from_env()

# Stage 1's v-heads per CTA (prefill_prep.prep_func's heads_per_cta, form "m" only): Q K^T, K K^T
# and the q/k tiles are the qk-head's, shared by its Hv / Hk v-heads, so a CTA of several heads
# loads and multiplies them once. 0: the rule in prep_heads_per_cta; 1, 2 or 4: that many where it
# divides Hv / Hk (else the largest that does). Read once at import from QLA_SERVE_PREP_HEADS;
# the GPU tests and benchmarks set it instead.
PREP_HEADS_CHOICES = (1, 2, 4)
# The rule's figures: stage 1's GPU us for a call as a line in its chunk-heads per SM x, a + b x,
# per heads per CTA (least squares over 2/8, 4/16 and 16/64 at 128-512 chunks, x 7.8-248; the
# largest residual 17 us at x 248, 4 us below 100), measured with the pair solve (PREP_PAIR) on
# stage 1 v33 (P and M packed) on an H100 (session 65; benchmarks/prefill.md, "Stage 1's pair
# solve"): four heads lead from ~7 chunk-heads per SM, two below. Before the lines, the fewest
# heads whose grid is a single wave (the call then takes one CTA's latency, shorter with fewer
# heads: at 2/8 x 128 chunks, one wave of two-head CTAs, two heads measured 5% faster in stage
# 1 and ~1% in the call than four, where the lines alone take four). The H200 fit of session
# 58 (v31/v32, no pair) had two heads lead up to ~95; on the H100 without the pair the crossover
# was already ~28. Refit: benchmarks/fit_prep_heads.py data/prep_heads_pair_h100.jsonl.
_PREP_COST_US = {1: (8.7, 1.32), 2: (5.4, 1.19), 4: (6.6, 1.02)}


def _prep_heads_from_env() -> int:
    flag = os.environ.get("QLA_SERVE_PREP_HEADS", "0").strip()
    if flag not in ("0",) + tuple(str(n) for n in PREP_HEADS_CHOICES):
        raise ValueError(f"QLA_SERVE_PREP_HEADS: expected 0 (auto) or one of {PREP_HEADS_CHOICES}, got {flag!r}")
    return int(flag)


PREP_HEADS = _prep_heads_from_env()

# How stage 1 (form "m") solves for A diag(beta): "mma" (the default: the block substitution on
# mma.sync, csrc/block_solve.cuh; on an H100 stage 1 8-26% and the layer 1.7-5% faster than
# "wgmma" on every row measured, benchmarks/prefill.md) or "wgmma" (three 64x64 products through
# shared memory, form "uw"'s only solve; form "m"'s variants of it are named "_wgmma"). Read once
# at import from QLA_SERVE_PREP_SOLVE; the GPU tests and `bench prefill --impls qla16_wgmma` set
# it instead.
PREP_SOLVES = prefill_prep.SOLVES
PREP_SOLVE_DEFAULT = prefill_prep.DEFAULT_SOLVE["m"]


def _prep_solve_from_env() -> str:
    solve = os.environ.get("QLA_SERVE_PREP_SOLVE", PREP_SOLVE_DEFAULT).strip().lower()
    if solve not in prefill_prep.SOLVES:
        raise ValueError(f"QLA_SERVE_PREP_SOLVE: expected one of {prefill_prep.SOLVES}, got {solve!r}")
    return solve


PREP_SOLVE = _prep_solve_from_env()

# The context-parallel passes (warmup finder, maps pass, scan) as programmatic dependent
# launches: each first lets the next launch start (griddepcontrol.launch_dependents) and then
# waits for the grid before it to complete with its writes visible (griddepcontrol.wait), so its
# launch and set-up overlap the tail of the kernel before instead of following it. Every thread
# of every block waits before it touches memory, so none of them completes before the grid it
# follows: stream order holds. Variants get the key "pdl" (names end in "_pdl"). H200, layer per
# call (benchmarks/layer.md): 2/8 1 x 32768 287.6 -> 285.5 us, mixed 99.3 -> 97.2, 4 x 8192 255.6
# -> 254.2. Stage 1 and the output pass stay plain launches: chained too, 2/8 16 x 512 went 65.4 ->
# 70.0 and 4/16 16 x 512 123.4 -> 133.0 (each alone: level or slower), and TileLang drops
# __restrict__ from a chained kernel's pointers.
CP_PDL = True


# Plain and V-split plans' V-first stage 2 on a persistent grid (prefill_main_vfirst.persistent_func:
# one CTA per SM walks (sequence, head) units in turn, longest sequences first), instead of a CTA
# per unit, where the batch's sequences average at most PERSISTENT_MAX_MEAN_CHUNKS chunks: the
# units' own set-up then weighs most. H200, fp16 q/k, one process (benchmarks/prefill.md):
# 2/8 64x512 0.158 -> 0.153 ms, 16/64 64x512 1.073 -> 1.058; 16 and 32 chunks per sequence level
# or slower (16/64 1024x8 0.271 -> 0.278). Read once at import from QLA_SERVE_PREFILL_PERSISTENT;
# tests and benchmarks set it.
PERSISTENT = _switch_from_env("QLA_SERVE_PREFILL_PERSISTENT")
PERSISTENT_MAX_MEAN_CHUNKS = 8
# The persistent grid deals the units (longest sequences first) to its CTAs in turn, statically:
# on a ragged batch the CTA that takes the longest unit also takes one of each later round, where
# a CTA per unit lets the hardware fill in around it. So the persistent grid also needs the
# static dealing's longest CTA walk to stay within what a CTA per unit takes at best (the longest
# unit, or the rounds of units a CTA takes at their average length) plus what it saves per unit,
# PERSISTENT_UNIT_SAVING chunk walks (H200, 2/8 64x512: 5.7 us over 3.9 units per CTA at ~1.9 us
# per chunk). H200, fp16 q/k, one process (benchmarks/prefill.md, "Stage 2's persistent grid on
# ragged batches"): mixed8192 2/8 0.0866 ms persistent against 0.0764 per unit, 4/16 0.1314 /
# 0.1165, 8/24 0.1724 / 0.1617 (this rule: per unit), 16/64 0.3173 / 0.3310 (this rule:
# persistent).
PERSISTENT_UNIT_SAVING = 0.8

# Stage 1 with two or four heads per CTA solves two heads at once (prefill_prep's pair_solve:
# the two diagonal-block substitutions side by side, then warps 0-1 one head's block solve and
# 2-3 the other's) instead of one after the other with most warps idle: the same operations per
# head, so the same bits. Session 65, H100, stage 1 GPU ms one head at a time / pair: four heads
# 16/64 4x8192 0.264 -> 0.250, 2048x4 0.082 -> 0.072, 4/16 1024x8 0.0200 -> 0.0183, 2/8 64x512
# 0.0436 -> 0.0400; two heads 2/8 and 4/16 rows -2..-8%, 16/64 rows +1..+4% (where the rule now
# takes four). Read once at import from QLA_SERVE_PREP_PAIR ("0" turns it off).
PREP_PAIR = _switch_from_env("QLA_SERVE_PREP_PAIR")

# The one-launch prefill (prefill_fused.py, v36: stage 1's solve as a fourth warpgroup of the
# V-first chain's CTA, M / P / the gate factors through shared memory, not HBM) for the plans it
# applies to (fused_applies). Experimental, off by default. H100, session 69 (benchmarks/prefill.md,
# "v36"): correct (float64 GPU tests, racecheck); against the two stages 16/64 4x8192 0.888 /
# 0.849 ms, 2048x4 0.238 / 0.255, 64x512 1.081 / 1.052, 2/8 64x512 0.141 / 0.147 (its solve
# warpgroup sets the pace). On by default only once the H200 shows it ahead. Read once at
# import from QLA_SERVE_PREFILL_FUSED ("1" turns it on); tests set it.
FUSED = _switch_from_env("QLA_SERVE_PREFILL_FUSED", "0")
# The one-launch prefill's two consumer warpgroups take turns to issue their wgmma (ping-pong,
# prefill_fused.fused_func's pingpong; variants named "_pp"). H100: 1-6% faster than without on
# the seven plain rows measured (16/64 4x8192 0.857 / 0.888 ms). Off with FUSED. Read once at
# import from QLA_SERVE_PREFILL_FUSED_PINGPONG ("1" turns it on).
FUSED_PINGPONG = _switch_from_env("QLA_SERVE_PREFILL_FUSED_PINGPONG", "0")

_kernels: dict = {}
_lock = threading.Lock()


def _variant_name(v: dict) -> str:
    if v["op"] == "prefill_fused":
        return (f"gdn_prefill_fused_hv{v['num_v_heads']}_hk{v['num_k_heads']}_{v['io_dtype']}_pool{v['pool_dtype']}"
                + ("_pp" if v.get("pingpong") else ""))
    if v["op"] == "prefill_prep":
        return (f"gdn_prefill_prep_hv{v['num_v_heads']}_hk{v['num_k_heads']}_{v['io_dtype']}"
                + ("_m" if v.get("form", "uw") == "m" else "")
                + (f"_qk{v['qk_dtype']}" if "qk_dtype" in v else "")
                + (f"_heads{v['heads_per_cta']}" if "heads_per_cta" in v else "")
                + (f"_{v['solve']}" if "solve" in v else "")  # form "m" on the wgmma solve
                + ("_pm" if v.get("packed") else "") + ("_pair" if v.get("pair_solve") else ""))
    pdl = "_pdl" if v.get("pdl", False) else ""
    return (
        f"gdn_prefill_main_hv{v['num_v_heads']}_hk{v['num_k_heads']}_{v['io_dtype']}"
        f"_pool{v['pool_dtype']}_vs{v['v_split']}" + ("_maps" if v["mode"] == "maps" else "")
        + ("_vfirst" if v.get("impl", "v8") == "vfirst" else "") + pdl
        + ("_persistent" if v.get("persistent") else "") + ("_pm" if v.get("packed") else "")
    )


def _chain(v: dict, pdl: bool) -> dict:
    """Marks v a programmatic dependent launch (CP_PDL); plain variants keep their names (and
    compile caches)."""
    if pdl:
        v["pdl"] = True
    return v


def prep_variant(num_v_heads: int, num_k_heads: int, io_dtype: str, form: str = "uw",
                 qk_dtype: str | None = None, heads_per_cta: int = 1, solve: str | None = None,
                 packed: bool = False, pair_solve: bool = False) -> dict:
    """Stage 1; form "uw" (U0 and -Wk, for the v8 stage 2) or "m" (M, for V-first): the form
    a stage-2 kernel reads is PREP_FORM[impl]. io_dtype is v's; qk_dtype q/k's (None: v's);
    heads_per_cta the v-heads of one CTA (form "m": a divisor of Hv / Hk); solve form "m"'s
    (prefill_prep.SOLVES; None: PREP_SOLVE; form "uw" has only "wgmma"); packed (form "m"):
    P^T and M in one tile (packed_tiles)."""
    if form not in prefill_prep.FORMS:
        raise ValueError(f"form: expected one of {prefill_prep.FORMS}, got {form!r}")
    if packed and form != "m":
        raise ValueError(f"packed: form 'm' only, got form {form!r}")
    solve = _prep_solve(form, solve)
    qk_dtype = qk_dtype or io_dtype
    if (qk_dtype, io_dtype) not in QK_V_DTYPES:
        raise ValueError(f"q/k dtype {qk_dtype} with v dtype {io_dtype}: expected one of {QK_V_DTYPES}")
    v = {"op": "prefill_prep", "num_v_heads": num_v_heads, "num_k_heads": num_k_heads, "io_dtype": io_dtype}
    if form != "uw":  # "uw" variants keep their names
        v["form"] = form
    if qk_dtype != io_dtype:  # one-dtype variants keep their names (and compile caches)
        v["qk_dtype"] = qk_dtype
    if heads_per_cta != 1:
        group = num_v_heads // max(num_k_heads, 1)
        if form != "m" or heads_per_cta not in PREP_HEADS_CHOICES or group % heads_per_cta:
            raise ValueError(f"heads_per_cta: {heads_per_cta} v-heads per CTA needs form 'm' and must be one of "
                             f"{PREP_HEADS_CHOICES} dividing Hv / Hk = {group} (form {form!r})")
        v["heads_per_cta"] = heads_per_cta
    if solve != prefill_prep.DEFAULT_SOLVE[form]:  # the default solve's variants carry no suffix
        v["solve"] = solve
    if packed:
        v["packed"] = True
    if pair_solve:
        if not prefill_prep.pair_solve_fits(form, solve, heads_per_cta):
            raise ValueError("pair_solve: form 'm' on the mma solve with two or four heads per CTA only")
        v["pair_solve"] = True
    v["name"] = _variant_name(v)
    return v


def _prep_solve(form: str, solve: str | None) -> str:
    """The solve a form "m" / "uw" prep variant runs: solve, or PREP_SOLVE for form "m" (form
    "uw" has only "wgmma"); refused by name otherwise (prefill_prep.resolve_solve)."""
    return prefill_prep.resolve_solve(form, PREP_SOLVE if solve is None and form == "m" else solve)


def prep_heads_per_cta(num_v_heads: int, num_k_heads: int, num_chunks: int, form: str, sm_count: int) -> int:
    """Stage 1's v-heads per CTA for a call of num_chunks chunks (form "m"; "uw" always 1):
    PREP_HEADS where set (the largest choice dividing Hv / Hk that is not above it); else the
    fewest heads whose CTAs all fit one wave (at the CTAs per SM their resources allow,
    prefill_prep.resident_ctas_per_sm: the call then takes one CTA's latency, shorter with fewer
    heads), and otherwise the choice of least expected time by _PREP_COST_US. Ties go to more
    heads."""
    if form != "m":
        return 1
    group = num_v_heads // num_k_heads
    choices = [n for n in PREP_HEADS_CHOICES if group % n == 0]
    if PREP_HEADS:
        return max(n for n in choices if n <= PREP_HEADS)
    chunk_heads = num_chunks * num_v_heads
    for n in choices:
        resident = prefill_prep.resident_ctas_per_sm(form, n, _pair_solve(form, _prep_solve(form, None), n))
        if chunk_heads <= n * resident * sm_count:
            return n
    per_sm = chunk_heads / sm_count

    def cost(n):
        a, b = _PREP_COST_US[n]
        return a + b * per_sm

    return min(reversed(choices), key=cost)


def plan_chunks(plan) -> int:
    """The plan's 64-token chunks: ceil(len / CHUNK) summed over its sequences (host metadata)."""
    return sum((int(L) + CHUNK - 1) // CHUNK for L in plan.seq_lens)


def _pair_solve(form: str, solve: str, heads_per_cta: int) -> bool:
    """Whether stage 1 solves its heads two at a time (PREP_PAIR, the mma solve, >= 2 heads)."""
    return PREP_PAIR and prefill_prep.pair_solve_fits(form, solve, heads_per_cta)


def plan_prep_heads(plan, num_v_heads: int, num_k_heads: int, form: str) -> int:
    """Stage 1's v-heads per CTA in a call of this plan (prep_heads_per_cta on its chunks and
    the planner's SMs): what prefill_launch launches and what bench prefill records."""
    return prep_heads_per_cta(num_v_heads, num_k_heads, plan_chunks(plan), form, plan.sm_count)


def plan_prep_variant(plan, num_v_heads: int, num_k_heads: int, io_dtype: str, form: str, qk_dtype: str,
                      packed: bool) -> dict:
    """The stage-1 variant a call of this plan launches: plan_prep_heads' heads per CTA, the
    solve by PREP_SOLVE, two heads at once where _pair_solve allows."""
    heads = plan_prep_heads(plan, num_v_heads, num_k_heads, form)
    solve = _prep_solve(form, None)
    return prep_variant(num_v_heads, num_k_heads, io_dtype, form, qk_dtype, heads, solve, packed,
                        _pair_solve(form, solve, heads))


def main_variant(num_v_heads: int, num_k_heads: int, io_dtype: str, pool_dtype: str, v_split: int,
                 mode: str = "output", impl: str = "v8", pdl: bool | None = None, packed: bool = False) -> dict:
    """Stage 2; impl "vfirst" is prefill_main_vfirst.py (v_split 1 and 2), "v8" prefill_main.py;
    pdl: a programmatic dependent launch (None: CP_PDL for the maps pass, plain for the output
    pass); packed (V-first output mode): it reads stage 1's packed tile (packed_tiles)."""
    if impl not in MAIN_IMPLS:
        raise ValueError(f"impl: expected one of {MAIN_IMPLS}, got {impl!r}")
    if packed and (impl != "vfirst" or mode != "output"):
        raise ValueError(f"packed: the V-first output mode only, got impl {impl!r}, mode {mode!r}")
    v = {
        "op": "prefill_main",
        "num_v_heads": num_v_heads,
        "num_k_heads": num_k_heads,
        "io_dtype": io_dtype,
        "pool_dtype": pool_dtype,
        "v_split": v_split,
        "mode": mode,
    }
    if impl != "v8":  # v8 variants keep their names (and compile caches)
        v["impl"] = impl
    if packed:
        v["packed"] = True
    v["name"] = _variant_name(_chain(v, (CP_PDL and mode == "maps") if pdl is None else pdl))
    return v


def packed_tiles(strategy: str, impl: str, v_split: int) -> bool:
    """Whether a plan's stage 1 packs P^T and M into one tile (prefill_prep's packed form "m")
    for its stage 2 to unpack: V-first plans without a cut at v_split 1 (a CTA per unit or the
    persistent grid). A chunk and head then cross HBM as 8 KB instead of 16 (H100, packed
    against apart: 16/64 4 x 8192 -6%, 2048 x 4 -6%, 8 x 1024 -4%, 4/16 8 x 1024 -6%, 2/8
    64 x 512 -5% per call). Apart elsewhere: the context-parallel maps pass reads M alone, so
    packing saves it nothing and the unpack only adds latency (2/8 1 x 8192 +6% packed), and at
    v_split 2 each of a head's two CTAs unpacks the same tile for half the chain's work, stage 2
    7-10% slower (4/16 4 x 8192 +3.7%, 2048 x 4 +1.5% per call; benchmarks/prefill.md, "P and M
    packed")."""
    return impl == "vfirst" and strategy != "cp" and v_split == 1


def persistent_variant(num_v_heads: int, num_k_heads: int, io_dtype: str, pool_dtype: str, v_split: int,
                       packed: bool) -> dict:
    """The V-first stage 2 of plain and V-split plans on a persistent grid (output mode); packed:
    it reads stage 1's packed tile (packed_tiles)."""
    v = main_variant(num_v_heads, num_k_heads, io_dtype, pool_dtype, v_split, "output", "vfirst", False, packed)
    v["persistent"] = True
    v["name"] = _variant_name(v)
    return v


def persistent_applies(strategy: str, impl: str, seq_lens=None, units_per_seq: int | None = None,
                       sm_count: int | None = None) -> bool:
    """Whether a plan's stage 2 runs on the persistent grid: PERSISTENT, no cut, V-first, and
    (given the plan's sequence lengths, with units_per_seq = Hv x v_split units of each and the
    GPU's SMs, which the lengths need) at most PERSISTENT_MAX_MEAN_CHUNKS chunks per sequence on
    average, dealt evenly enough (static_dealing_chunks; PERSISTENT_UNIT_SAVING)."""
    if not (PERSISTENT and strategy != "cp" and impl == "vfirst"):
        return False
    if seq_lens is None:  # the variant lists: every plan may take it
        return True
    if units_per_seq is None or sm_count is None:
        raise ValueError("persistent_applies: seq_lens needs units_per_seq and sm_count")
    runs = sorted(collections.Counter((int(n) + CHUNK - 1) // CHUNK for n in seq_lens).items(), reverse=True)
    nseq = len(seq_lens)
    total = sum(c * r for c, r in runs)
    if not runs or total > PERSISTENT_MAX_MEAN_CHUNKS * nseq:
        return False
    nunits = nseq * units_per_seq
    ncta = max(1, min(nunits, sm_count))
    # what a CTA per unit takes at best: the longest unit, or whole rounds of average units
    dispatch = max(runs[0][0], -(-nunits // ncta) * total / nseq)
    saving = PERSISTENT_UNIT_SAVING * nunits / ncta
    return static_dealing_chunks(runs, units_per_seq, ncta) <= dispatch + saving


def static_dealing_chunks(runs, units_per_seq: int, ncta: int) -> int:
    """The longest CTA walk, in chunks, of the persistent grid's dealing: sequences longest first
    (as _persistent_grid orders them), given as runs (chunks, sequences of that many chunks) in
    that order, each sequence units_per_seq consecutive units, unit u to CTA u % ncta. A run's
    units are one contiguous block of equal walks: every CTA gets the block's length // ncta of
    them and one more goes to a cyclic range of the rest (a difference array), so the cost is
    O(distinct chunk counts + ncta)."""
    diff = [0] * (ncta + 1)
    base = start = 0
    for c, r in runs:
        whole, part = divmod(r * units_per_seq, ncta)
        base += c * whole
        end = start + part
        diff[start] += c
        if end <= ncta:
            diff[end] -= c
        else:  # the range wraps around past the last CTA
            diff[ncta] -= c
            diff[0] += c
            diff[end - ncta] -= c
        start = end % ncta
    return base + max(itertools.accumulate(diff[:ncta]))


def fused_variant(num_v_heads: int, num_k_heads: int, io_dtype: str, pool_dtype: str,
                  pingpong: bool | None = None) -> dict:
    """The one-launch prefill (prefill_fused.py) for v's dtype and the pool's; q / k are fp16.
    pingpong: its consumers take turns to issue their wgmma (None: FUSED_PINGPONG)."""
    v = {"op": "prefill_fused", "num_v_heads": num_v_heads, "num_k_heads": num_k_heads, "io_dtype": io_dtype,
         "pool_dtype": pool_dtype}
    if FUSED_PINGPONG if pingpong is None else pingpong:
        v["pingpong"] = True
    v["name"] = _variant_name(v)
    return v


def fused_applies(strategy: str, v_split: int, qk_dtype: str, target: str = ARCH) -> bool:
    """Whether a plan's call runs the one-launch prefill: FUSED, sm_90a, whole sequences at
    v_split 1 (a plain plan: the fused CTA owns all 128 value rows of its head) and fp16 q / k
    (the layer's form; bf16 q / k need stage 1's fp16 copies, so they keep the two stages)."""
    return FUSED and target == "sm_90a" and strategy == "plain" and v_split == 1 and qk_dtype == "float16"


def main_impl_for(v_split: int, target: str = ARCH) -> str:
    """The stage-2 kernel a plan with this v_split runs: MAIN_IMPL where it applies (vfirst:
    v_split 1 and 2 on sm_90a), else v8."""
    if MAIN_IMPL == "vfirst" and target == "sm_90a" and v_split in prefill_main_vfirst.V_SPLITS:
        return "vfirst"
    return "v8"


def scan_variant(num_v_heads: int, rows: int = 0, pdl: bool | None = None) -> dict:
    """The CP scan; rows (of X per block) 0 = chosen on the device per launch, 2/4/8 forced (for
    benchmarks only); pdl: a programmatic dependent launch (None: CP_PDL), as the finder's."""
    v = _chain({"op": "prefill_cp_scan", "num_v_heads": num_v_heads}, CP_PDL if pdl is None else pdl)
    if rows:
        v["rows"] = rows
    v["name"] = (f"gdn_prefill_cp_scan_hv{num_v_heads}" + (f"_rows{rows}" if rows else "")
                 + ("_pdl" if "pdl" in v else ""))
    return v


def warmup_variant(num_v_heads: int, pdl: bool | None = None) -> dict:
    v = _chain({"op": "prefill_cp_warmup", "num_v_heads": num_v_heads}, CP_PDL if pdl is None else pdl)
    v["name"] = f"gdn_prefill_cp_warmup_hv{num_v_heads}" + ("_pdl" if "pdl" in v else "")
    return v


def max_warmup_chunks(segment_chunks: int) -> int:
    """The longest gate warmup a segment of L chunks may walk before its outputs: floor(L / 2)
    (0 for L = 1: no warmup). A warmup lengthens that segment's walk (the critical path when
    every head decays); the exact path instead costs a maps pass of ~0.45 L chunk-times
    (configs/costmodel sm90 cp_maps_ratio) plus the scan. Below L, so a warmup never reaches a
    sequence's chunk 0 (prefill_warmup.py)."""
    return segment_chunks // 2


def kernel_variants(num_v_heads: int, num_k_heads: int, target: str = ARCH) -> list[dict]:
    """Every compiled prefill kernel a deployment with these (per-GPU) head counts can need:
    prep per (q/k, v) dtype pair of QK_V_DTYPES, main per (v dtype, pool dtype, v_split, mode)
    (stage 2 reads q/k as fp16 whatever they came as) in the form main_impl_for
    picks (V-first at v_split 1 and 2 unless MAIN_IMPL is "v8"), the CP passes in CP_PDL's form.
    JSON-serialisable dicts."""
    if num_k_heads <= 0 or num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a positive multiple of num_k_heads ({num_k_heads})")
    forms = sorted({PREP_FORM[main_impl_for(vs, target)] for vs in V_SPLITS}, reverse=True)
    group = num_v_heads // num_k_heads
    out = [prep_variant(num_v_heads, num_k_heads, io, form, qk, n, packed=packed,
                        pair_solve=_pair_solve(form, _prep_solve(form, None), n))
           for qk, io in QK_V_DTYPES for form in forms for packed in ((False, True) if form == "m" else (False,))
           for n in PREP_HEADS_CHOICES if n == 1 or (form == "m" and group % n == 0)]
    out += [scan_variant(num_v_heads), warmup_variant(num_v_heads)]
    for io in IO_DTYPES:
        for pool in POOL_DTYPES:
            for vs in V_SPLITS:
                impl = main_impl_for(vs, target)
                for mode in MAIN_MODES:
                    out.append(main_variant(num_v_heads, num_k_heads, io, pool, vs, mode, impl))
                packed = packed_tiles("plain", impl, vs)  # whole sequences at v_split 1
                if packed:
                    out.append(main_variant(num_v_heads, num_k_heads, io, pool, vs, "output", impl, False, True))
                if persistent_applies("plain", impl):
                    out.append(persistent_variant(num_v_heads, num_k_heads, io, pool, vs, packed))
            if fused_applies("plain", 1, "float16", target):
                out.append(fused_variant(num_v_heads, num_k_heads, io, pool))
    return out


def build(variant: dict, target: str = ARCH):
    """Compile (or load from TileLang's cache) one variant for target "sm_90a" or "sm_100a";
    returns the TileLang JITKernel. Kept in-process: a second call is a dict lookup."""
    key = (variant["name"], target)
    kern = _kernels.get(key)
    if kern is not None:
        return kern
    import tilelang

    with _lock:
        kern = _kernels.get(key)
        if kern is None:
            hv = variant["num_v_heads"]
            hk, io = variant.get("num_k_heads"), variant.get("io_dtype")
            pdl = variant.get("pdl", False)
            if variant["op"] == "prefill_cp_scan":
                func = prefill_scan.scan_func(hv, variant.get("rows", 0), pdl)
                cfg = prefill_scan.PASS_CONFIGS
            elif variant["op"] == "prefill_cp_warmup":
                func, cfg = prefill_warmup.warmup_func(hv, pdl), prefill_warmup.PASS_CONFIGS
            elif variant["op"] == "prefill_prep":
                func = prefill_prep.prep_func(hv, hk, io, variant.get("form", "uw"), variant.get("qk_dtype"),
                                              variant.get("heads_per_cta", 1), variant.get("solve"),
                                              variant.get("packed", False), variant.get("pair_solve", False))
                cfg = prefill_prep.PASS_CONFIGS
            elif variant["op"] == "prefill_fused":
                func = prefill_fused.fused_func(hv, hk, io, variant["pool_dtype"], variant.get("pingpong", False))
                cfg = prefill_fused.PASS_CONFIGS
            elif variant["op"] == "prefill_main" and variant.get("persistent"):
                func, _ = prefill_main_vfirst.persistent_func(hv, hk, io, variant["pool_dtype"], variant["v_split"],
                                                              variant.get("packed", False))
                cfg = prefill_main_vfirst.PASS_CONFIGS
            elif variant["op"] == "prefill_main":
                kmod = prefill_main_vfirst if variant.get("impl", "v8") == "vfirst" else prefill_main
                extra = {"packed": True} if variant.get("packed") else {}  # V-first only (main_variant)
                func, _ = kmod.main_func(hv, hk, io, variant["pool_dtype"], variant["v_split"],
                                         variant.get("mode", "output"), pdl, **extra)
                cfg = kmod.PASS_CONFIGS
            else:
                raise ValueError(f"variant['op'] must be prefill_prep, prefill_main, prefill_fused, prefill_cp_scan "
                                 f"or prefill_cp_warmup, got {variant['op']!r}")
            if target not in ("sm_90a", "sm_100a"):
                raise ValueError(f"target: expected 'sm_90a' or 'sm_100a', got {target!r}")
            kern = tilelang.compile(
                func, target={"kind": "cuda", "arch": target}, execution_backend="tvm_ffi", pass_configs=cfg
            )
            _kernels[key] = kern
    return kern
