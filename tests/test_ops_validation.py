"""Bad input: a ValueError/TypeError that names the argument, raised from host metadata."""

import os

import pytest
import torch

import qla_serve

T, HK, HV = 10, 2, 4


def _prefill_args(**over):
    a = dict(q=torch.randn(T, HK, 128), k=torch.randn(T, HK, 128), v=torch.randn(T, HV, 128),
             g=-torch.rand(T, HV), beta=torch.rand(T, HV), pool=torch.zeros(4, HV, 128, 128),
             slot_ids=torch.tensor([0, 1], dtype=torch.int32),
             plan=qla_serve.plan_prefill([6, 4], HV, HK, device="cpu"))
    a.update(over)
    return a


def _prefill(a, **kw):
    return qla_serve.gdn_prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], a["pool"],
                                 a["slot_ids"], a["plan"], **kw)


@pytest.mark.parametrize("over,exc,match", [
    (dict(q=torch.randn(T, HK, 64)), ValueError, "q: expected head dim 128"),
    (dict(v=torch.randn(T, 3, 128)), ValueError, "v: expected a value-head count"),
    (dict(k=torch.randn(T, HK, 128).half()), TypeError, "k: expected q's dtype"),
    (dict(q=torch.randn(T, HK, 128).to(torch.int8)), TypeError, "q: expected dtype"),
    (dict(g=-torch.rand(T, HV).double()), TypeError, "g: expected dtype"),
    (dict(beta=torch.rand(T, HV + 1)), ValueError, "beta: expected shape"),
    (dict(pool=torch.zeros(4, HV, 128, 64)), ValueError, "pool: expected shape"),
    (dict(pool=torch.zeros(4, HV, 128, 128).half()), TypeError, "pool: expected dtype"),
    (dict(slot_ids=torch.tensor([0, 4], dtype=torch.int32)), ValueError, "slot_ids: expected ids < 4"),
    (dict(slot_ids=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "slot_ids: expected distinct"),
    (dict(slot_ids=torch.tensor([0.0, 1.0])), TypeError, "slot_ids: expected dtype"),
    (dict(slot_ids=torch.tensor([0], dtype=torch.int32)), ValueError, "slot_ids: expected shape"),
    (dict(plan=qla_serve.plan_prefill([5, 4], HV, HK, device="cpu")), ValueError, "plan: expected a plan for 10 tokens"),
    (dict(plan=qla_serve.plan_prefill([6, 4], 8, HK, device="cpu")), ValueError, "plan: expected a plan for 2/4"),
    (dict(q=torch.randn(T, HK, 256)[..., ::2]), ValueError, "q: expected a contiguous last dim"),
    # q/k and v in different dtypes: only fp16 q/k beside bf16 v (gdn_prefill_inputs' qk_dtype)
    (dict(v=torch.randn(T, HV, 128).bfloat16()), TypeError,
     r"v: expected q's dtype torch.float32 \(or torch.bfloat16 beside float16 q/k\)"),
    (dict(q=torch.randn(T, HK, 128).bfloat16(), k=torch.randn(T, HK, 128).bfloat16(),
          v=torch.randn(T, HV, 128).half()), TypeError, "v: expected q's dtype torch.bfloat16"),
])
def test_prefill_bad_input(over, exc, match):
    a = _prefill_args(**over)
    pool_before = a["pool"].clone()
    with pytest.raises(exc, match=match):
        _prefill(a)
    assert torch.equal(a["pool"], pool_before)


def test_prefill_bad_has_initial_state_and_out():
    a = _prefill_args()
    with pytest.raises(TypeError, match="has_initial_state"):
        _prefill(a, has_initial_state=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="out: expected shape"):
        _prefill(a, out=torch.empty(T, HV, 64))


def test_strided_qkv_views_accepted():
    """Engines pass q/k/v as strided views of one fused projection."""
    fused = torch.randn(T, (2 * HK + HV) * 128)
    q = fused[:, : HK * 128].view(T, HK, 128)
    k = fused[:, HK * 128: 2 * HK * 128].view(T, HK, 128)
    v = fused[:, 2 * HK * 128:].view(T, HV, 128)
    a = _prefill_args(q=q, k=k, v=v)
    o = _prefill(a)
    assert o.shape == (T, HV, 128) and torch.isfinite(o).all()


def test_prefill_fp16_qk_beside_bf16_v():
    """fp16 q/k beside bf16 v (the engine layers' form): accepted, the output in v's dtype, the
    same result as the reference on those inputs; decode keeps one dtype."""
    from qla_serve.kernels import reference

    q = reference.l2norm(torch.randn(T, HK, 128)).half()
    k = reference.l2norm(torch.randn(T, HK, 128)).half()
    a = _prefill_args(q=q, k=k, v=torch.randn(T, HV, 128).bfloat16(), pool=torch.randn(4, HV, 128, 128))
    want_pool = a["pool"].clone()
    o = _prefill(a)
    assert o.dtype == torch.bfloat16 and o.shape == (T, HV, 128)
    o_ref, final = reference.recurrent_gdn(q.double(), k.double(), a["v"].double(), a["g"].double(),
                                           a["beta"].double(), [0, 6, 10], want_pool[:2].double(), 128**-0.5)
    assert (o.double() - o_ref).norm() / o_ref.norm() < 5e-3  # bf16 output rounding
    assert torch.allclose(a["pool"][:2].double(), final, rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="out: expected dtype"):
        _prefill(a, out=torch.empty(T, HV, 128, dtype=torch.float16))
    with pytest.raises(TypeError, match="v: expected q's dtype torch.float16, got torch.bfloat16"):
        qla_serve.gdn_decode(q[:2], k[:2], a["v"][:2], a["pool"], a["slot_ids"], g=a["g"][:2], beta=a["beta"][:2])


def test_prefill_qk_dtype_follows_the_prefill_path(monkeypatch):
    """fp16 only for bf16 q where prefill runs the TileLang kernels. On this CPU machine the
    path is the reference (None: q's dtype); the TileLang branch is reached by replacing the
    path lookup (ops._path), since the TileLang path cannot run without a GPU."""
    from qla_serve import ops

    q = torch.zeros(2, HK, 128, dtype=torch.bfloat16)
    assert qla_serve.prefill_qk_dtype(q) is None
    assert qla_serve.prefill_qk_dtype(q.half()) is None
    seen = []
    monkeypatch.setattr(ops, "_path", lambda op, device, dtype: seen.append((op, dtype)) or "tilelang")
    assert qla_serve.prefill_qk_dtype(q) is torch.float16
    assert qla_serve.prefill_qk_dtype(q.half()) is None  # already fp16: nothing to ask for
    assert seen == [("prefill", torch.bfloat16)]
    monkeypatch.setattr(ops, "_path", lambda op, device, dtype: "fla")
    assert qla_serve.prefill_qk_dtype(q) is None  # FLA's fallback takes one dtype


def test_decode_gating_forms():
    B = 3
    q, k, v = torch.randn(B, HK, 128), torch.randn(B, HK, 128), torch.randn(B, HV, 128)
    pool, ids = torch.zeros(4, HV, 128, 128), torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="expected one gating form.*got neither"):
        qla_serve.gdn_decode(q, k, v, pool, ids)
    with pytest.raises(ValueError, match="beta: expected"):
        qla_serve.gdn_decode(q, k, v, pool, ids, g=torch.zeros(B, HV))
    with pytest.raises(ValueError, match="one gating form"):
        qla_serve.gdn_decode(q, k, v, pool, ids, g=torch.zeros(B, HV), beta=torch.ones(B, HV),
                             a=torch.zeros(B, HV))
    with pytest.raises(ValueError, match="A_log"):
        qla_serve.gdn_decode(q, k, v, pool, ids, a=torch.zeros(B, HV), b=torch.zeros(B, HV),
                             dt_bias=torch.zeros(HV))


