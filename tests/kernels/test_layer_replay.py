"""The launch replay of a step's later GDN layers (backends/launch_replay.py) against the ops'
own host code, launch by launch, on the CPU.

As in test_kernel_launches.py, the compiled kernels are the one stand-in (launch_check: a launch
records its arguments, checked against its program, instead of running) and the tensors live on
the meta device; the step plans, the layer, the ops, the kernel modules' launch code and the
replay are the real ones. Each layer of a step has its own weights, caches and activations, as
in an engine. A step's layers run with the replay on, then its replayed layers run again on the
same step with it off (the ops' host code, their checks passed): both must launch the same
kernels with the same arguments (the same tensor, or a view of the same memory with the same
shape, strides and dtype; the same scalars).
"""

from types import SimpleNamespace

import pytest
import torch

from qla_serve.backends import gdn_layer as GL
from qla_serve.backends import launch_replay

from launch_check import ARCHS, record_arch_launches

D = 128
BF16 = torch.bfloat16
DEV = torch.device("meta")
LAYERS = 6


@pytest.fixture(params=sorted(ARCHS))
def launches(request, monkeypatch):
    return record_arch_launches(monkeypatch, request.param)


def _t(data, dtype=torch.int32):
    return torch.tensor(data, dtype=dtype, device=DEV)


def _layers(n, T, slots, hk, hv, pool_dtype=torch.float32, spec_cols=0, bias=True):
    """``n`` layers' arguments for gdn_layer_forward: each its own tensors (vLLM's shapes)."""
    dim = (2 * hk + hv) * D

    def one():
        return dict(mixed_qkv=torch.randn(T, dim, dtype=BF16, device=DEV),
                    a=torch.randn(T, hv, dtype=BF16, device=DEV), b=torch.randn(T, hv, dtype=BF16, device=DEV),
                    conv_weight=torch.randn(dim, 4, dtype=BF16, device=DEV),
                    conv_bias=torch.randn(dim, dtype=BF16, device=DEV) if bias else None, activation="silu",
                    conv_state=torch.zeros(slots, dim, 3 + spec_cols, dtype=BF16, device=DEV),
                    ssm_state=torch.zeros(slots, hv, D, D, dtype=pool_dtype, device=DEV),
                    A_log=torch.zeros(hv, device=DEV), dt_bias=torch.zeros(hv, dtype=BF16, device=DEV),
                    num_k_heads=hk, out=torch.zeros(T, hv, D, dtype=BF16, device=DEV), scale=D ** -0.5)
    return [one() for _ in range(n)]


def _forward(step, layer):
    kw = dict(layer)
    GL.gdn_layer_forward(step, kw.pop("mixed_qkv"), kw.pop("a"), kw.pop("b"), **kw)


