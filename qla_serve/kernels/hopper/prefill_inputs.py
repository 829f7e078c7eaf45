"""A prefill step's inputs in one launch: L2-normalised q and k, and the gates from raw a, b.

What the engines' GDN layers hand to prefill are q and k before their L2 norm and the raw
gating logits a, b with the layer's A_log and dt_bias; the chunked prefill (prefill_api.py)
takes unit-norm q/k and fp32 g, beta. In torch that is ~20 elementwise launches per layer and
step (reference.l2norm on q and on k, reference.fused_gating); this kernel does it in one:

    q_out[t, h] = q[t, h] / sqrt(sum(q[t, h]^2) + 1e-6)      (fp32 math, stored in q_out's dtype)
    k_out[t, h] = k[t, h] / sqrt(sum(k[t, h]^2) + 1e-6)
    g_out[t, h]    = -exp(A_log[h]) * softplus(a[t, h] + dt_bias[h])     (fp32)
    beta_out[t, h] = sigmoid(b[t, h])                                     (fp32)

softplus(x) = x above 20, else log1p(exp(x)): torch's softplus, so the results match
reference.l2norm and reference.fused_gating (the float64 truth is the same formulas;
tests/kernels/test_prefill_inputs*.py). A variant without gates (``ab`` None) does q/k only,
for callers that bring g and beta (SGLang's extend).

Grid: one CTA of 128 threads per 16 tokens. A warp normalises one (token, qk-head) row of q and
the same row of k per step: each lane loads 4 elements (one 8-byte access), the sum of squares
is 5 xor-shuffles over the warp. Then each thread computes one (token, v-head) gate pair per
step. Dtypes: q/k bf16 or fp16, the outputs in q's dtype or fp16 (``out``: fp16 from bf16 is
what the Hopper prefill reads without its own fp16 copy, prefill_prep.py); a/b, A_log and
dt_bias each in its own dtype (SGLang keeps A_log in fp32 beside a bf16 dt_bias), as in
decode.py; head counts are static, the token count and every input stride dynamic (q/k and
a/b may be strided views of a fused projection; the host checks that q/k strides are multiples
of 4 elements).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
from .common import (_GATE_DTYPES, _IO_DTYPES, _check_heads, _dtype_name,
                     compile_for, gate_dtype_names, launch_function, log_decay, sigmoid)

HEAD_DIM = 128
TOKENS_PER_CTA = 16
# Gate dtype combinations kernel_variants lists (a/b in the io dtype, as the engines project
# them; A_log, dt_bias): fp32 both, io both, fp32 A_log beside an io dt_bias (SGLang).
_PARAM_PAIRS = (("float32", "float32"), (None, None), ("float32", None))


def variant(hv: int, hk: int, io: str, ab: str | None = None, param: str | None = None,
            bias: str | None = None, out: str | None = None) -> dict:
    """A JSON-serialisable variant description (op "inputs"); ``name`` identifies it. ``ab``
    None: q/k only (the caller has its gates: SGLang's extend). ``out``: the normalised q/k's
    dtype (None: io; the name says it only where it differs)."""
    out = out or io
    checks = [("q", io, _IO_DTYPES), ("q_out", out, _IO_DTYPES)]
    if ab is not None:
        checks += [("a", ab, _GATE_DTYPES), ("A_log", param, _GATE_DTYPES), ("dt_bias", bias, _GATE_DTYPES)]
    for what, dtype, allowed in checks:
        if dtype not in allowed:
            raise ValueError(f"{what} dtype: expected one of {allowed}, got {dtype}")
    _check_heads(hv, hk)
    to = "" if out == io else f"_to-{out}"
    common = {"op": "inputs", "num_v_heads": hv, "num_k_heads": hk, "io_dtype": io, "out_dtype": out}
    if ab is None:  # no gate columns: the kernel, and so its name, does not depend on Hv
        return {"name": f"gdn_prefill_inputs_hk{hk}_{io}{to}_qk-only", **common, "ab_dtype": None,
                "param_dtype": None, "bias_dtype": None}
    return {"name": f"gdn_prefill_inputs_hv{hv}_hk{hk}_{io}{to}_ab-{ab}-{param}-{bias}", **common,
            "ab_dtype": ab, "param_dtype": param, "bias_dtype": bias}


# (q dtype, normalised q/k dtype) pairs kernel_variants lists: each dtype as it is, and bf16 to
# fp16 (what the engine layers ask for: gdn_prefill_inputs(..., qk_dtype=torch.float16)).
_IO_OUT = (("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "float16"))


def kernel_variants(num_v_heads: int, num_k_heads: int) -> list[dict]:
    """(q dtype, q/k output dtype) of _IO_OUT x (the gate dtype pairs of _PARAM_PAIRS, q/k
    only): 12 variants. Other dtype combinations compile on first use (same cache)."""
    return [variant(num_v_heads, num_k_heads, io, io, param or io, bias or io, out)
            for io, out in _IO_OUT for param, bias in _PARAM_PAIRS] + [
        variant(num_v_heads, num_k_heads, io, out=out) for io, out in _IO_OUT]


def _program(v: dict):
    import tilelang.language as T

    Hv, Hk, io = v["num_v_heads"], v["num_k_heads"], v["io_dtype"]
    out = v.get("out_dtype") or io
    ab, prm, bias = v["ab_dtype"], v["param_dtype"], v["bias_dtype"]
    f32 = "float32"
    TPB = TOKENS_PER_CTA
    qk_steps = TPB * Hk // 4           # (token, qk-head) rows per warp
    gate_steps = -(-(TPB * Hv) // 128)  # (token, v-head) pairs per thread
    ntok = T.dynamic("ntok")
    sq0, sq1, sk0, sk1, sa0, sa1, sb0, sb1, sal, sdt = T.dynamic("sq0 sq1 sk0 sk1 sa0 sa1 sb0 sb1 sal sdt")

    @T.macro
    def normalise_row(X, Xo, t, h, lane, x4):
        for e in T.vectorized(4):
            x4[e] = T.cast(X[t, h, lane * 4 + e], f32)
        s = T.alloc_var(f32)
        s = x4[0] * x4[0] + x4[1] * x4[1] + x4[2] * x4[2] + x4[3] * x4[3]
        for m in T.unroll(5):
            s += T.shfl_xor(s, 1 << m)
        r = T.rsqrt(s + 1e-6)
        for e in T.vectorized(4):
            Xo[t, h, lane * 4 + e] = T.cast(x4[e] * r, out)

    @T.macro
    def normalise_rows(Q, K, Qo, Ko, bx, warp, lane, x4):
        # 8-byte vector loads and stores of q/k rows (checked on the host: _check_strides)
        T.assume(sq0 % 4 == 0)
        T.assume(sq1 % 4 == 0)
        T.assume(sk0 % 4 == 0)
        T.assume(sk1 % 4 == 0)
        for step in T.serial(qk_steps):
            row = step * 4 + warp
            t = bx * TPB + row // Hk
            if t < ntok:  # the same for the whole warp: the shuffles see every lane
                normalise_row(Q, Qo, t, row % Hk, lane, x4)
                normalise_row(K, Ko, t, row % Hk, lane, x4)

    if ab is None:
        @T.prim_func
        def gdn_prefill_qk_inputs(
            Q: T.StridedTensor((ntok, Hk, HEAD_DIM), (sq0, sq1, 1), io),
            K: T.StridedTensor((ntok, Hk, HEAD_DIM), (sk0, sk1, 1), io),
            Qo: T.Tensor((ntok, Hk, HEAD_DIM), out),
            Ko: T.Tensor((ntok, Hk, HEAD_DIM), out),
        ):
            with T.Kernel(T.ceildiv(ntok, TPB), threads=128) as bx:
                tx = T.get_thread_binding()
                x4 = T.alloc_local((4,), f32)
                normalise_rows(Q, K, Qo, Ko, bx, tx // 32, tx % 32, x4)

        return gdn_prefill_qk_inputs

    @T.prim_func
    def gdn_prefill_inputs(
        Q: T.StridedTensor((ntok, Hk, HEAD_DIM), (sq0, sq1, 1), io),
        K: T.StridedTensor((ntok, Hk, HEAD_DIM), (sk0, sk1, 1), io),
        A: T.StridedTensor((ntok, Hv), (sa0, sa1), ab),
        B: T.StridedTensor((ntok, Hv), (sb0, sb1), ab),
        A_log: T.StridedTensor((Hv,), (sal,), prm),
        dt_bias: T.StridedTensor((Hv,), (sdt,), bias),
        Qo: T.Tensor((ntok, Hk, HEAD_DIM), out),
        Ko: T.Tensor((ntok, Hk, HEAD_DIM), out),
        Go: T.Tensor((ntok, Hv), f32),
        Bo: T.Tensor((ntok, Hv), f32),
    ):
        with T.Kernel(T.ceildiv(ntok, TPB), threads=128) as bx:
            tx = T.get_thread_binding()
            x4 = T.alloc_local((4,), f32)
            normalise_rows(Q, K, Qo, Ko, bx, tx // 32, tx % 32, x4)
            for step in T.serial(gate_steps):
                idx = step * 128 + tx
                t = bx * TPB + idx // Hv
                h = idx % Hv
                if idx < TPB * Hv and t < ntok:
                    Go[t, h] = log_decay(T, A[t, h], A_log[h], dt_bias[h])
                    Bo[t, h] = sigmoid(T, B[t, h])

    return gdn_prefill_inputs


def build(v: dict, target: str):
    """Compile variant ``v`` for ``target`` ("sm_90a" or "sm_100a") through TileLang's cache."""
    return compile_for(_program, v, target)


# (device, q dtype, q_out dtype, a / A_log / dt_bias dtypes or None, Hv, Hk) -> the raw launch function
_FAST: dict[tuple, object] = {}


def _check_strides(q, k) -> None:
    """The kernel's 8-byte q/k row accesses (host metadata only)."""
    for name, x in (("q", q), ("k", k)):
        if x.stride(0) % 4 or x.stride(1) % 4 or x.stride(2) != 1 or x.data_ptr() % 8:
            raise ValueError(f"{name}: the prefill input kernel needs token and head strides that are "
                             f"multiples of 4 elements, unit stride along the head dim and an 8-byte "
                             f"aligned data pointer; got strides {tuple(x.stride())}")


def prefill_inputs(q, k, a, b, A_log, dt_bias, *, q_out, k_out, g_out, beta_out) -> None:
    """q, k [T, Hk, 128] (bf16/fp16, strided), a, b [T, Hv], A_log, dt_bias [Hv] ->
    q_out, k_out [T, Hk, 128] (q's dtype or fp16, contiguous), g_out, beta_out [T, Hv] fp32
    (contiguous). a is None: q/k only (b, A_log, dt_bias, g_out, beta_out are None too)."""
    if q.shape[0] == 0:
        return
    _check_strides(q, k)
    gates = a is not None
    hv = a.shape[1] if gates else q.shape[1]
    key = (q.device, q.dtype, q_out.dtype) + ((a.dtype, A_log.dtype, dt_bias.dtype) if gates else ()) + (hv, q.shape[1])
    fn = _FAST.get(key)
    if fn is None:
        io = _dtype_name(q.dtype, "q", _IO_DTYPES)
        gate_names = gate_dtype_names(a, b, A_log, dt_bias) if gates else ()
        v = variant(hv, q.shape[1], io, *gate_names, out=_dtype_name(q_out.dtype, "q_out", _IO_DTYPES))
        fn = _FAST[key] = launch_function(v, q.device, build)
    if gates:
        fn(q, k, a, b, A_log, dt_bias, q_out, k_out, g_out, beta_out)
    else:
        fn(q, k, q_out, k_out)
