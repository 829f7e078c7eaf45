"""conv_prefill: the varlen prefill's causal conv over the engine's conv state and what
gdn_prefill reads, in one TileLang kernel (conv.py's first program; its module docstring has the
conv's formulas, reference_conv.conv_prefill the same in torch, the layer tests a float64 truth).

For x = mixed_qkv [T, (2 Hk + Hv) 128] packed by cu_seqlens, per token t of sequence s:
    y[t, c] = SiLU(bias[c] + sum_i weight[c, i] e_s[t - cu[s] - (W - 1) + i])   (e_s: conv.py)
    q[t, h] = y[t, q_h] / ||y[t, q_h]||,  k likewise (fp32 math, stored as the variant's q/k
    dtype), v[t, h] = y[t, v_h],  g[t, h] = -exp(A_log[h]) softplus(a[t, h] + dt_bias[h]),
    beta[t, h] = sigmoid(b[t, h])
and afterwards conv_state[slot_s, c, i] = e_s[len_s - (W - 1) + i] (i < W - 1), in the same grid:
the window CTAs (conv.WINDOW_CTAS, window_block) convolve each sequence's first W - 1 tokens, the
only ones with taps in the conv state, then write its new window; the walkers leave those tokens
to them and never read the conv state, so no CTA has to wait for another (a sequence spans
several walks, and a walk could not know that the one reading its old history had read it: the
form before, still the variant without window CTAs, wrote the windows in a second launch,
conv.py's conv_prefill_state, as this grid's programmatic dependent).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
from .common import FAST_MATH_SOURCE, log_decay, sigmoid

HEAD_DIM = 128
# tokens a walker loads, then computes, per step (4: 123 registers, no spills; 8 needed 149
# registers and ran 1.5x slower on the H200, benchmarks/layer.md)
GROUP = 4
# channels per lane (variant key "lane_channels"): 8 (16-byte pieces, a half-warp per 128-channel
# row, 8 walkers per CTA of 128 threads) or 4 (8-byte pieces, a whole warp per row, 4 walkers per
# CTA; half the registers per thread, so twice the CTAs per SM)
LANE_CHANNELS = (8, 4)
SEARCH_STEPS = 20             # binary-search halvings over cu_seqlens: up to 2**20 sequences
# a gate CTA's (token, v-head) items per thread and round, their loads issued together
GATE_ITEMS = 8
LOG2E = 1.4426950408889634
# issue_rows' helper in the row-offsets form (conv.PREFILL_ROW_OFFSETS); imported only there, so
# that the default form's source stays what ran on the GPU
CP_ROWS_SOURCE = r"""
// U rows of N bytes from base + offset + u * stride (bytes) into smem + u * SROW, zero-filled
// from row `valid` on (src-size 0: nothing is read there, whatever the address)
template <int N, int U, int SROW>
__device__ __forceinline__ void qla_cp_async_rows(void* smem, const void* base, long long offset,
                                                  long long stride, int valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const char* p = (const char*)base + offset;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    int bytes = u < valid ? N : 0;
    if constexpr (N == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], %2, %3;"
                   :: "r"(s + u * SROW), "l"(p + u * stride), "n"(N), "r"(bytes));
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;"
                   :: "r"(s + u * SROW), "l"(p + u * stride), "n"(N), "r"(bytes));
    }
  }
}
"""
# the same copies under an L2::evict_first cache policy (conv.PREFILL_LOAD_HINT; the policy lives
# in a uniform register, no extra registers per thread): imported only in that form
CP_ROWS_EVICT_FIRST_SOURCE = r"""
template <int N, int U, int SROW>
__device__ __forceinline__ void qla_cp_async_rows_ef(void* smem, const void* base, long long offset,
                                                     long long stride, int valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const char* p = (const char*)base + offset;
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#pragma unroll
  for (int u = 0; u < U; ++u) {
    int bytes = u < valid ? N : 0;
    if constexpr (N == 16) {
      asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], %2, %3, %4;"
                   :: "r"(s + u * SROW), "l"(p + u * stride), "n"(N), "r"(bytes), "l"(policy));
    } else {
      asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], %2, %3, %4;"
                   :: "r"(s + u * SROW), "l"(p + u * stride), "n"(N), "r"(bytes), "l"(policy));
    }
  }
}
"""


def walkers_per_cta(lane_channels: int) -> int:
    """The walkers (one 128-channel row each) of a 128-thread CTA at ``lane_channels``."""
    return 128 // (HEAD_DIM // lane_channels)


def min_blocks_per_sm(lane_channels: int) -> int:
    """The CTAs per SM the straight-line steps' register bound keeps (8 channels a lane: 128
    registers, no spills; 4: 64, none in the walk loop)."""
    return 4 if lane_channels == 8 else 8


def program(T, v: dict, NH: int, DIM: int, H: int, conv_state_t, weight_t, decode_rows):
    """The conv_prefill PrimFunc of variant ``v`` (conv.variant; module docstring): NH channel
    blocks of DIM = 128 NH channels, H = W - 1 history columns; conv_state_t(), weight_t() the
    conv state's and the weight's strided tensor types (shared with conv.py's programs).

    The grid is (token ranges of NW * GROUP * walk tokens, 1 + NH). Column 0 are the gate
    CTAs: each computes g and beta of its token range for all Hv heads (gate_block). In the
    other columns, walker CTAs of NW walkers (walk_block; a walker is a half-warp with 8 channels
    per lane, a warp with 4: LANE_CHANNELS); a walker owns one 128-channel block hb = column - 1
    of ``GROUP * walk`` consecutive tokens, lane g channels VEC g..VEC g + VEC - 1. It walks them
    GROUP tokens at a time: each thread's 2 VEC-byte pieces of the group's rows were
    copied (cp.async) into its own part of a STAGES-deep shared ring STAGES - 1 steps
    earlier; it waits for its own copies (no block barrier: no thread reads another's piece),
    moves the rows into registers, and each token's W taps come from the registers holding
    the previous W - 1 rows and its own; a sequence's first W - 1 tokens, whose taps reach into
    the conv state, are the window CTAs' (columns past the walkers' token ranges: window_block;
    without them the walkers read those taps from the conv state). A token's sequence is
    tracked as the walk goes (a binary search in cu_seqlens only when the walk crosses into a
    new sequence). The row's 16 (or 32) lanes reduce the q/k L2 norm by
    xor-shuffles. (Forms before it: rows loaded straight into registers, 3-7% slower; 32-token
    tiles through shared memory with a block barrier per tile, slower still at 16/64; the gates
    computed by the walkers, in each step or in rounds between the steps, whose a, b loads
    stalled them: 16/64 x 32768 529 us against 429 with the gate CTAs; benchmarks/layer.md.)"""
    Hv, Hk, W = v["num_v_heads"], v["num_k_heads"], v["width"]
    io, qk = v["io_dtype"], v["qk_dtype"]
    ab, prm, gb = v["ab_dtype"], v["param_dtype"], v["bias_dtype"]
    f32, i32 = "float32", "int32"
    U = GROUP
    NS = v["stages"]
    FS = v["fast_steps"]
    # the window CTAs (conv.WINDOW_CTAS): a sequence's first W - 1 tokens and its new conv-state
    # window in CTAs of their own, the walkers never reading the conv state (window_block)
    WINDOWS = v.get("window_ctas", False)
    # a mixed step's decode rows convolved in this grid too (backends/gdn_layer.MIXED_CONV: one
    # launch fewer per mixed layer call), one column of CTAs per row (conv.py's decode_rows)
    DECODES = v.get("decodes", False)
    state_dt = v["conv_state_dtype"]
    # VEC channels per lane in one 2 VEC-byte piece; LANES lanes (a half-warp at 8, a warp at 4)
    # cover a row's 128 channels; NW such walkers per 128-thread CTA
    VEC = v.get("lane_channels", 8)
    ROW_OFFSETS = v.get("row_offsets", False)   # (conv.PREFILL_ROW_OFFSETS; issue_rows)
    EVICT_FIRST = v.get("load_hint") == "evict_first"   # (conv.PREFILL_LOAD_HINT; issue_rows)
    LANES, NW = HEAD_DIM // VEC, walkers_per_cta(VEC)
    silu = v["activation"] == "silu"
    tanh_silu = silu and v.get("silu_form") == "tanh"
    # the tanh form takes h = y / 2: the weights and bias are halved as they load (exact in fp32)
    wscale = 0.5 if tanh_silu else 1.0

    def act(y):
        # (y is h = y / 2 in the tanh form.) SiLU(y) = y sigmoid(y) = h + h tanh(h): one MUFU.TANH
        # and one FFMA per element where the ex2 form takes five instructions (FMUL, MUFU.EX2,
        # FADD, MUFU.RCP, FMUL) and this kernel is issue-bound (ncu: 2.2 warp instructions per
        # SM cycle); tanh.approx.f32's error (2^-11 relative) is below bf16's rounding of y
        # (conv.SILU_FORM). The ex2 form: the fast intrinsics ex2.approx.ftz, rcp.approx (the
        # precise expf and IEEE division were most of this kernel's instructions, H200 2/8 x 32768
        # 149 -> 114 us; ex2 flushes a denormal result to zero: 1 + a denormal is 1 either way).
        if not silu:
            return y
        if tanh_silu:
            return y * T.call_extern("float32", "qla_tanh_approx", y) + y
        return y * T.fast_rcp(1.0 + T.call_extern("float32", "qla_ex2_ftz", y * -LOG2E))
    ntok, N = T.dynamic("ntok N")
    sx0, sa0, sa1, sb0, sb1, sal, sdt = T.dynamic("sx0 sa0 sa1 sb0 sb1 sal sdt")

    @T.macro
    def find_sequence(Cu, Slots, HasInit, t, seq):
        # seq <- (start, end, history slot) of the last s with cu[s] <= t (empty ones skipped).
        lo = T.alloc_var(i32)
        hi = T.alloc_var(i32)
        lo = 0
        hi = N
        for _ in T.serial(SEARCH_STEPS):
            if hi - lo > 1:
                mid = (lo + hi) // 2
                if Cu[mid] <= t:
                    lo = mid
                else:
                    hi = mid
        seq[0] = Cu[lo]
        seq[1] = Cu[lo + 1]
        if WINDOWS:      # (the walkers read no history: window_block does)
            seq[2] = -1
        else:
            seq[2] = T.if_then_else(HasInit[lo] != 0, Slots[lo], -1)

    @T.macro
    def load_lane_weights(Wt, Bias, c0, g, w, bias8):
        # lane g's 8 channels of block c0: the W taps and the bias in fp32 (halved in the tanh form)
        for i in T.unroll(W):
            for e in T.unroll(VEC):
                w[i, e] = T.cast(Wt[c0 + g * VEC + e, i], f32) * wscale
        for e in T.unroll(VEC):
            bias8[e] = T.cast(Bias[c0 + g * VEC + e], f32) * wscale if v["bias"] else 0.0

    @T.macro
    def issue_rows(X, ring, t0, tend, wk, g, c0, slot):
        # one cp.async group: rows t0..t0+U-1 of this lane's VEC channels into ring[slot] (rows at
        # or past tend: zero-filled, not read; the group is committed either way so that every
        # step's wait counts the same groups)
        if ROW_OFFSETS:
            # the rows' addresses from one 64-bit offset and the row stride (qla_cp_async_rows;
            # a row at or past tend is never dereferenced): indexing X by clamped rows costs
            # ~8-10 instructions a row (SASS, sm_90a: a step's head 119 -> 72 instructions)
            # (with conv.PREFILL_LOAD_HINT "evict_first": the same copies under an L2::evict_first
            # policy, qla_cp_async_rows_ef)
            T.call_extern("handle", f"qla_cp_async_rows{'_ef' if EVICT_FIRST else ''}<{2 * VEC}, {U}, {2 * HEAD_DIM}>",
                          T.address_of(ring[slot, wk, 0, g * VEC]), T.address_of(X[0, c0 + g * VEC]),
                          T.cast(t0, "int64") * T.cast(sx0 * 2, "int64"), T.cast(sx0 * 2, "int64"), tend - t0)
        else:
            for u in T.unroll(U):
                T.call_extern("handle", f"tl::cp_async_gs_conditional<{2 * VEC}>",
                              T.address_of(ring[slot, wk, u, g * VEC]),
                              T.address_of(X[T.min(t0 + u, ntok - 1), c0 + g * VEC]), t0 + u < tend)
        T.ptx_commit_group()

    @T.macro
    def conv_token(CS, Qo, Ko, Vo, kind, t, tend, u, c0, hb, g, w, bias8, acc, buf, seq, checked=True,
                   history=True):
        # kind (a Python constant): 0 q, 1 k, 2 v channels. buf[u + i] is input row t - H + i.
        # checked=False (a Python constant): the caller knows t - seq start >= W - 1 and t < tend.
        # history=False (a Python constant): a walker of the window-CTA form, which leaves a
        # sequence's first W - 1 tokens (the only ones with taps in the conv state) to the
        # window CTAs: it never reads the conv state and stores only past those tokens.
        rel = t - seq[0]
        hist = seq[2]
        for e in T.unroll(VEC):
            acc[e] = bias8[e]
        for i in T.unroll(W):
            if not checked or rel - H + i >= 0:
                for e in T.unroll(VEC):
                    acc[e] += w[i, e] * T.cast(buf[u + i, e], f32)
            elif history:
                if hist >= 0:                # a tap before the sequence: its history
                    for e in T.unroll(VEC):
                        acc[e] += w[i, e] * T.cast(CS[hist, c0 + g * VEC + e, rel + i], f32)
        for e in T.unroll(VEC):
            acc[e] = act(acc[e])
        if kind == 2:
            if not checked or (t < tend and (history or rel >= H)):
                for e in T.vectorized(VEC):
                    Vo[t, hb - 2 * Hk, g * VEC + e] = T.cast(acc[e], io)
        else:
            # every lane of the warp takes part in the shuffles (the other half-warp may be past
            # its range): the bounds check is on the store only
            ss = T.alloc_var(f32)
            ss = 0.0
            for e in T.unroll(VEC):
                ss += acc[e] * acc[e]
            for m in T.unroll(LANES.bit_length() - 1):   # the row's lanes: xor 1, 2, .., LANES / 2
                ss += T.shfl_xor(ss, 1 << m)
            rn = T.rsqrt(ss + 1e-6)
            if not checked or (t < tend and (history or rel >= H)):
                if kind == 0:
                    for e in T.vectorized(VEC):
                        Qo[t, hb, g * VEC + e] = T.cast(acc[e] * rn, qk)
                else:
                    for e in T.vectorized(VEC):
                        Ko[t, hb - Hk, g * VEC + e] = T.cast(acc[e] * rn, qk)

    @T.macro
    def checked_step(CS, Qo, Ko, Vo, Cu, Slots, HasInit, tg, tend, c0, hb, g, w, bias8, acc, buf, seq):
        # one step's GROUP tokens, each checked: sequence changes, history taps, the range's end
        for u in T.unroll(U):
            t = tg + u
            if t >= seq[1] and t < tend:  # the walk enters the next (non-empty) sequence
                find_sequence(Cu, Slots, HasInit, t, seq)
            if hb < Hk:
                conv_token(CS, Qo, Ko, Vo, 0, t, tend, u, c0, hb, g, w, bias8, acc, buf, seq, True, not WINDOWS)
            elif hb < 2 * Hk:
                conv_token(CS, Qo, Ko, Vo, 1, t, tend, u, c0, hb, g, w, bias8, acc, buf, seq, True, not WINDOWS)
            else:
                conv_token(CS, Qo, Ko, Vo, 2, t, tend, u, c0, hb, g, w, bias8, acc, buf, seq, True, not WINDOWS)

    @T.macro
    def straight_step(CS, Qo, Ko, Vo, kind, tg, tend, c0, hb, g, w, bias8, acc, buf, seq):
        # one step's GROUP tokens of one kind, unchecked (FAST_STEPS: the caller's warp vote)
        for u in T.unroll(U):
            conv_token(CS, Qo, Ko, Vo, kind, tg + u, tend, u, c0, hb, g, w, bias8, acc, buf, seq, False)

    @T.macro
    def gate_block(A, Bt, A_log, dt_bias, Go, Bo, t0, tx, tokens):
        # a gate CTA: g and beta of tokens t0..t0+tokens-1, all Hv heads (in CTAs of their own:
        # the walkers' a, b loads stalled them; program's docstring). Item i = (token t0 + i // Hv,
        # head i % Hv): consecutive threads take consecutive items (coalesced stores into the
        # contiguous Go, Bo), GATE_ITEMS per thread per round; the next round's a, b load while
        # this one computes (loads clamped into the batch, stores guarded)
        n = T.min(tokens, ntok - t0) * Hv
        ga = T.alloc_local((GATE_ITEMS,), ab)
        gbv = T.alloc_local((GATE_ITEMS,), ab)
        na = T.alloc_local((GATE_ITEMS,), ab)
        nb = T.alloc_local((GATE_ITEMS,), ab)
        for e in T.unroll(GATE_ITEMS):
            i = T.min(e * 128 + tx, n - 1)
            na[e] = A[t0 + i // Hv, i % Hv]
            nb[e] = Bt[t0 + i // Hv, i % Hv]
        for j in T.serial(T.ceildiv(tokens * Hv, 128 * GATE_ITEMS)):
            for e in T.unroll(GATE_ITEMS):
                ga[e] = na[e]
                gbv[e] = nb[e]
            for e in T.unroll(GATE_ITEMS):
                i = T.min(((j + 1) * GATE_ITEMS + e) * 128 + tx, n - 1)
                na[e] = A[t0 + i // Hv, i % Hv]
                nb[e] = Bt[t0 + i // Hv, i % Hv]
            for e in T.unroll(GATE_ITEMS):
                i = (j * GATE_ITEMS + e) * 128 + tx
                if i < n:
                    Go[t0 + i // Hv, i % Hv] = log_decay(T, ga[e], A_log[i % Hv], dt_bias[i % Hv])
                    Bo[t0 + i // Hv, i % Hv] = sigmoid(T, gbv[e])

    @T.macro
    def window_step(CS, Qo, Ko, Vo, tg, tend, c0, hb, g, w, bias8, acc, buf, seq):
        # GROUP tokens from tg of a window CTA's sequence, the history taps from the conv state
        for u in T.unroll(U):
            if hb < Hk:
                conv_token(CS, Qo, Ko, Vo, 0, tg + u, tend, u, c0, hb, g, w, bias8, acc, buf, seq)
            elif hb < 2 * Hk:
                conv_token(CS, Qo, Ko, Vo, 1, tg + u, tend, u, c0, hb, g, w, bias8, acc, buf, seq)
            else:
                conv_token(CS, Qo, Ko, Vo, 2, tg + u, tend, u, c0, hb, g, w, bias8, acc, buf, seq)

    @T.macro
    def window_block(X, CS, Wt, Bias, Slots, HasInit, Cu, Qo, Ko, Vo, jb, hb, tx):
        # a window CTA: walker wk takes sequence s = jb * NW + wk in channel block hb. It
        # convolves the sequence's first W - 1 tokens (the only ones whose taps reach into the
        # conv state; the walkers leave them here), then writes the sequence's new window into
        # its slot (conv.py's conv_prefill_state, in this grid: one launch fewer). Each thread
        # reads the old window of its own 8 channels before it writes them, and nothing else
        # reads them, so no other CTA has to wait for this one (nor this one for another).
        c0 = hb * HEAD_DIM
        g = tx % LANES
        T.assume(sx0 % VEC == 0)
        s = jb * NW + tx // LANES
        # both half-warps of a warp run the q/k shuffles: one past the batch's N sequences
        # computes sequence N - 1's tokens and stores nothing
        sr = T.min(s, N - 1)
        w = T.alloc_local((W, VEC), f32)
        bias8 = T.alloc_local((VEC,), f32)
        acc = T.alloc_local((VEC,), f32)
        buf = T.alloc_local((H + U, VEC), io)
        seq = T.alloc_local((3,), i32)      # the sequence's start, end, history slot
        win = T.alloc_local((H, VEC), f32)
        load_lane_weights(Wt, Bias, c0, g, w, bias8)
        seq[0] = Cu[sr]
        seq[1] = Cu[sr + 1]
        seq[2] = T.if_then_else(HasInit[sr] != 0, Slots[sr], -1)
        slot = Slots[sr]
        # stores: tokens before tend (the first W - 1 of the sequence, none past the batch)
        tend = T.if_then_else(s < N, T.min(seq[0] + H, seq[1]), seq[0])
        for i in T.unroll(H):       # rows before the sequence: never read (history taps)
            for e in T.unroll(VEC):
                buf[i, e] = T.cast(0.0, io)
        for step in T.unroll((H + U - 1) // U):
            tg = seq[0] + step * U
            for u in T.unroll(U):
                for e in T.vectorized(VEC):
                    buf[H + u, e] = X[T.min(tg + u, ntok - 1), c0 + g * VEC + e]
            window_step(CS, Qo, Ko, Vo, tg, tend, c0, hb, g, w, bias8, acc, buf, seq)
            for i in T.unroll(H):
                for e in T.vectorized(VEC):
                    buf[i, e] = buf[U + i, e]
        # the new window: the sequence's last W - 1 inputs, or (shorter than that) the old
        # window's last columns before them (zeros without history), all read before any store
        if s < N and slot >= 0:
            for i in T.unroll(H):
                p = seq[1] - seq[0] - H + i
                if p >= 0:
                    for e in T.unroll(VEC):
                        win[i, e] = T.cast(X[seq[0] + p, c0 + g * VEC + e], f32)
                else:
                    for e in T.unroll(VEC):
                        win[i, e] = 0.0
                    if seq[2] >= 0:
                        for e in T.unroll(VEC):
                            win[i, e] = T.cast(CS[seq[2], c0 + g * VEC + e, H + p], f32)
            for i in T.unroll(H):
                for e in T.unroll(VEC):
                    CS[slot, c0 + g * VEC + e, i] = T.cast(win[i, e], state_dt)

    @T.macro
    def walk_block(X, CS, Wt, Bias, Slots, HasInit, Cu, Qo, Ko, Vo, walk, bx, hb, tx, ring):
        # the CTA's 8 half-warps walking channel block hb (the docstring above)
        c0 = hb * HEAD_DIM
        g = tx % LANES
        T.assume(sx0 % VEC == 0)
        tb = (bx * NW + tx // LANES) * (U * walk)    # this walker's first token
        tend = T.min(tb + U * walk, ntok)
        w = T.alloc_local((W, VEC), f32)
        bias8 = T.alloc_local((VEC,), f32)
        acc = T.alloc_local((VEC,), f32)
        buf = T.alloc_local((H + U, VEC), io)
        seq = T.alloc_local((3,), i32)      # the current sequence's start, end, history slot
        wk = tx // LANES
        # The walk's start: every load that does not depend on its sequence first (the ring's
        # first rows, the rows before the walk, the weights), so that their latencies
        # overlap, then the sequence search's dependent loads.
        for p in T.unroll(NS - 1):
            issue_rows(X, ring, tb + p * U, tend, wk, g, c0, p)
        for i in T.unroll(H):
            # the W - 1 rows before the walk (clamped into [0, ntok): a row before the
            # sequence's start is never read, its taps come from the conv state, read by the
            # window CTAs or, without them, by this walk)
            for e in T.vectorized(VEC):
                buf[i, e] = X[T.min(T.max(tb - H + i, 0), ntok - 1), c0 + g * VEC + e]
        load_lane_weights(Wt, Bias, c0, g, w, bias8)
        seq[0] = 0
        seq[1] = 0
        seq[2] = -1
        if tb < ntok:
            find_sequence(Cu, Slots, HasInit, tb, seq)
        for step in T.serial(walk):
            tg = tb + step * U
            # rows of step + NS - 1 start while this step computes; each thread reads back
            # only the 16-byte pieces it copied itself (no barrier)
            issue_rows(X, ring, tg + (NS - 1) * U, tend, wk, g, c0, (step + NS - 1) % NS)
            T.ptx_wait_group(NS - 1)
            for u in T.unroll(U):
                for e in T.vectorized(VEC):
                    buf[H + u, e] = ring[step % NS, wk, u, g * VEC + e]
            if FS:
                # straight-line where every lane of the warp may (the L2 norm's shuffles need
                # both half-warps on the same path): a warp vote
                inside = (tg - seq[0] >= H) and (tg + U <= seq[1]) and (tg + U <= tend)
                if T.call_extern("int32", "__all_sync", T.uint32(0xFFFFFFFF),
                                 T.if_then_else(inside, 1, 0)) != 0:
                    if hb < Hk:
                        straight_step(CS, Qo, Ko, Vo, 0, tg, tend, c0, hb, g, w, bias8, acc, buf, seq)
                    elif hb < 2 * Hk:
                        straight_step(CS, Qo, Ko, Vo, 1, tg, tend, c0, hb, g, w, bias8, acc, buf, seq)
                    else:
                        straight_step(CS, Qo, Ko, Vo, 2, tg, tend, c0, hb, g, w, bias8, acc, buf, seq)
                else:
                    checked_step(CS, Qo, Ko, Vo, Cu, Slots, HasInit, tg, tend, c0, hb, g, w, bias8, acc,
                                 buf, seq)
            else:
                checked_step(CS, Qo, Ko, Vo, Cu, Slots, HasInit, tg, tend, c0, hb, g, w, bias8, acc, buf,
                             seq)
            for i in T.unroll(H):            # the last W - 1 rows open the next group
                for e in T.vectorized(VEC):
                    buf[i, e] = buf[U + i, e]

    @T.macro
    def gates_or_walk(A, Bt, A_log, dt_bias, Go, Bo, X, CS, Wt, Bias, Slots, HasInit, Cu, Qo, Ko, Vo, walk, bx, by,
                      tx, ring):
        if by == 0:     # the gate CTAs: the grid's first column, dispatched first
            gate_block(A, Bt, A_log, dt_bias, Go, Bo, bx * (NW * U * walk), tx, NW * U * walk)
        else:
            walk_block(X, CS, Wt, Bias, Slots, HasInit, Cu, Qo, Ko, Vo, walk, bx, by - 1, tx, ring)

    @T.macro
    def conv_grid(X, CS, Wt, Bias, Slots, HasInit, Cu, A, Bt, A_log, dt_bias, Qo, Ko, Vo, Go, Bo, walk, Xd, DSlots,
                  Yd, nd):
        # columns past the walks' token ranges: the window CTAs (WINDOWS), NW sequences each,
        # then (DECODES) one column per decode row of a mixed step
        nwalk = T.ceildiv(ntok, NW * U * walk)
        nwin = T.ceildiv(N, NW) if WINDOWS else 0
        with T.Kernel(nwalk + nwin + (nd if DECODES else 0), 1 + NH, threads=128) as (bx, by):
            T.import_source(FAST_MATH_SOURCE + (CP_ROWS_SOURCE if ROW_OFFSETS else "")
                            + (CP_ROWS_EVICT_FIRST_SOURCE if EVICT_FIRST else ""))
            if not WINDOWS:
                # the conv-state write-back (conv.py's conv_prefill_state, after_conv form) may
                # launch now: it loads its windows while this grid runs, and stores once it has
                # finished
                T.pdl_trigger()
            if FS:   # the straight-line steps need 162 registers unbounded: keep 4 CTAs per SM (128)
                T.annotate_min_blocks_per_sm(min_blocks_per_sm(VEC))
            tx = T.get_thread_binding()
            ring = T.alloc_shared((NS, NW, U, HEAD_DIM), io)   # per-thread pieces, see issue_rows
            if WINDOWS:
                if bx < nwalk:
                    gates_or_walk(A, Bt, A_log, dt_bias, Go, Bo, X, CS, Wt, Bias, Slots, HasInit, Cu, Qo, Ko, Vo,
                                  walk, bx, by, tx, ring)
                elif bx < nwalk + nwin:
                    if by > 0:
                        window_block(X, CS, Wt, Bias, Slots, HasInit, Cu, Qo, Ko, Vo, bx - nwalk, by - 1, tx)
                elif DECODES:
                    if by > 0:   # a decode row's conv: conv.py's conv_decode, one row per CTA
                        decode_rows(Xd, CS, Wt, Bias, DSlots, Yd, nd, bx - nwalk - nwin, by - 1, tx, 1)
            else:
                gates_or_walk(A, Bt, A_log, dt_bias, Go, Bo, X, CS, Wt, Bias, Slots, HasInit, Cu, Qo, Ko, Vo,
                              walk, bx, by, tx, ring)

    # Two signatures, one body (conv_grid): TileLang takes a kernel's parameters from its Python
    # signature, and only the decode form takes the decode rows (three tensors a prefill-only
    # launch would otherwise pass as dummies, ~0.7 us of host time).
    if DECODES:
        nd = T.dynamic("nd")
        sxd, syd = T.dynamic("sxd syd")

        @T.prim_func
        def gdn_conv_prefill_decodes(
            X: T.StridedTensor((ntok, DIM), (sx0, 1), io),
            CS: conv_state_t(),
            Wt: weight_t(),
            Bias: T.Tensor((DIM,), v["weight_dtype"]),
            Slots: T.Tensor((N,), i32),
            HasInit: T.Tensor((N,), "int8"),
            Cu: T.Tensor((N + 1,), i32),
            A: T.StridedTensor((ntok, Hv), (sa0, sa1), ab),
            Bt: T.StridedTensor((ntok, Hv), (sb0, sb1), ab),
            A_log: T.StridedTensor((Hv,), (sal,), prm),
            dt_bias: T.StridedTensor((Hv,), (sdt,), gb),
            Qo: T.Tensor((ntok, Hk, HEAD_DIM), qk),
            Ko: T.Tensor((ntok, Hk, HEAD_DIM), qk),
            Vo: T.Tensor((ntok, Hv, HEAD_DIM), io),
            Go: T.Tensor((ntok, Hv), f32),
            Bo: T.Tensor((ntok, Hv), f32),
            walk: T.int32,
            Xd: T.StridedTensor((nd, DIM), (sxd, 1), io),
            DSlots: T.Tensor((nd,), i32),
            Yd: T.StridedTensor((nd, DIM), (syd, 1), io),
        ):
            conv_grid(X, CS, Wt, Bias, Slots, HasInit, Cu, A, Bt, A_log, dt_bias, Qo, Ko, Vo, Go, Bo, walk, Xd,
                      DSlots, Yd, nd)

        return gdn_conv_prefill_decodes

    @T.prim_func
    def gdn_conv_prefill(
        X: T.StridedTensor((ntok, DIM), (sx0, 1), io),
        CS: conv_state_t(),
        Wt: weight_t(),
        Bias: T.Tensor((DIM,), v["weight_dtype"]),
        Slots: T.Tensor((N,), i32),
        HasInit: T.Tensor((N,), "int8"),
        Cu: T.Tensor((N + 1,), i32),
        A: T.StridedTensor((ntok, Hv), (sa0, sa1), ab),
        Bt: T.StridedTensor((ntok, Hv), (sb0, sb1), ab),
        A_log: T.StridedTensor((Hv,), (sal,), prm),
        dt_bias: T.StridedTensor((Hv,), (sdt,), gb),
        Qo: T.Tensor((ntok, Hk, HEAD_DIM), qk),
        Ko: T.Tensor((ntok, Hk, HEAD_DIM), qk),
        Vo: T.Tensor((ntok, Hv, HEAD_DIM), io),
        Go: T.Tensor((ntok, Hv), f32),
        Bo: T.Tensor((ntok, Hv), f32),
        walk: T.int32,
    ):
        conv_grid(X, CS, Wt, Bias, Slots, HasInit, Cu, A, Bt, A_log, dt_bias, Qo, Ko, Vo, Go, Bo, walk, None, None,
                  None, 0)

    return gdn_conv_prefill