def test_verify_bad_cu_seqlens_and_depth():
    q, k, v = torch.randn(5, HK, 128), torch.randn(5, HK, 128), torch.randn(5, HV, 128)
    g, beta = -torch.rand(5, HV), torch.rand(5, HV)
    pool = torch.zeros(3, HV, 128, 128)
    inter = torch.zeros(2, 3, HV, 128, 128)
    ids = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing"):
        qla_serve.gdn_verify(q, k, v, pool, ids, torch.tensor([0, 4, 3]), inter, ids, g=g, beta=beta)
    with pytest.raises(ValueError, match="cu_seqlens: expected at most"):
        qla_serve.gdn_verify(q, k, v, pool, ids, torch.tensor([0, 1, 5]), inter, ids, g=g, beta=beta)
    with pytest.raises(TypeError, match="intermediate: expected dtype"):
        qla_serve.gdn_verify(q, k, v, pool, ids, torch.tensor([0, 2, 5]), inter.bfloat16(), ids, g=g, beta=beta)


def test_forced_unavailable_path_raises(monkeypatch):
    monkeypatch.setenv("QLA_SERVE_OP_PATH", "tilelang")
    with pytest.raises(RuntimeError, match="QLA_SERVE_OP_PATH=tilelang"):
        qla_serve.explain_path("prefill", "cpu")
    monkeypatch.setenv("QLA_SERVE_OP_PATH", "bogus")
    with pytest.raises(ValueError, match="QLA_SERVE_OP_PATH"):
        qla_serve.explain_path("prefill", "cpu")