def _same_argument(x, y, same_storage=None) -> bool:
    """The same scalar, or a tensor view of the same memory (``same_storage``: a storage of the
    replayed call that stands for one of the other call's: an output each call allocates)."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        vx, vy = launch_replay._view(x), launch_replay._view(y)
        if same_storage and vx[0] == same_storage[0]:
            vx = (same_storage[1], *vx[1:])
        return vx == vy
    return type(x) is type(y) and x == y


def _run_and_compare(launches, monkeypatch, step, layers, forward=None):
    """Every layer with the replay on, then the replayed ones again with it off; returns the
    replayed layer count. ``forward(layer)``: one layer call (default: gdn_layer_forward),
    returning the output tensor it allocated, if it does."""
    forward = forward or (lambda layer: _forward(step, layer))
    per_layer = []
    for layer in layers:
        start = len(launches)
        out = forward(layer)
        per_layer.append((launches[start:], out))
    replayed = step._replays.replayed
    monkeypatch.setattr(GL, "LAUNCH_REPLAY", False)
    for i in range(len(layers) - replayed, len(layers)):
        start = len(launches)
        out = forward(layers[i])
        own, (got_launches, got_out) = launches[start:], per_layer[i]
        same = None if out is None else (got_out.untyped_storage()._cdata, out.untyped_storage()._cdata)
        assert [c.name for c in got_launches] == [c.name for c in own], i
        for got, want in zip(got_launches, own):
            bad = [name for name in want.args if not _same_argument(got.args[name], want.args[name], same)]
            assert not bad, f"layer {i}, {want.name}: replayed arguments differ in {bad}"
    assert step._replays.replayed == replayed   # the off run replayed nothing
    return replayed


def _plain_step(decodes, lens, hk, hv, checkpoints=False):
    n = decodes + len(lens)
    kw = dict(decode_slots=torch.arange(1, decodes + 1, dtype=torch.int32, device=DEV)) if decodes else {}
    if lens:
        kw.update(prefill_lens=lens, prefill_slots=torch.arange(decodes + 1, n + 1, dtype=torch.int32, device=DEV),
                  prefill_has_initial_state=_t([i % 2 == 1 for i in range(len(lens))], torch.bool))
        if checkpoints:
            kw.update(prefill_checkpoint_chunks=[1] * len(lens),
                      prefill_checkpoint_slots=torch.arange(n + 1, n + 1 + len(lens), dtype=torch.int32, device=DEV))
    T = decodes + sum(lens)
    step = GL.make_step_plan(num_actual_tokens=T, num_v_heads=hv, num_k_heads=hk, conv_width=4, device=DEV, **kw)
    return step, T, 2 * n + 2


STEPS = {   # decodes, prefill lengths, heads, checkpoints
    "decode 1": (1, [], 2, 8, False),
    "decode 64": (64, [], 2, 8, False),
    "decode 256": (256, [], 2, 8, False),
    "prefill 16 x 512": (0, [512] * 16, 2, 8, False),
    "mixed": (32, [512] * 4, 2, 8, False),
    "mixed, checkpoints": (2, [70, 150], 2, 8, True),
    "prefill 4 x 8192 (CP)": (0, [8192] * 4, 2, 8, False),
    "mixed 16/64": (32, [512] * 4, 16, 64, False),
    "decode 64 at 16/32": (64, [], 16, 32, False),
}


@pytest.mark.parametrize("pool_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("case", list(STEPS))
def test_replay_launches_what_the_ops_launch(launches, monkeypatch, case, pool_dtype):
    """Non-spec steps: layer 0 checks, layers 1 and 2 record, the rest replay the same launches
    as the ops would make."""
    decodes, lens, hk, hv, checkpoints = STEPS[case]
    step, T, slots = _plain_step(decodes, lens, hk, hv, checkpoints)
    layers = _layers(LAYERS, T, slots, hk, hv, pool_dtype, bias=hk == 2)
    assert _run_and_compare(launches, monkeypatch, step, layers) == LAYERS - 2, step._replays.refused


def _spec_step(with_prefill: bool, checkpoints: bool = False, leading: bool = False):
    spec_lens, pre_lens = [3, 2], [150] if with_prefill else []
    Ts, T = sum(spec_lens), sum(spec_lens) + sum(pre_lens)
    kw = dict(spec_slots=_t([[4, 5, 6], [10, 11, 12]]), spec_cu_seqlens=_t([0, 3, 5]), num_accepted=_t([2, 1]),
              num_spec_tokens=Ts)
    if with_prefill:
        kw.update(prefill_lens=pre_lens, prefill_slots=_t([2]), prefill_has_initial_state=_t([True], torch.bool))
    if with_prefill and not leading:
        perm = torch.randperm(T, generator=torch.Generator().manual_seed(0))
        kw.update(spec_token_idx=perm[:Ts].sort().values.int().to(DEV),
                  non_spec_token_idx=perm[Ts:].sort().values.int().to(DEV))
    if checkpoints:
        kw.update(prefill_checkpoint_chunks=[2], prefill_checkpoint_slots=_t([14]))
    return GL.make_step_plan(num_actual_tokens=T, num_v_heads=8, num_k_heads=2, conv_width=4, device=DEV, **kw), T


@pytest.mark.parametrize("with_prefill,checkpoints,leading",
                         [(False, False, False), (True, False, False), (True, True, False), (True, True, True)],
                         ids=["spec only", "spec and prefill", "spec and prefill, checkpoints",
                              "spec tokens leading, checkpoints"])
def test_replay_of_spec_steps(launches, monkeypatch, with_prefill, checkpoints, leading):
    """vLLM's spec steps (the spec rows gathered by index where prefills interleave: the gathers
    and the scatters back into ``out`` run on every call, outside the replay; row views where the
    spec tokens lead), and the step of vLLM 0.33's GPU defaults: MTP beside a chunked prefill
    writing an align-mode checkpoint."""
    step, T = _spec_step(with_prefill, checkpoints, leading)
    layers = _layers(LAYERS, T, 20, 2, 8, spec_cols=2)
    assert _run_and_compare(launches, monkeypatch, step, layers) == LAYERS - 2, step._replays.refused
    assert any(c.name.startswith("gdn_conv_prefill_state") for c in launches) == checkpoints


def _sglang_model(layers: int, pool_dtype, hk=2, hv=8, slots=24):
    """SGLang 0.5.23's per-layer views of its mamba pool (``mamba2_layer_cache(layer_id)``: a new
    object per call over the pool's layer) and each layer's RadixLinearAttention attributes (the
    stand-ins of tests/backends/sglang_plugin/test_{decode,extend}_layer.py)."""
    dim = (2 * hk + hv) * D
    conv = torch.zeros(layers, slots, dim, 3, dtype=BF16, device=DEV)
    ssm = torch.zeros(layers, slots, hv, D, D, dtype=pool_dtype, device=DEV)
    attns = [SimpleNamespace(layer_id=i, conv_weights=torch.randn(dim, 4, dtype=BF16, device=DEV), bias=None,
                             activation="silu", num_k_heads=hk, num_v_heads=hv, head_k_dim=D,
                             A_log=torch.zeros(hv, device=DEV), dt_bias=torch.zeros(hv, dtype=BF16, device=DEV))
             for i in range(layers)]
    pool = SimpleNamespace(mamba2_layer_cache=lambda i: SimpleNamespace(conv=[conv[i]], temporal=ssm[i]))
    return pool, attns, dim


@pytest.mark.parametrize("pool_dtype", [torch.float32, BF16])
def test_replay_of_sglang_decode_and_extend_steps(launches, monkeypatch, pool_dtype):
    """SGLang's decode and extend steps as the plugin runs them (backends/sglang/decode_layer.py,
    extend_layer.py), each layer on its own view of SGLang's pools and a fresh output."""
    from qla_serve.backends.sglang import decode_layer, extend_layer
    from qla_serve.backends.sglang.kernel import ExtendBatch

    pool, attns, dim = _sglang_model(LAYERS, pool_dtype)
    ids = _t([5, 0, 17, -1])
    backend = SimpleNamespace(forward_metadata=SimpleNamespace(mamba_cache_indices=ids, replayssm_write_pos=None),
                              req_to_token_pool=pool, _track_mamba_state_decode=lambda *args: None)
    rows = [(torch.randn(4, dim, dtype=BF16, device=DEV), torch.randn(4, 8, dtype=BF16, device=DEV),
             torch.randn(4, 8, dtype=BF16, device=DEV)) for _ in attns]
    def decode(i):
        return decode_layer.forward_decode(backend, attns[i], None, *rows[i])
    decode(0)   # the pass's first layer makes its step (decode_layer._decode_step)
    step = backend.forward_metadata.qla_decode
    assert _run_and_compare(launches, monkeypatch, step, list(range(1, LAYERS)), decode) == LAYERS - 2, \
        step._replays.refused

    monkeypatch.setattr(GL, "LAUNCH_REPLAY", True)
    lens = [37, 130]
    qsl = _t([0, 37, 167])
    backend = SimpleNamespace(forward_metadata=SimpleNamespace(mamba_cache_indices=ids[:2] + 1, query_start_loc=qsl))
    fb = SimpleNamespace(extend_prefix_lens=_t([0, 12]))
    batch = ExtendBatch(query_start_loc=qsl, seq_lens=lens, num_tokens=sum(lens))
    T = sum(lens) + 3
    rows = [(torch.randn(T, dim, dtype=BF16, device=DEV), torch.randn(T, 8, dtype=BF16, device=DEV),
             torch.randn(T, 8, dtype=BF16, device=DEV)) for _ in attns]

    def extend(i):
        return extend_layer.forward_extend(backend, attns[i], fb, *rows[i], batch, pool.mamba2_layer_cache(i))
    extend(0)
    step = batch.step
    assert _run_and_compare(launches, monkeypatch, step, list(range(1, LAYERS)), extend) == LAYERS - 2, \
        step._replays.refused


