"""qla_serve installs beside the engine releases it supports: its own requirements admit every
version those engines pin.

The engines' exact pins of the packages qla_serve also requires, transcribed from the released
wheels' METADATA (``Requires-Dist``; the GPU wheels are 336 MB / 39 MB, so they are not
downloaded in CI):
  vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl, vllm-0.33.0.dist-info/METADATA;
  sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl, sglang-0.5.23.dist-info/METADATA.
Their other requirements of these packages are lower bounds (vLLM: ``pydantic>=2.12.0``,
``pyyaml``; SGLang: ``pydantic``). pip's resolver, run on 2026-12-04 with
``pip install --dry-run --ignore-installed --only-binary=:all: ".[vllm]"`` (and ``".[sglang]"``),
picked exactly these pins and qla_serve beside them (docs/vllm.md, docs/sglang.md); that run
downloads ~2 GB of wheels, so it is not a CI test.
"""

from __future__ import annotations

import os

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENGINE_PINS = {
    ("vllm", "0.33.0"): {"torch": "2.14.0", "tilelang": "0.1.12", "apache-tvm-ffi": "0.1.11",
                         "flashinfer-python": "0.7.2.post1"},
    ("sglang", "0.5.23"): {"torch": "2.14.1", "tilelang": "0.1.12", "apache-tvm-ffi": "0.1.11"},
}


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _ours() -> dict[str, Requirement]:
    return {Requirement(r).name.lower(): Requirement(r) for r in _project()["dependencies"]}


@pytest.mark.parametrize("engine,version", sorted(ENGINE_PINS))
def test_our_requirements_admit_the_engines_pins(engine, version):
    ours = _ours()
    for name, pinned in ENGINE_PINS[engine, version].items():
        # apache-tvm-ffi comes with tilelang; where qla_serve names a package, its range must hold the pin.
        if name in ours:
            assert ours[name].specifier.contains(pinned), (
                f"qla_serve requires {ours[name]}, but {engine} {version} pins {name}=={pinned}")
    assert "tilelang" in ours and "torch" in ours


@pytest.mark.parametrize("engine,version", sorted(ENGINE_PINS))
def test_the_engine_extra_is_the_supported_release(engine, version):
    (req,) = [Requirement(r) for r in _project()["optional-dependencies"][engine]]
    assert req.name == engine and req.specifier.contains(version), req


@pytest.mark.parametrize("engine,version", sorted(ENGINE_PINS))
def test_the_bench_extra_admits_the_engines_pins(engine, version):
    """`pip install 'qla_serve[bench]'` beside an engine keeps its pins: FlashInfer, the bench's
    baseline, at the version vLLM 0.33 runs (its stock GDN prefill and decode on Hopper)."""
    bench = {Requirement(r).name.lower(): Requirement(r) for r in _project()["optional-dependencies"]["bench"]}
    assert "flashinfer-python" in bench
    for name, pinned in ENGINE_PINS[engine, version].items():
        if name in bench:
            assert bench[name].specifier.contains(pinned), (
                f"qla_serve[bench] requires {bench[name]}, but {engine} {version} pins {name}=={pinned}")


def test_a_narrower_requirement_would_fail():
    """The check can fail: a tilelang floor above the engines' pin is refused."""
    assert not Requirement("tilelang>=0.1.13,<0.2").specifier.contains("0.1.12")