def test_prefill_checks_run_once_per_plan_and_metadata(monkeypatch):
    """gdn_prefill records in the plan that arguments with this metadata (dtype, shape, strides,
    device of every tensor) passed its checks, so a step's other GDN layers skip them; any
    argument with other metadata is checked again and still fails by name. Tensors on the meta
    device stand in for CUDA ones (values the checks must not read anyway), and the dispatch is
    a recorder: the kernels need a GPU (tests/test_gpu_paths.py runs the real thing)."""
    from qla_serve import ops

    checks, runs = [], []
    real_check = ops._check_prefill
    monkeypatch.setattr(ops, "_check_prefill", lambda *a: (checks.append(1), real_check(*a)))
    monkeypatch.setattr(ops, "_run", lambda op, *a, **kw: runs.append(kw["out"]))
    meta = torch.device("meta")
    plan = qla_serve.plan_prefill([6, 4], HV, HK, device=meta)

    def args(**over):
        a = _prefill_args(plan=plan, **over)
        return {k: x.to(meta) if isinstance(x, torch.Tensor) else x for k, x in a.items()}

    layer1, layer2 = args(), args()
    assert layer1["q"] is not layer2["q"]
    _prefill(layer1)
    _prefill(layer2)
    assert len(checks) == 1 and len(runs) == 2 and runs[1].shape == (T, HV, 128)
    with pytest.raises(TypeError, match="g: expected dtype"):
        _prefill(args(g=-torch.rand(T, HV).double()))
    with pytest.raises(ValueError, match="pool: expected shape"):
        _prefill(args(pool=torch.zeros(4, HV, 128, 64)))
    assert len(checks) == 3 and len(runs) == 2
    # slot ids on the CPU (the reference path's inputs): their values are checked, on every call
    cpu = _prefill_args()
    _prefill(cpu)
    _prefill(cpu)
    assert len(checks) == 5