def test_a_layer_with_other_alignment_or_metadata_is_not_replayed(launches, monkeypatch):
    """A later layer whose tensor sits at another address modulo 16, or whose metadata differs,
    gets the ops' checks and host code, not the replay: a misaligned mixed_qkv is refused by
    name as on the step's first layer."""
    step, T, slots = _plain_step(32, [512] * 4, 2, 8)
    layers = _layers(5, T, slots, 2, 8)
    for layer in layers:
        _forward(step, layer)
    assert step._replays.replayed == 3
    bad = dict(_layers(1, T, slots, 2, 8)[0])
    bad["mixed_qkv"] = torch.randn(T * bad["mixed_qkv"].shape[1] + 1, dtype=BF16, device=DEV)[1:].view(T, -1)
    with pytest.raises(ValueError, match="mixed_qkv"):
        _forward(step, bad)
    other = dict(_layers(1, T, slots, 2, 8)[0], conv_bias=None)
    _forward(step, other)
    assert step._replays.replayed == 3


def test_a_layer_called_again_with_its_own_tensors_is_not_taken_for_the_step(launches):
    """A second recording on the first's tensors (a bench calling one layer over and over) proves
    nothing about which arguments are the step's own: the key waits for other tensors, and gives
    up after a few tries."""
    step, T, slots = _plain_step(32, [512] * 4, 2, 8)
    layer = _layers(1, T, slots, 2, 8)[0]
    for _ in range(6):
        _forward(step, layer)
    assert step._replays.replayed == 0
    assert list(step._replays.refused.values()) == ["the layer calls repeat the same tensors"]


