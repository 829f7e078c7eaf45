"""The TileLang programs of conv.py's kernels but conv_prefill's walk (conv_prefill.py):
conv_prefill_state, conv_decode (and the decode rows a mixed step's conv_prefill grid runs),
conv_spec and conv_verify. What each computes, and the reference it matches
(kernels/reference_conv.py): conv.py's module docstring. A variant dict (conv.variant) names
each program; conv.build compiles it.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
from .conv_prefill import HEAD_DIM
from .conv_prefill import program as _prefill_program



def program(v: dict):
    """The TileLang prim_func of variant ``v`` (conv.variant): conv_prefill's from conv_prefill.py,
    the others here (conv.py's module docstring says what each computes)."""
    import tilelang.language as T

    op, Hv, Hk, W = v["op"], v["num_v_heads"], v["num_k_heads"], v["width"]
    io, sdt, wdt = v["io_dtype"], v["conv_state_dtype"], v["weight_dtype"]
    silu, has_bias = v["activation"] == "silu", v["bias"]
    f32, i32 = "float32", "int32"
    NH = 2 * Hk + Hv                  # channel blocks of 128
    DIM = NH * HEAD_DIM
    H = W - 1                         # history length
    S, L, N = T.dynamic("S L N")
    sx0, sc0, sc1, sc2, sw0, sw1 = T.dynamic("sx0 sc0 sc1 sc2 sw0 sw1")

    def conv_state_t():
        return T.StridedTensor((S, DIM, L), (sc0, sc1, sc2), sdt)

    def weight_t():
        return T.StridedTensor((DIM, W), (sw0, sw1), wdt)

    @T.macro
    def load_weights(Wt, Bias, c, w, bias_v):
        for i in T.unroll(W):
            w[i] = T.cast(Wt[c, i], f32)
        if has_bias:
            bias_v[0] = T.cast(Bias[c], f32)
        else:
            bias_v[0] = 0.0

    def act(y):
        # SiLU from the fast intrinsics (__expf, rcp.approx): the precise expf and IEEE division
        # were most of the conv's instructions (conv_prefill's own SiLU: conv_prefill.py)
        return y * T.fast_rcp(1.0 + T.__exp(-y)) if silu else y

    @T.macro
    def decode_rows(X, CS, Wt, Bias, Slots, Y, B, ib, hb, tx, seqs):
        # conv_decode's work for channel c = hb * 128 + tx of sequences ib * seqs + u (u < seqs,
        # a Python constant; rows past the batch B: nothing read or written): the window shifted
        # by the row's token in place, Y = act(conv). Every id, then every window and input,
        # loaded before the first is used.
        c = hb * HEAD_DIM + tx
        w = T.alloc_local((W,), f32)
        bias_v = T.alloc_local((1,), f32)
        slot = T.alloc_local((seqs,), i32)
        win = T.alloc_local((seqs, W), f32)
        load_weights(Wt, Bias, c, w, bias_v)
        for u in T.unroll(seqs):
            slot[u] = Slots[T.min(ib * seqs + u, B - 1)]
        for u in T.unroll(seqs):
            if ib * seqs + u < B and slot[u] >= 0:
                for j in T.unroll(H):
                    win[u, j] = T.cast(CS[slot[u], c, j], f32)
                win[u, H] = T.cast(X[ib * seqs + u, c], f32)
        for u in T.unroll(seqs):
            if ib * seqs + u < B:
                if slot[u] >= 0:
                    y = T.alloc_var(f32)
                    y = bias_v[0]
                    for j in T.unroll(W):
                        y += w[j] * win[u, j]
                    for j in T.unroll(H):
                        CS[slot[u], c, j] = T.cast(win[u, j + 1], sdt)
                    Y[ib * seqs + u, c] = T.cast(act(y), io)
                else:
                    Y[ib * seqs + u, c] = T.cast(0.0, io)

    if op == "conv_prefill":
        # (a mixed step's decode rows in the same grid: conv_prefill.py's decode CTAs)
        return _prefill_program(T, v, NH, DIM, H, conv_state_t, weight_t, decode_rows)

    if op == "conv_prefill_state":
        ntok = T.dynamic("ntok")

        @T.prim_func
        def gdn_conv_prefill_state(
            X: T.StridedTensor((ntok, DIM), (sx0, 1), io),
            CS: conv_state_t(),
            Slots: T.Tensor((N,), i32),
            HasInit: T.Tensor((N,), "int8"),
            Cu: T.Tensor((N + 1,), i32),
        ):
            with T.Kernel(N, NH, threads=HEAD_DIM) as (s, hb):
                c = hb * HEAD_DIM + T.get_thread_binding()
                slot = Slots[s]
                win = T.alloc_local((H,), f32)
                if slot >= 0:
                    bos = Cu[s]
                    n = Cu[s + 1] - bos
                    hist = HasInit[s] != 0
                    for i in T.unroll(H):
                        p = n - H + i                      # e_s[p], p >= -(W-1)
                        win[i] = 0.0
                        if p >= 0:
                            win[i] = T.cast(X[bos + p, c], f32)
                        else:
                            if hist:
                                win[i] = T.cast(CS[slot, c, H + p], f32)
                if v.get("after_conv", False):
                    # launched as conv_prefill's programmatic dependent: the window above (inputs
                    # and the old state, which the conv only reads) loaded while it ran; the state
                    # is written only after it has read its histories. Every thread waits, padded
                    # rows too, so that this grid never completes before the conv (the kernels
                    # after it rely on that).
                    T.pdl_sync()
                if slot >= 0:
                    for i in T.unroll(H):
                        CS[slot, c, i] = T.cast(win[i], sdt)

        return gdn_conv_prefill_state

    if op == "conv_decode":
        B = T.dynamic("B")
        SEQS = v.get("seqs", 1)
        sy0 = T.dynamic("sy0")

        @T.prim_func
        def gdn_conv_decode(
            X: T.StridedTensor((B, DIM), (sx0, 1), io),
            CS: conv_state_t(),
            Wt: weight_t(),
            Bias: T.Tensor((DIM,), wdt),
            Slots: T.Tensor((B,), i32),
            Y: T.StridedTensor((B, DIM), (sy0, 1), io),
        ):
            with T.Kernel(T.ceildiv(B, SEQS), NH, threads=HEAD_DIM) as (ib, hb):
                # A decode launched as this grid's programmatic dependent (decode.py's
                # after_conv form) may start now: it loads its states while this runs and
                # waits for this grid to finish before it reads Y.
                T.pdl_trigger()
                decode_rows(X, CS, Wt, Bias, Slots, Y, B, ib, hb, T.get_thread_binding(), SEQS)

        return gdn_conv_decode

    if op == "conv_verify":
        return _verify_program(T, v, NH, DIM, H, conv_state_t, weight_t, load_weights, act)

    # conv_spec
    D = v["draft"]
    Ts = T.dynamic("Ts")
    sy0 = T.dynamic("sy0")

    @T.prim_func
    def gdn_conv_spec(
        X: T.StridedTensor((Ts, DIM), (sx0, 1), io),
        CS: conv_state_t(),
        Wt: weight_t(),
        Bias: T.Tensor((DIM,), wdt),
        Slots: T.Tensor((N,), i32),
        Acc: T.Tensor((N,), i32),
        Cu: T.Tensor((N + 1,), i32),
        Y: T.StridedTensor((Ts, DIM), (sy0, 1), io),
    ):
        with T.Kernel(N, NH, threads=HEAD_DIM) as (s, hb):
            # verify_slots launched as this grid's programmatic dependent (decode.py's after_conv
            # form) may start now: it loads its states while this runs and waits for this grid
            # to finish before it reads Y.
            T.pdl_trigger()
            c = hb * HEAD_DIM + T.get_thread_binding()
            slot = Slots[s]
            bos = Cu[s]
            n = T.min(Cu[s + 1] - bos, D)    # ops' contract: len <= D; never past the window
            w = T.alloc_local((W,), f32)
            bias_v = T.alloc_local((1,), f32)
            win = T.alloc_local((H + D,), f32)
            if slot >= 0:
                load_weights(Wt, Bias, c, w, bias_v)
                off = T.max(T.min(Acc[s] - 1, L - H), 0)
                for j in T.unroll(H):
                    win[j] = T.cast(CS[slot, c, off + j], f32)
                for j in T.unroll(D):
                    win[H + j] = 0.0
                    if j < n:
                        win[H + j] = T.cast(X[bos + j, c], f32)
                for j in T.unroll(D):
                    if j < n:
                        y = T.alloc_var(f32)
                        y = bias_v[0]
                        for i in T.unroll(W):
                            y += w[i] * win[j + i]
                        Y[bos + j, c] = T.cast(act(y), io)
                for col in T.unroll(H - 1 + D):
                    if col < H - 1 + n:
                        CS[slot, c, col] = T.cast(win[col + 1], sdt)
            else:
                for j in T.unroll(D):
                    if j < n:
                        Y[bos + j, c] = T.cast(0.0, io)

    return gdn_conv_spec


def _verify_program(T, v: dict, NH: int, DIM: int, H: int, conv_state_t, weight_t, load_weights, act):
    """conv_verify (module doc): grid (sequences, channel blocks), a thread per channel holding
    the W - 1 + D inputs in registers, as conv_spec."""
    io, sdt, wdt, W, D = v["io_dtype"], v["conv_state_dtype"], v["weight_dtype"], v["width"], v["draft"]
    f32, i32 = "float32", "int32"
    N, Si, Tv = T.dynamic("N Si Tv")
    sx0, sy0, si0, si1, si2, si3 = T.dynamic("sx0 sy0 si0 si1 si2 si3")

    @T.prim_func
    def gdn_conv_verify(
        X: T.StridedTensor((Tv, DIM), (sx0, 1), io),
        CS: conv_state_t(),
        Wt: weight_t(),
        Bias: T.Tensor((DIM,), wdt),
        Slots: T.Tensor((N,), i32),
        Windows: T.StridedTensor((Si, D, DIM, H), (si0, si1, si2, si3), sdt),
        WindowIds: T.Tensor((N,), i32),
        Y: T.StridedTensor((Tv, DIM), (sy0, 1), io),
    ):
        with T.Kernel(N, NH, threads=HEAD_DIM) as (s, hb):
            # A verify launched as this grid's programmatic dependent (decode.py's after_conv
            # form) may start now: it loads its states while this runs and waits for this grid
            # to finish before it reads Y.
            T.pdl_trigger()
            c = hb * HEAD_DIM + T.get_thread_binding()
            slot = Slots[s]
            wid = WindowIds[s]
            w = T.alloc_local((W,), f32)
            bias_v = T.alloc_local((1,), f32)
            win = T.alloc_local((H + D,), f32)
            if slot >= 0:
                load_weights(Wt, Bias, c, w, bias_v)
                for j in T.unroll(H):
                    win[j] = T.cast(CS[slot, c, j], f32)
                for j in T.unroll(D):
                    win[H + j] = T.cast(X[s * D + j, c], f32)
                for j in T.unroll(D):
                    y = T.alloc_var(f32)
                    y = bias_v[0]
                    for i in T.unroll(W):
                        y += w[i] * win[j + i]
                    Y[s * D + j, c] = T.cast(act(y), io)
                    if wid >= 0:
                        for i in T.unroll(H):
                            Windows[wid, j, c, i] = T.cast(win[j + 1 + i], sdt)
                for i in T.unroll(H):
                    CS[slot, c, i] = T.cast(win[D + i], sdt)
            else:
                for j in T.unroll(D):
                    Y[s * D + j, c] = T.cast(0.0, io)

    return gdn_conv_verify
