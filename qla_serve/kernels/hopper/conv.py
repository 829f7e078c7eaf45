"""TileLang kernels for the GDN layer's causal conv1d over the engine's conv state, in place.

What an engine's GDN layer does between its input projection and the recurrence, for
``x = mixed_qkv`` [T, dim] with ``dim = (2 Hk + Hv) 128`` (q | k | v channels), a depthwise
causal conv of width W over each sequence, the sequence's history (the W-1 inputs before it)
coming from and going back to the engine's conv state ``conv_state[slot, c, col]``::

    e_s[p] = x[cu[s] + p]                       p >= 0 (the sequence's own inputs)
    e_s[p] = conv_state[slot_s, c, W - 1 + p]   -(W-1) <= p < 0, when the slot has history,
             0                                  otherwise (new sequence: a recycled slot may
                                                hold inf/nan and is never read then)
    y[t, c] = act(bias[c] + sum_i weight[c, i] * e_s[p - (W - 1) + i])     act: SiLU or none
    afterwards conv_state[slot_s, c, i] = e_s[len_s - (W - 1) + i]        i < W - 1

The programs, one per engine call site (reference: kernels/reference_conv.py, the same
formulas in torch; float64 truth in the layer tests); their TileLang source is in
conv_program.py, conv_prefill's walk in conv_prefill.py, and this module holds the variants,
the launch rules and the launchers:

* ``conv_prefill``: the varlen prefill's conv *and* what gdn_prefill reads, in one pass: the
  q | k | v split, q and k L2-normalised (fp32 math, stored in the variant's q/k dtype: fp16
  where the Hopper prefill takes it), and g, beta from the raw a, b (as prefill_inputs.py).
  Grid (token ranges, 1 + 2 Hk + Hv): the first column's CTAs compute g and beta of their
  token range for every head, the others one channel block of 128 each; each walker of those
  (a half-warp, or a warp with 4 channels per lane: PREFILL_LANE_CHANNELS) walks
  ``walk`` x GROUP consecutive tokens of one channel block (``walk`` chosen on the host:
  steps_per_walk), lane g holding channels 8g..8g+7: GROUP input rows at a time arrive in
  registers through a per-thread cp.async ring in shared memory, STAGES - 1 steps ahead, in
  16-byte pieces (x's row stride must be a multiple of 8 elements, its base 16-byte
  aligned), and each token's taps come from the registers holding the rows before it. A
  sequence's first W - 1 tokens (taps in the conv state) are left to window CTAs (columns
  past the walks' token ranges, a sequence per walker), which convolve them and then write the
  sequence's new window into its slot: the write-back is part of this launch
  (WINDOW_CTAS). A token row's 128 channels sit in
  16 adjacent lanes, so the q/k L2 norm is 4 xor-shuffles, and every output is a 16-byte
  store (with 4 channels per lane: 32 lanes, 5 shuffles, 8-byte pieces and stores). A walk
  finds its sequence by a binary search in cu_seqlens, and again only where it crosses into
  the next one (no per-token index tensors). Its program: conv_prefill.py.
* ``conv_prefill_state``: the conv-state write-back alone (conv_window): a prefill checkpoint's
  window, and the prefill's own where conv_prefill has no window CTAs (a second launch then: a
  sequence spans several walks, and the walk that would write its new window cannot know that
  the one reading its old history has read it). Grid (sequences, channel blocks). Its
  ``after_conv`` form is launched as the conv_prefill grid's programmatic dependent
  (WRITE_BACK_AFTER_CONV): it loads its window while the conv runs and stores it once the conv
  has finished.
* ``conv_decode``: one token per sequence: y and the shifted window (state <- [state[1:], x])
  in one pass; the output [B, dim] feeds the decode kernel (which L2-normalises q/k and
  applies the raw gates itself). A thread owns a channel of one sequence, or of DECODE_SEQS
  sequences in large batches (all their loads issued before the first use), so its reads of
  each old window precede its writes.
* ``conv_spec``: vLLM's speculative sliding window: the state before the step starts at
  column ``num_accepted - 1`` (clamped to [0, state_len - (W - 1)]); afterwards columns
  [0, W - 2 + len) hold the last W - 2 history inputs and the step's tokens (columns past
  that keep their values), so that the next step resumes from any accepted token. D (the
  draft depth, spec slots' second dim) is static: a thread keeps W - 1 + D inputs in
  registers.
* ``conv_verify``: SGLang's target verify (its causal_conv1d_update with an intermediate conv
  window, mamba/causal_conv1d_triton.py): every sequence has D draft tokens (rows s D .. s D +
  D - 1), its history is the slot's W - 1 columns; the window after each token j, e_s[j + 1 -
  (W - 1) .. j], goes to ``windows[window_ids[s], j, c, :]`` (SGLang's per-request scratch, from
  which it commits the accepted one) and the window after the last token to the slot. A
  window id < 0 writes no windows.

Padding: slot < 0 is never read or written (its sequence's conv runs from a zero history;
decode and spec rows of padding sequences get zero outputs). Shapes are dynamic (token and
sequence counts, slot count, state length and every stride: either conv-state layout works);
heads, W, dtypes, activation and bias are static and name a variant.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
from .conv_prefill import GROUP, HEAD_DIM, LANE_CHANNELS, SEARCH_STEPS, min_blocks_per_sm, walkers_per_cta
from .conv_program import program
from .common import (_GATE_DTYPES, _IO_DTYPES, _check_heads, _dtype_name,
                     compile_for, gate_dtype_names, launch_function, sm_count)

CONV_STATE_DTYPES = ("bfloat16", "float16", "float32")
WIDTHS = (2, 3, 4, 5, 6, 7, 8)
ACTIVATIONS = ("silu", "none")
# conv_prefill's walk length (steps_per_walk): up to SHORT_WALK_STEPS while the batch gives
# CTAS_PER_SM CTAs per SM of them; QUICK_WALK_STEPS where even those give MANY_CTAS_PER_SM. H200,
# since the gate CTAs and the tanh SiLU (benchmarks/layer.md, walk sweep of 2026-12-04), kernel us
# at 2/4/8/16/32 steps: 2/8 x 32768 67.1/56.8/57.0/58.8/69.7, 1 x 8192 21.4/18.5/17.5/20.3/25.2;
# 4/16 x 32768 128.4/108.0/108.5/110.0/117.9; 16/64 16 x 512 139.6/114.0/110.8/123.4/181.6, x 32768
# 492.6/418.0/424.8/424.6/427.3 (186 CTAs per SM at 4 steps; 4/16 x 32768 and 16/64 16 x 512,
# 46, level or slower at 4). The long walks of up to 32 steps that the walkers' own gates once
# needed (16/64 x 32768: 533 us at 32 steps against 590 at 8) are slower everywhere now.
CTAS_PER_SM = 2
# A walk length for every conv_prefill call instead of the rule (None: steps_per_walk), for A/B
# runs through the whole layer (benchmarks/layer_ab.py --switch conv.WALK_STEPS=None,7). The rule
# gives powers of two only; walks of 5-7 steps at 8192 tokens (2/8: 7 steps give 494 CTAs for 528
# slots where 8 give 429) were slower on the H200 in the kernel and in the layer (2/8 1 x 8192
# conv 15.7 us at the rule's 8 steps against 18.2-19.4, layer 93.1 against 94.3-98.4;
# benchmarks/data/conv_walks_8192_h200.txt).
WALK_STEPS = None
SHORT_WALK_STEPS = 8
QUICK_WALK_STEPS = 4
MANY_CTAS_PER_SM = 64
# conv_prefill's cp.async ring depth: each step's rows start STAGES - 1 steps ahead. H200: 3-4%
# faster at 2/8, 7% at 16/64 than rows loaded straight into registers (the form before it); 4
# stages between the two (benchmarks/layer.md).
STAGES = 3
# conv_prefill's straight-line steps (variant key "fast_steps"): where a whole warp's GROUP-token
# steps lie inside their sequences past the first W - 1 tokens (no history tap, no bounds, no
# sequence change), those steps run without per-tap branches, so that the compiler can
# interleave the GROUP tokens (SASS of the checked form: a branch and a convergence barrier per
# tap, ~50 basic blocks per step). H200 (benchmarks/conv_prefill_ab.py, bit-identical outputs):
# 2/8 x 32768 104 -> 76 us, 16 x 512 35 -> 28, 16/64 x 32768 677 -> 535. False: the checked
# steps alone (A/B only).
FAST_STEPS = True
# conv_prefill's SiLU (variant key "silu_form"): "tanh", h + h tanh.approx(h) with h = y / 2 (two
# instructions per element), or "ex2", y rcp.approx(1 + ex2.approx(-y log2 e)) (five). The
# kernel is issue-bound (conv_prefill.py's act); tanh.approx.f32's relative error (2^-11)
# leaves y within bf16's rounding but where SiLU(y) << |y| (y < -2: at most ~2.4e-4 |y|
# absolute). Measured: benchmarks/layer.md.
SILU_FORM = "tanh"
SILU_FORMS = ("tanh", "ex2")
# conv_decode's sequences per thread (variant key "seqs") where the batch would take more than
# DECODE_SEQS_MIN_BLOCKS blocks of one sequence (decodes x channel blocks): a thread convolves its
# channel for DECODE_SEQS sequences, issuing every load of all of them before the first use, so
# that the batch runs in a quarter of the blocks. One block per 128 channels and sequence ran
# 16/32 x 256 decodes in 7.75 waves of short, latency-bound blocks: 20.6 us against an 8 us
# floor, 13.0 with 4 per thread; layer 16/32 d256 bf16 171.7 -> 164.3 us, fp32 297.8 -> 292.5,
# 2/8 d256 fp32 79.3 -> 78.4; but 2/8 d32 (384 blocks) 13.2 -> 13.8 (benchmarks/layer.md).
DECODE_SEQS = 4
DECODE_SEQS_MIN_BLOCKS = 2048
# conv_prefill's window CTAs (variant key "window_ctas"): CTAs past the walkers' token ranges
# convolve each sequence's first W - 1 tokens (the only ones with taps in the conv state) and then
# write its new window, so that no walker reads the conv state and the write-back needs no
# launch of its own (conv_prefill.py's window_block). False: the walkers take the history taps
# and conv_prefill_state writes the windows back in a second launch (the form before it).
WINDOW_CTAS = True
# conv_prefill's forms (H200, kernel us, benchmarks/data/conv_forms_h200.txt, session 51):
# - channels per lane (variant key "lane_channels", conv_prefill.LANE_CHANNELS): 8 (16-byte
#   pieces, 128 registers, 4 CTAs per SM) or 4 (8-byte pieces, a warp per row, 64 registers, 8
#   CTAs per SM: twice the warps; ~1.2x the instructions per element). "auto": per call, 4
#   where the 8-channel form's walker CTAs fill fewer than NARROW_LANE_WAVES waves of the GPU's
#   CTA slots (prefill_launch_form), else 8. With row offsets, 4 against 8: 2/8 x 8192 tokens
#   (384 CTAs, 0.7 waves) 14.6 against 15.0, 4/16 x 8192 (768, 1.5 waves) 29.4-30.3 against
#   30.2-31.3, level at 2/8 x 32768 (2.9 waves), 0.5-3% slower from 4/16 x 32768 and 16/64
#   (5.8 waves and more);
# - row offsets (variant key "row_offsets"): the ring rows' cp.async addresses from one 64-bit
#   offset instead of clamped row indices (72 instead of 119 instructions per step head): never
#   slower, 0.4-0.8 us faster at 8192 tokens (2/8 15.6 -> 15.0), 16/64 x 32768 416.0 -> 414.7.
PREFILL_LANE_CHANNELS = "auto"
PREFILL_ROW_OFFSETS = True
# conv_prefill's L2 policy for the rows it reads (variant key "load_hint"; the row-offsets form
# only: prefill_load_hint): "evict_first", the cp.async row copies under an L2::evict_first cache
# policy, so that mixed_qkv's rows, each read once, leave L2 before the q/k/v the kernel writes,
# which gdn_prefill reads next; None: the copies without a policy (the form before it). Outputs
# bit-identical. H100, session 53 (benchmarks/data/conv_load_hint_h100.txt), kernel us without /
# with: 2/8 1 x 8192 18.4-18.8 / 16.8-16.9, 16 x 512 19.1 / 17.9-18.0, mixed 18.7 / 16.9-17.0;
# 4/16 level (40.0-40.3 / 40.1-40.3). Layer GPU us per call (forms interleaved): 2/8 16 x 512
# 66.3, 67.1-67.2 / 65.0-65.1; mixed 98.2-98.6 / 97.5-97.6; 4/16 mixed 163.0-163.3 / 160.6-160.8;
# 2/8 1 x 8192, 1 x 32768, 4 x 8192 and 4/16 1 x 8192, 16 x 512 level.
PREFILL_LOAD_HINT = "evict_first"
LOAD_HINTS = (None, "evict_first")
PREFILL_LANE_RULES = (8, 4, "auto")
NARROW_LANE_WAVES = 2
# conv_prefill's walk at 4 channels a lane (HALVE_WALKS; halved_walk): steps_per_walk's walk of
# HALVED_WALK_MIN_STEPS x 2 steps or more, halved where the grid then still fits one wave of CTA
# slots (8 per SM), so that a grid under half a wave runs twice the walkers. H100, session 52
# (benchmarks/data/conv_walks_h100.txt), layer GPU us per call, rule's walk / halved: 2/8 1 x 4096
# (384 CTAs at 8 steps) 78.2 / 77.0, 4 x 1024 51.5 / 50.1; 4/16 1 x 2048 75.7 / 73.9, 2 x 1024
# 54.6 / 52.5, 32 decodes + 4 x 512 73.1 / 70.5; the other rows level; the 16/64 x 512 conv
# kernel 19.2 -> 13.2. Halving further, or into a second wave, measured slower in the layer even
# where the conv kernel alone got faster (4/16 x 8192: kernel 40.0 -> 38.0 us at 4 steps, 3072
# CTAs, layer 175.6 -> 178.3; 2/8 x 1024 at 1 step instead of 2: kernel 5.3 -> 6.4).
# False: steps_per_walk's walk (A/B).
HALVE_WALKS = True
HALVED_WALK_MIN_STEPS = 4
# Without the window CTAs: the prefill's conv-state write-back launched as the conv_prefill
# grid's programmatic dependent (conv_prefill_state's after_conv form): its loads (ids, lengths,
# the new window) overlap the conv's last wave, its stores wait for the conv's end. False: a
# plain launch after it.
WRITE_BACK_AFTER_CONV = True
MAX_SEQS = 1 << SEARCH_STEPS  # conv_prefill's binary search over cu_seqlens runs SEARCH_STEPS halvings
OPS = ("conv_prefill", "conv_prefill_state", "conv_decode", "conv_spec", "conv_verify")


def prefill_load_hint(row_offsets: bool) -> str | None:
    """conv_prefill's load_hint for a form with or without row offsets: PREFILL_LOAD_HINT where
    the rows are copied from one offset (the helper that carries the policy), else None."""
    return PREFILL_LOAD_HINT if row_offsets else None


def variant(op: str, hv: int, hk: int, width: int, io: str, state: str, *, weight: str | None = None,
            activation: str = "silu", bias: bool = True, qk_out: str | None = None,
            ab: str | None = None, param: str | None = None, gbias: str | None = None,
            draft: int = 0, stages: int = STAGES, fast_steps: bool = FAST_STEPS,
            silu_form: str = SILU_FORM, window_ctas: bool = WINDOW_CTAS, decodes: bool = False,
            after_conv: bool = False, seqs: int = 1, lane_channels: int = 8,
            row_offsets: bool = False, load_hint: str | None = None) -> dict:
    """A JSON-serialisable variant description; ``name`` identifies it.

    io: x's dtype (and the outputs' but q/k's); state: the conv state's; weight: the conv
    weight's and bias's (default io); qk_out: conv_prefill's q/k dtype (default io); ab,
    param, gbias: conv_prefill's a/b, A_log, dt_bias dtypes; draft: conv_spec's D; stages:
    conv_prefill's cp.async ring depth (STAGES); fast_steps: its straight-line steps (FAST_STEPS);
    silu_form: its SiLU's instructions (SILU_FORM; with activation "silu" only); window_ctas: its
    window CTAs, which also write the conv state back (WINDOW_CTAS); decodes: conv_prefill's form
    that also convolves a mixed step's decode rows (backends/gdn_layer.MIXED_CONV; with
    window_ctas); after_conv: conv_prefill_state's form launched as conv_prefill's programmatic
    dependent; seqs: conv_decode's sequences per thread (DECODE_SEQS); lane_channels,
    row_offsets, load_hint: conv_prefill's forms PREFILL_LANE_CHANNELS, PREFILL_ROW_OFFSETS,
    PREFILL_LOAD_HINT."""
    weight = weight or io
    if op not in OPS:
        raise ValueError(f"variant op: expected one of {OPS}, got {op!r}")
    _check_heads(hv, hk)
    if width not in WIDTHS:
        raise ValueError(f"conv width: expected one of {WIDTHS}, got {width}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    for what, dtype, allowed in (("x", io, _IO_DTYPES), ("conv_state", state, CONV_STATE_DTYPES),
                                 ("conv weight", weight, CONV_STATE_DTYPES)):
        if dtype not in allowed:
            raise ValueError(f"{what} dtype: expected one of {allowed}, got {dtype}")
    v = {"op": op, "num_v_heads": hv, "num_k_heads": hk, "width": width, "io_dtype": io,
         "conv_state_dtype": state, "weight_dtype": weight, "activation": activation, "bias": bool(bias)}
    name = f"gdn_{op}_hv{hv}_hk{hk}_w{width}_{io}_cstate-{state}_wt-{weight}_{activation}_b{int(bias)}"
    if op == "conv_prefill":
        qk_out = qk_out or io
        for what, dtype, allowed in (("q_out", qk_out, _IO_DTYPES), ("a", ab, _GATE_DTYPES),
                                     ("A_log", param, _GATE_DTYPES), ("dt_bias", gbias, _GATE_DTYPES)):
            if dtype not in allowed:
                raise ValueError(f"{what} dtype: expected one of {allowed}, got {dtype}")
        if stages not in (2, 3, 4, 5, 6):
            raise ValueError(f"conv_prefill stages: expected 2..6, got {stages}")
        if silu_form not in SILU_FORMS:
            raise ValueError(f"conv_prefill silu_form: expected one of {SILU_FORMS}, got {silu_form!r}")
        v.update(qk_dtype=qk_out, ab_dtype=ab, param_dtype=param, bias_dtype=gbias, stages=stages,
                 fast_steps=bool(fast_steps))
        name += f"_qk-{qk_out}_ab-{ab}-{param}-{gbias}_st{stages}" + ("_fs" if fast_steps else "")
        if activation == "silu" and silu_form != "ex2":
            v["silu_form"] = silu_form
            name += f"_{silu_form}"
        if window_ctas:
            v["window_ctas"] = True
            name += "_wc"
        if lane_channels not in LANE_CHANNELS:
            raise ValueError(f"conv_prefill lane_channels: expected one of {LANE_CHANNELS}, got {lane_channels}")
        if lane_channels != 8:
            v["lane_channels"] = lane_channels
            name += f"_lc{lane_channels}"
        if row_offsets:
            v["row_offsets"] = True
            name += "_ro"
        if load_hint not in LOAD_HINTS:
            raise ValueError(f"conv_prefill load_hint: expected one of {LOAD_HINTS}, got {load_hint!r}")
        if load_hint is not None:
            if not row_offsets:
                raise ValueError("load_hint: conv_prefill's rows carry a cache policy in its row-offsets form only")
            v["load_hint"] = load_hint
            name += "_ef"
        if decodes:
            if not window_ctas:
                raise ValueError("decodes: conv_prefill convolves decode rows only in its window-CTA form")
            v["decodes"] = True
            name += "_dec"
    if seqs != 1:
        if op != "conv_decode" or seqs not in (2, 4, 8):
            raise ValueError(f"seqs: conv_decode takes 1, 2, 4 or 8 sequences per thread, got {seqs} for {op}")
        v["seqs"] = seqs
        name += f"_s{seqs}"
    if after_conv:
        if op != "conv_prefill_state":
            raise ValueError(f"after_conv: only conv_prefill_state has that form, got op {op!r}")
        v["after_conv"] = True
        name += "_pdl"
    if op in ("conv_spec", "conv_verify"):
        if not (isinstance(draft, int) and 1 <= draft <= 16):
            raise ValueError(f"draft depth: expected 1..16 tokens per sequence, got {draft}")
        v["draft"] = draft
        name += f"_d{draft}"
    v["name"] = name
    return v


def _GATE_PARAMS(io: str) -> tuple[tuple[str, str], ...]:
    """(A_log, dt_bias) dtypes the engines' layers hold: both fp32, both the model's, or vLLM's
    fp32 A_log beside a dt_bias in the model dtype (created under the model's default dtype)."""
    return (("float32", "float32"), (io, io), ("float32", io))


def kernel_variants(num_v_heads: int, num_k_heads: int) -> list[dict]:
    """What the engine layers hit with Qwen3-Next / Qwen3.5 (width 4, SiLU, bias or not, the
    conv state in the model dtype, weights in the model dtype): per model dtype, the prefill
    conv (q/k fp16 from bf16 as the layers ask; a/b in the model dtype, A_log/dt_bias as
    _GATE_PARAMS; with and without a mixed step's decode CTAs), the state write-back alone
    (checkpoint windows; after_conv too where the prefill conv has no window CTAs), decode, and
    spec and SGLang's verify at D = 2..4 (MTP k = 1..3). Others compile on first use (same
    cache)."""
    out = []
    for io in _IO_DTYPES:
        for has_bias in (False, True):
            common = dict(bias=has_bias)
            for param, gbias in _GATE_PARAMS(io):
                for decodes in (False, True) if WINDOW_CTAS else (False,):   # (mixed steps: with decode CTAs)
                    for lanes in _lane_forms():
                        out.append(variant("conv_prefill", num_v_heads, num_k_heads, 4, io, io, qk_out="float16",
                                           ab=io, param=param, gbias=gbias, stages=STAGES, fast_steps=FAST_STEPS,
                                           silu_form=SILU_FORM, window_ctas=WINDOW_CTAS, decodes=decodes,
                                           lane_channels=lanes, row_offsets=PREFILL_ROW_OFFSETS,
                                           load_hint=prefill_load_hint(PREFILL_ROW_OFFSETS), **common))
            for after in (False,) if WINDOW_CTAS else (False, True):
                out.append(variant("conv_prefill_state", num_v_heads, num_k_heads, 4, io, io,
                                   after_conv=after, **common))
            for seqs in (1, DECODE_SEQS):
                out.append(variant("conv_decode", num_v_heads, num_k_heads, 4, io, io, seqs=seqs, **common))
            for d in (2, 3, 4):
                for op in ("conv_spec", "conv_verify"):
                    out.append(variant(op, num_v_heads, num_k_heads, 4, io, io, draft=d, **common))
    return out


def build(v: dict, target: str):
    """Compile variant ``v`` for ``target`` ("sm_90a" or "sm_100a") through TileLang's cache."""
    # conv_prefill's shared memory is a per-thread ring (each thread reads back only what its
    # own cp.async wrote, after its own wait): the block barrier TileLang would insert is not
    # needed. The other programs use no shared memory.
    return compile_for(program, v, target, {"tl.disable_thread_storage_sync": True})


# ----------------------------------------------------------------------------------------
# Launchers (ops validated the arguments; these only name the variant and launch)
# ----------------------------------------------------------------------------------------

# (op, device, dtypes..., heads, width, activation, bias?, extra) -> the raw launch function
_FAST: dict[tuple, object] = {}
_ZEROS: dict[tuple, object] = {}


def _launch_fn(key: tuple, make_variant, device):
    fn = _FAST.get(key)
    if fn is None:
        fn = _FAST[key] = launch_function(make_variant(), device, build)
    return fn


def _bias_arg(bias, weight):
    """The bias, or (bias None) a cached zero vector the no-bias variant never reads."""
    if bias is not None:
        return bias
    key = (weight.device, weight.dtype, weight.shape[0])
    z = _ZEROS.get(key)
    if z is None:
        import torch
        z = _ZEROS[key] = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
    return z


def _lane_forms() -> tuple[int, ...]:
    """The channels a lane conv_prefill can launch with (PREFILL_LANE_CHANNELS)."""
    if PREFILL_LANE_CHANNELS not in PREFILL_LANE_RULES:
        raise ValueError(f"conv.PREFILL_LANE_CHANNELS: expected one of {PREFILL_LANE_RULES}, "
                         f"got {PREFILL_LANE_CHANNELS!r}")
    return LANE_CHANNELS if PREFILL_LANE_CHANNELS == "auto" else (PREFILL_LANE_CHANNELS,)


def walker_ctas(num_tokens: int, channel_blocks: int, walk: int, lane_channels: int) -> int:
    """conv_prefill's walker CTAs: walks of ``walk`` GROUP-token steps, walkers_per_cta walkers a
    CTA at ``lane_channels``, for each of ``channel_blocks`` 128-channel blocks."""
    return -(-num_tokens // (GROUP * walkers_per_cta(lane_channels) * walk)) * channel_blocks


def prefill_launch_form(num_tokens: int, channel_blocks: int, sm_count: int) -> tuple[int, int]:
    """conv_prefill's (channels a lane, steps a walk) for a call. PREFILL_LANE_CHANNELS "auto":
    4 channels a lane where the 8-channel form's walker CTAs, at its walk length, fill fewer than
    NARROW_LANE_WAVES waves of sm_count SMs' slots, so that twice the warps hide the latency of a
    short grid; else 8, whose fewer instructions win once the grid streams for several waves. The
    walk: WALK_STEPS, else steps_per_walk for the chosen lanes (at 4, halved_walk of it)."""
    if PREFILL_LANE_CHANNELS == "auto":
        walk8 = WALK_STEPS or steps_per_walk(num_tokens, channel_blocks, sm_count, 8)
        if walker_ctas(num_tokens, channel_blocks, walk8, 8) >= NARROW_LANE_WAVES * sm_count * min_blocks_per_sm(8):
            return 8, walk8
        lanes = 4
    else:
        lanes = _lane_forms()[0]
    if WALK_STEPS:
        return lanes, WALK_STEPS
    walk = steps_per_walk(num_tokens, channel_blocks, sm_count, lanes)
    if lanes == 4 and HALVE_WALKS:
        walk = halved_walk(num_tokens, channel_blocks, sm_count, walk)
    return lanes, walk


def halved_walk(num_tokens: int, channel_blocks: int, sm_count: int, walk: int) -> int:
    """The 4-lane form's walk: ``walk`` halved where the half is HALVED_WALK_MIN_STEPS or more
    and its grid still fits one wave of sm_count SMs' CTA slots (HALVE_WALKS), else ``walk``."""
    half = walk // 2
    if half >= HALVED_WALK_MIN_STEPS and walker_ctas(num_tokens, channel_blocks, half, 4) <= sm_count * min_blocks_per_sm(4):
        return half
    return walk


def _names(x, conv_state, weight):
    return (_dtype_name(x.dtype, "mixed_qkv", _IO_DTYPES),
            _dtype_name(conv_state.dtype, "conv_state", CONV_STATE_DTYPES),
            _dtype_name(weight.dtype, "conv_weight", CONV_STATE_DTYPES))


def steps_per_walk(num_tokens: int, channel_blocks: int, sm_count: int, lane_channels: int = 8) -> int:
    """conv_prefill's GROUP-token steps per walk (walkers_per_cta walkers a CTA at
    ``lane_channels``). Longer walks cost fewer walk starts
    (a binary search, the W - 1 rows before the walk, a pipeline fill) but give fewer CTAs: up to
    SHORT_WALK_STEPS while that leaves CTAS_PER_SM CTAs per SM, QUICK_WALK_STEPS where the batch
    gives MANY_CTAS_PER_SM CTAs per SM of those (many heads, long batches)."""
    steps = -(-num_tokens // (GROUP * walkers_per_cta(lane_channels))) * channel_blocks
    if steps // (sm_count * QUICK_WALK_STEPS) >= MANY_CTAS_PER_SM:
        return QUICK_WALK_STEPS
    short = min(SHORT_WALK_STEPS, steps // (sm_count * CTAS_PER_SM))
    # a power of two (H200, 16/64 x 32768: 31 steps 713 us, 32 steps 680)
    return 1 << (max(1, short).bit_length() - 1)


def conv_prefill(x, conv_state, weight, bias, slot_ids, has_initial_state, cu_seqlens, a, b, A_log,
                 dt_bias, *, activation, q_out, k_out, v_out, g_out, beta_out, decodes=None) -> None:
    """x [T, dim] (unit channel stride), conv_state [S, dim, L], weight [dim, W], bias [dim] or
    None, slot_ids [N] int32, has_initial_state [N] int8 (a bool tensor's view), cu_seqlens
    [N+1] int32, a, b [T, Hv], A_log, dt_bias [Hv] -> q_out, k_out [T, Hk, 128], v_out
    [T, Hv, 128], g_out, beta_out [T, Hv] fp32 (contiguous); and the conv-state write-back (by the
    window CTAs, or by conv_window after it where WINDOW_CTAS is off). ``decodes``: None, or a
    mixed step's decode rows (x [B, dim], slot_ids [B] int32, out [B, dim]; slots disjoint from
    the prefill's) that conv_decode's work is done for, in the same launch where the window CTAs
    run (decode CTAs: one launch fewer), else by conv_decode after it."""
    T_, N = x.shape[0], slot_ids.shape[0]
    if N > MAX_SEQS:  # the kernel's binary search over cu_seqlens takes SEARCH_STEPS halvings
        raise ValueError(f"slot_ids: the conv prefill kernel takes at most {MAX_SEQS} sequences, got {N}")
    hv, hk, width = v_out.shape[1], q_out.shape[1], weight.shape[1]
    windows = WINDOW_CTAS
    # the decode rows in this launch (its decode CTAs), where it runs with window CTAs
    dec = bool(T_) and windows and decodes is not None and decodes[0].shape[0] > 0
    if T_:
        sms = sm_count(x.device)
        (lanes, walk), offsets = prefill_launch_form(T_, 2 * hk + hv, sms), PREFILL_ROW_OFFSETS
        stages, fast, silu_form, hint = STAGES, FAST_STEPS, SILU_FORM, prefill_load_hint(offsets)
        key = ("conv_prefill", x.device, x.dtype, conv_state.dtype, weight.dtype, q_out.dtype, a.dtype,
               A_log.dtype, dt_bias.dtype, hv, hk, width, activation, bias is not None, stages, fast,
               silu_form, windows, dec, lanes, offsets, hint)

        def make():
            io, sdt, wdt = _names(x, conv_state, weight)
            ab, prm, gb = gate_dtype_names(a, b, A_log, dt_bias)
            return variant("conv_prefill", hv, hk, width, io, sdt, weight=wdt, activation=activation,
                           bias=bias is not None, qk_out=_dtype_name(q_out.dtype, "q_out", _IO_DTYPES),
                           ab=ab, param=prm, gbias=gb, stages=stages, fast_steps=fast,
                           silu_form=silu_form, window_ctas=windows, decodes=dec, lane_channels=lanes,
                           row_offsets=offsets, load_hint=hint)
        _launch_fn(key, make, x.device)(x, conv_state, weight, _bias_arg(bias, weight), slot_ids,
                                        has_initial_state, cu_seqlens, a, b, A_log, dt_bias,
                                        q_out, k_out, v_out, g_out, beta_out, walk, *(decodes if dec else ()))
    if N and not (T_ and windows):   # (the window CTAs wrote the windows back)
        conv_window(x, conv_state, slot_ids, has_initial_state, cu_seqlens, num_v_heads=hv, width=width,
                    weight_dtype=weight.dtype, after_conv=bool(T_) and WRITE_BACK_AFTER_CONV)
    if decodes is not None and not dec:
        xd, ids, out = decodes
        conv_decode(xd, conv_state, weight, bias, ids, num_v_heads=hv, activation=activation, out=out)


def conv_window(x, conv_state, slot_ids, has_initial_state, cu_seqlens, *, num_v_heads, width,
                weight_dtype=None, after_conv=False) -> None:
    """conv_state[slot_ids[s], :, :W-1] <- the W-1 inputs before cu_seqlens[s+1] (from the slot's
    old window where sequence s is shorter, if has_initial_state[s]): the prefill's write-back
    alone (the conv_prefill_state kernel), also what a prefill checkpoint's conv window is.
    after_conv: this launch directly follows conv_prefill's on the same stream (its
    programmatic dependent); never after another kernel, whose writes it could read early."""
    N = slot_ids.shape[0]
    if not N:
        return
    hk = (x.shape[1] // HEAD_DIM - num_v_heads) // 2
    key = ("conv_prefill_state", x.device, x.dtype, conv_state.dtype, num_v_heads, hk, width, after_conv)

    def make_state():
        io = _dtype_name(x.dtype, "mixed_qkv", _IO_DTYPES)
        sdt = _dtype_name(conv_state.dtype, "conv_state", CONV_STATE_DTYPES)
        wdt = io if weight_dtype is None else _dtype_name(weight_dtype, "conv_weight", CONV_STATE_DTYPES)
        return variant("conv_prefill_state", num_v_heads, hk, width, io, sdt, weight=wdt,
                       after_conv=after_conv)
    _launch_fn(key, make_state, x.device)(x, conv_state, slot_ids, has_initial_state, cu_seqlens)


def conv_decode(x, conv_state, weight, bias, slot_ids, *, num_v_heads, activation, out) -> None:
    """x [B, dim], conv_state [S, dim, L >= W-1], slot_ids [B] int32 -> out [B, dim] (x's dtype);
    the window shifts by one in place."""
    if x.shape[0] == 0:
        return
    hk = (x.shape[1] // HEAD_DIM - num_v_heads) // 2
    seqs = DECODE_SEQS if x.shape[0] * (x.shape[1] // HEAD_DIM) > DECODE_SEQS_MIN_BLOCKS else 1
    key = ("conv_decode", x.device, x.dtype, conv_state.dtype, weight.dtype, num_v_heads, hk,
           weight.shape[1], activation, bias is not None, seqs)

    def make():
        io, sdt, wdt = _names(x, conv_state, weight)
        return variant("conv_decode", num_v_heads, hk, weight.shape[1], io, sdt, weight=wdt,
                       activation=activation, bias=bias is not None, seqs=seqs)
    _launch_fn(key, make, x.device)(x, conv_state, weight, _bias_arg(bias, weight), slot_ids, out)


def conv_spec(x, conv_state, weight, bias, slot_ids, num_accepted, cu_seqlens, *, num_v_heads,
              draft, activation, out) -> None:
    """x [Ts, dim] packed by cu_seqlens [N+1] int32 (lengths <= draft), slot_ids [N] int32
    (each sequence's conv slot), num_accepted [N] int32 -> out [Ts, dim] on the sequences'
    rows (rows past cu_seqlens[N] untouched); vLLM's sliding window updated in place."""
    _draft_conv("conv_spec", x, conv_state, weight, bias, slot_ids, (num_accepted, cu_seqlens),
                num_v_heads=num_v_heads, draft=draft, activation=activation, out=out)


def conv_verify(x, conv_state, weight, bias, slot_ids, windows, window_ids, *, num_v_heads, draft,
                activation, out) -> None:
    """x [N D, dim] (D = draft tokens per sequence), conv_state [S, dim, W-1], slot_ids [N]
    int32, windows [Si, D, dim, W-1] (the conv state's dtype), window_ids [N] int32 -> out
    [N D, dim]; the window after each token to windows[window_ids[s], j], after the last to the
    slot (SGLang's target verify)."""
    _draft_conv("conv_verify", x, conv_state, weight, bias, slot_ids, (windows, window_ids),
                num_v_heads=num_v_heads, draft=draft, activation=activation, out=out)


def _draft_conv(op, x, conv_state, weight, bias, slot_ids, extra, *, num_v_heads, draft, activation, out):
    """conv_spec's / conv_verify's launch: the variant for D = ``draft`` draft tokens, its
    arguments x, conv_state, weight, bias, slot_ids, then ``extra``, then out."""
    if slot_ids.shape[0] == 0:
        return
    hk = (x.shape[1] // HEAD_DIM - num_v_heads) // 2
    key = (op, x.device, x.dtype, conv_state.dtype, weight.dtype, num_v_heads, hk, weight.shape[1], activation,
           bias is not None, draft)

    def make():
        io, sdt, wdt = _names(x, conv_state, weight)
        return variant(op, num_v_heads, hk, weight.shape[1], io, sdt, weight=wdt, activation=activation,
                       bias=bias is not None, draft=draft)
    _launch_fn(key, make, x.device)(x, conv_state, weight, _bias_arg(bias, weight), slot_ids, *extra, out)