def test_torch_calls_in_the_ops_host_code_stop_the_replay(launches, monkeypatch):
    """An op whose host code launches torch work (here a zero fill slipped into gdn_decode's
    kernel module) cannot be replayed by its raw launches alone: the watcher refuses the key
    and every layer runs the ops."""
    from qla_serve.kernels import blackwell, hopper

    for module in (hopper, blackwell):
        def with_a_fill(q, *args, out, _own=module.decode, **kw):
            out.zero_()
            _own(q, *args, out=out, **kw)
        monkeypatch.setattr(module, "decode", with_a_fill)
    step, T, slots = _plain_step(32, [512] * 4, 2, 8)
    for layer in _layers(LAYERS, T, slots, 2, 8):
        _forward(step, layer)
    assert step._replays.replayed == 0
    assert "zero_" in next(iter(step._replays.refused.values()))


def test_a_view_of_a_layer_tensor_made_in_the_ops_stops_the_replay(launches, monkeypatch):
    """A launch argument that the ops made from a layer tensor (here a fresh view of the pool in
    gdn_decode's kernel module) is neither a source of the call nor the step's own: replaying
    the recorded view would hand every later layer the recorded layer's pool. Refused."""
    from qla_serve.kernels import blackwell, hopper

    for module in (hopper, blackwell):
        def with_a_view(q, k, v, pool, *args, _own=module.decode, **kw):
            _own(q, k, v, pool.view(pool.shape), *args, **kw)
        monkeypatch.setattr(module, "decode", with_a_view)
    step, T, slots = _plain_step(32, [512] * 4, 2, 8)
    for layer in _layers(LAYERS, T, slots, 2, 8):
        _forward(step, layer)
    assert step._replays.replayed == 0
    assert list(step._replays.refused.values()) == [
        "argument 7 of a launch is a view of a layer tensor that the layer did not make"]


def test_an_op_off_the_tilelang_path_stops_the_replay(launches, monkeypatch):
    """An op dispatched to the reference or FLA path launches through torch or Triton, which no
    raw launch records: never replayed."""
    from qla_serve import ops

    own_path, own_module = ops._path, ops.path_module
    fla = SimpleNamespace(decode=lambda *a, **k: None)   # (FLA's decode, which these tests cannot run)
    monkeypatch.setattr(ops, "_path", lambda op, device, io_dtype: "fla" if op == "decode" else own_path(
        op, device, io_dtype))
    monkeypatch.setattr(ops, "path_module", lambda path, device, *ref: fla if path == "fla" else own_module(
        path, device, *ref))
    step, T, slots = _plain_step(32, [512] * 4, 2, 8)
    for layer in _layers(LAYERS, T, slots, 2, 8):
        _forward(step, layer)
    assert step._replays.replayed == 0
    assert "decode ran on the fla path" in step._replays.refused.values()


def test_a_replay_hands_each_launch_its_sources_and_constants_in_order():
    """launch_replay._Replay: a merged record's launches of 0, 1 and several arguments, sources and
    constants interleaved, replayed on new sources: each launch gets its arguments in its order,
    the parts go to on_call between them."""
    got = []
    merged = [("launch", lambda *a: got.append(("f", a)), ((True, 1), (False, "c0"), (True, 0), (False, 7))),
              ("part", "prefill", 2),
              ("launch", lambda *a: got.append(("g", a)), ((False, "c1"),)),
              ("launch", lambda *a: got.append(("h", a)), ()),
              ("launch", lambda *a: got.append(("k", a)), ((True, 2),))]
    replay = launch_replay._Replay(merged)
    launch_replay._replay(replay, ("s0", "s1", "s2"), lambda kind, count: got.append((kind, count)))
    assert got == [("f", ("s1", "c0", "s0", 7)), ("prefill", 2), ("g", ("c1",)), ("h", ()), ("k", ("s2",))]