def test_decode_and_verify_checks_run_once_per_metadata(monkeypatch):
    """gdn_decode / gdn_verify remember (bounded, process-wide) which argument metadata passed
    their checks: an engine's other GDN layers of the step skip them, anything with other
    metadata is checked again and fails by name. As in the prefill test above, meta-device
    tensors stand in for CUDA ones and the dispatch is a recorder (the kernels need a GPU);
    index tensors on the CPU have their values checked on every call."""
    from qla_serve import ops

    checked, runs = [], []
    real_inputs = ops._check_step_inputs
    monkeypatch.setattr(ops, "_check_step_inputs", lambda *a: (checked.append(1), real_inputs(*a))[1])
    monkeypatch.setattr(ops, "_run", lambda op, *a, **kw: runs.append(kw["out"]))
    monkeypatch.setattr(ops, "_checked_steps", {})
    meta = torch.device("meta")
    B = 3

    def decode_args(device=meta, **over):
        a = dict(q=torch.empty(B, HK, 128), k=torch.empty(B, HK, 128), v=torch.empty(B, HV, 128),
                 pool=torch.empty(4, HV, 128, 128), slot_ids=torch.tensor([0, 1, 2], dtype=torch.int32),
                 a=torch.empty(B, HV), b=torch.empty(B, HV), A_log=torch.empty(HV), dt_bias=torch.empty(HV))
        a.update(over)
        return {n: x.to(device) for n, x in a.items()}

    for _ in range(3):  # three layers: fresh tensors, same metadata
        out = qla_serve.gdn_decode(**decode_args())
    assert len(checked) == 1 and len(runs) == 3 and out.shape == (B, HV, 128)
    with pytest.raises(ValueError, match="pool: expected shape"):
        qla_serve.gdn_decode(**decode_args(pool=torch.empty(4, HV, 128, 64)))
    with pytest.raises(TypeError, match="slot_ids: expected dtype"):
        qla_serve.gdn_decode(**decode_args(slot_ids=torch.empty(B)))
    assert len(runs) == 3
    for _ in range(2):  # CPU slot ids: values checked on every call
        with pytest.raises(ValueError, match="slot_ids: expected distinct"):
            qla_serve.gdn_decode(**decode_args(device="cpu", slot_ids=torch.tensor([1, 1, 2], dtype=torch.int32)))

    checked.clear()
    inter, cu = torch.empty(2, 3, HV, 128, 128, device=meta), torch.empty(3, dtype=torch.int32, device=meta)
    ids = torch.empty(2, dtype=torch.int32, device=meta)
    x = decode_args(q=torch.empty(5, HK, 128), k=torch.empty(5, HK, 128), v=torch.empty(5, HV, 128),
                    a=torch.empty(5, HV), b=torch.empty(5, HV))
    for _ in range(2):
        qla_serve.gdn_verify(x["q"], x["k"], x["v"], x["pool"], ids, cu, inter, ids, a=x["a"], b=x["b"],
                             A_log=x["A_log"], dt_bias=x["dt_bias"])
    assert len(checked) == 1 and len(runs) == 5
    with pytest.raises(TypeError, match="intermediate: expected dtype"):
        qla_serve.gdn_verify(x["q"], x["k"], x["v"], x["pool"], ids, cu, inter.bfloat16(), ids, a=x["a"],
                             b=x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"])


def test_prefill_inputs_on_the_reference_path():
    """gdn_prefill_inputs on CPU tensors (the reference path): exactly reference.l2norm and
    reference.fused_gating, on strided views of one projection as the engines pass them and with
    SGLang's dtypes (fp32 A_log beside a bf16 dt_bias); without gates, q and k only."""
    from qla_serve.kernels import reference

    fused = torch.randn(T, (2 * HK + HV) * 128).bfloat16()
    q, k = fused[:, : HK * 128].view(T, HK, 128), fused[:, HK * 128: 2 * HK * 128].view(T, HK, 128)
    ab = torch.randn(T, 2 * HV).bfloat16()
    a, b = ab[:, :HV], ab[:, HV:]
    A_log, dt_bias = torch.rand(HV), torch.randn(HV).bfloat16()
    qn, kn, g, beta = qla_serve.gdn_prefill_inputs(q, k, a, b, A_log, dt_bias)
    g_ref, beta_ref = reference.fused_gating(a, b, A_log, dt_bias)
    assert torch.equal(qn, reference.l2norm(q)) and torch.equal(kn, reference.l2norm(k))
    assert torch.equal(g, g_ref) and torch.equal(beta, beta_ref)
    assert qn.is_contiguous() and qn.dtype == torch.bfloat16 and g.dtype == torch.float32
    qn2, kn2, g2, beta2 = qla_serve.gdn_prefill_inputs(q, k)
    assert torch.equal(qn2, qn) and torch.equal(kn2, kn) and g2 is None and beta2 is None
    # qk_dtype=float16 (the layers' form): the same fp32 math rounded to fp16
    qh, kh, g3, _ = qla_serve.gdn_prefill_inputs(q, k, a, b, A_log, dt_bias, qk_dtype=torch.float16)
    assert qh.dtype == kh.dtype == torch.float16 and torch.equal(g3, g_ref)
    assert torch.equal(qh, reference.l2norm(q.float()).half()) and torch.equal(kh, reference.l2norm(k.float()).half())
    with pytest.raises(TypeError, match="qk_dtype: expected None, q's dtype"):
        qla_serve.gdn_prefill_inputs(q, k, qk_dtype=torch.float32)


@pytest.mark.parametrize("over,exc,match", [
    (dict(k=torch.randn(T, HK, 128).half()), TypeError, "k: expected q's dtype"),
    (dict(k=torch.randn(T + 1, HK, 128).bfloat16()), ValueError, "k: expected shape"),
    (dict(a=torch.randn(T, HV + 1).bfloat16()), ValueError, "b: expected shape"),
    (dict(a=torch.randn(T, 3).bfloat16(), b=torch.randn(T, 3).bfloat16(), A_log=torch.rand(3),
          dt_bias=torch.rand(3)), ValueError, "a: expected a value-head count"),
    (dict(A_log=None), ValueError, "A_log: expected a tensor"),
    (dict(dt_bias=torch.rand(HV).to(torch.int32)), TypeError, "dt_bias: expected dtype"),
])
def test_prefill_inputs_bad_input(over, exc, match):
    args = dict(q=torch.randn(T, HK, 128).bfloat16(), k=torch.randn(T, HK, 128).bfloat16(),
                a=torch.randn(T, HV).bfloat16(), b=torch.randn(T, HV).bfloat16(), A_log=torch.rand(HV),
                dt_bias=torch.rand(HV))
    args.update(over)
    with pytest.raises(exc, match=match):
        qla_serve.gdn_prefill_inputs(**args)


def test_env_reads_follow_os_environ(monkeypatch):
    """_validate.env (the per-call switch reads) sees what os.environ's setters and deletes do,
    as os.environ.get does."""
    from qla_serve import _validate as V

    monkeypatch.delenv("QLA_SERVE_OP_PATH", raising=False)
    assert V.env("QLA_SERVE_OP_PATH") is None and V.env("QLA_SERVE_OP_PATH", "auto") == "auto"
    monkeypatch.setenv("QLA_SERVE_OP_PATH", "reference")
    assert V.env("QLA_SERVE_OP_PATH") == "reference" == os.environ.get("QLA_SERVE_OP_PATH")
    monkeypatch.setenv("QLA_SERVE_DEBUG", "1")
    assert V.debug_checks()
    monkeypatch.setenv("QLA_SERVE_DEBUG", "0")
    assert not V.debug_checks()
    monkeypatch.delenv("QLA_SERVE_OP_PATH")
    assert V.env("QLA_SERVE_OP_PATH") is None
