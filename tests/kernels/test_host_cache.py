"""The TMA descriptor memo (qla_serve/kernels/hopper/host_cache.py, csrc/tensormap_cache.cc).

The CPU tests compile the real wrapper with the host's C++ compiler and put it in front of a
stand-in encoder registered as a tvm-ffi global from Python, because TileLang's real encoder
needs the CUDA driver. The stand-in writes 128 bytes derived from its arguments, as
cuTensorMapEncodeTiled writes a tensor map, and counts its calls, so each test sees exactly
which calls the memo answered. The GPU test runs the real encoder through prefill launches.
"""

import ctypes
import itertools
import shutil

import pytest
import torch

tvm_ffi = pytest.importorskip("tvm_ffi")
pytest.importorskip("tilelang")

from qla_serve.kernels.hopper import host_cache  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="needs a C++ compiler")

_names = itertools.count()


@pytest.fixture
def stand_in(tmp_path):
    """A fresh global 'encoder' wrapped by the memo: (call function, calls list, name)."""
    name = f"qla_test.encode{next(_names)}"
    calls = []

    def encode(ptr, *args):
        if args and args[0] == -1:
            raise ValueError("bad descriptor arguments")   # as TileLang's checks refuse one
        calls.append(args)
        buf = (ctypes.c_ubyte * 128).from_address(ptr.value)
        for i in range(128):
            buf[i] = (sum(args) * 31 + i) % 251
        return 0

    tvm_ffi.register_global_func(name, encode)
    host_cache.wrap(name, tmp_path / "memo.so")
    return tvm_ffi.get_global_func(name), calls, name


def _map():
    out = (ctypes.c_ubyte * 128)()
    return out, ctypes.c_void_p(ctypes.addressof(out))


def test_repeat_copies_the_first_encode(stand_in):
    f, calls, name = stand_in
    a, pa = _map()
    args = (9, 3, 0x7F0000001000, 128, 4096, 8, 2, 64, 64, 1, 1, 1, 0, 3, 2, 0)
    assert f(pa, *args) == 0
    first = bytes(a)
    b, pb = _map()
    assert f(pb, *args) == 0
    assert len(calls) == 1, "the repeat reached the encoder"
    assert bytes(b) == first
    assert host_cache.stats(name) == {"hits": 1, "misses": 1, "entries": 1}


def test_any_argument_changed_is_a_miss(stand_in):
    f, calls, _ = stand_in
    args = [9, 3, 0x7F0000001000, 128, 4096, 8, 2, 64, 64, 1, 1, 1, 0, 3, 2, 0]
    _, p = _map()
    f(p, *args)
    for i in range(len(args)):
        changed = list(args)
        changed[i] += 1
        out, p = _map()
        f(p, *changed)
        assert len(calls) == i + 2, f"argument {i} changed but the memo answered"
        expect, pe = _map()
        calls_before = len(calls)
        f(pe, *changed)                     # now a hit: same bytes as the encode wrote
        assert len(calls) == calls_before and bytes(expect) == bytes(out)


def test_failed_encode_raises_and_is_not_kept(stand_in):
    f, calls, name = stand_in
    _, p = _map()
    for _ in range(2):
        with pytest.raises(ValueError, match="bad descriptor"):
            f(p, -1, 3, 0x1000)
    assert host_cache.stats(name)["entries"] == 0


def test_switched_off_every_call_encodes(stand_in):
    f, calls, name = stand_in
    _, p = _map()
    f(p, 1, 2, 3)
    host_cache.set_enabled(False, name)
    f(p, 1, 2, 3)
    f(p, 1, 2, 3)
    assert len(calls) == 3 and host_cache.stats(name)["entries"] == 0
    host_cache.set_enabled(True, name)
    f(p, 1, 2, 3)
    f(p, 1, 2, 3)
    assert len(calls) == 4


def test_wrapping_twice_and_unknown_names(stand_in, tmp_path):
    f, calls, name = stand_in
    host_cache.wrap(name, tmp_path / "memo.so")            # idempotent: still one memo
    _, p = _map()
    f(p, 5)
    f(p, 5)
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match="not registered"):
        host_cache.wrap("qla_test.no_such_function", tmp_path / "memo.so")
    with pytest.raises(RuntimeError, match="no TMA descriptor memo"):
        host_cache.set_enabled(False, "qla_test.no_such_function")


def test_env_switch_leaves_tilelang_alone(monkeypatch):
    monkeypatch.setattr(host_cache, "_STATE", None)
    monkeypatch.setenv(host_cache.ENV, "0")
    assert host_cache.install() == "off"


def test_env_switch_takes_0_or_1(monkeypatch):
    monkeypatch.setattr(host_cache, "_STATE", None)
    monkeypatch.setenv(host_cache.ENV, "yes")
    with pytest.raises(ValueError, match="QLA_SERVE_TENSORMAP_CACHE: expected 0 or 1"):
        host_cache.install()


def test_no_compiler_warns_once_and_runs_without(monkeypatch, tmp_path):
    monkeypatch.setattr(host_cache, "_STATE", None)
    monkeypatch.setattr(host_cache, "_LIB", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(host_cache, "library_path", lambda: tmp_path / "absent.so")
    with pytest.warns(RuntimeWarning, match="TMA descriptor memo not available"):
        assert host_cache.install() == "unavailable"
    assert host_cache.install() == "unavailable"   # decided once per process


def test_tilelang_encoder_is_the_one_wrapped(monkeypatch):
    """install() wraps TileLang's real encoder global (not called here: it needs the driver)."""
    monkeypatch.setattr(host_cache, "_STATE", None)
    monkeypatch.delenv(host_cache.ENV, raising=False)
    assert host_cache.install() == "installed"
    assert host_cache.stats() is not None


@pytest.mark.gpu
def test_prefill_with_memo_matches_encoding_every_launch():
    """Two prefill calls on the same buffers: the second's descriptors all come from the memo,
    and outputs and final states are bit-identical to calls that encode every descriptor."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import qla_serve
    from qla_serve.kernels.hopper import prefill_launch

    assert host_cache.install() == "installed"
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens, hk, hv = [300, 64, 1000], 2, 8
    T = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(T, hk, 128, device="cuda", generator=gen), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(T, hk, 128, device="cuda", generator=gen), dim=-1).bfloat16()
    v = torch.randn(T, hv, 128, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(T, hv, device="cuda", generator=gen) * 0.2
    beta = torch.rand(T, hv, device="cuda", generator=gen)
    init = torch.randn(len(lens) + 2, hv, 128, 128, device="cuda", generator=gen) * 0.1
    slots = torch.tensor([3, 0, 2], dtype=torch.int32, device="cuda")
    plan = qla_serve.plan_prefill(lens, hv, hk, device="cuda")

    def run():
        pool, out = init.clone(), torch.empty_like(v)
        for _ in range(2):
            pool.copy_(init)
            prefill_launch.prefill(q, k, v, g, beta, pool, slots, plan, has_initial_state=None,
                                   scale=None, out=out)
        torch.cuda.synchronize()
        return out, pool

    try:
        host_cache.set_enabled(False)
        out_ref, pool_ref = run()
        host_cache.set_enabled(True)
        before = host_cache.stats()
        out, pool = run()
        after = host_cache.stats()
    finally:
        host_cache.set_enabled(True)
    assert after["hits"] > before["hits"], "no descriptor came from the memo"
    assert torch.equal(out.view(torch.int16), out_ref.view(torch.int16))
    assert torch.equal(pool.view(torch.int32), pool_ref.view(torch.int32))
