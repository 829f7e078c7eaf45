"""qla_serve.deploy.startup: the kernels a deployment needs, built once at engine start-up
(vLLM's first GDN layer, SGLang's backend init) so that no request waits on a compile.

The compile test builds a real variant with TileLang + nvcc for sm_90a (no GPU) in a fresh
process with its own TILELANG_CACHE_DIR (TileLang reads it at import); the failure test uses a
stand-in kernel module whose build raises (a real kernel that fails to compile cannot be had on
purpose)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qla_serve.deploy import startup
from qla_serve.deploy.precompile import KernelModule

SCRIPT = r'''
import os, shutil
from qla_serve.deploy import startup
kw = dict(target="sm_90a", io_dtype="bfloat16", state_dtype="float32",
          match="^gdn_conv_decode_hv8_hk2_w4_bfloat16_cstate-bfloat16_wt-bfloat16_silu_b0$")
first = startup.ensure_kernels(8, 2, **kw)
print("FIRST", first)
print("SAME", startup.ensure_kernels(8, 2, **kw) is first)
startup._DONE.clear()                       # another process of the host, after the first
print("OTHER", startup.ensure_kernels(8, 2, **kw))
shutil.rmtree(os.path.join(startup.cache_dir(), "qla_serve_ready"))
startup._DONE.clear()                       # no marker: every kernel a disk hit
print("HITS", startup.ensure_kernels(8, 2, **kw))
'''


@pytest.mark.compile
def test_start_up_build_compiles_once_then_loads(tmp_path):
    env = {**os.environ, "TILELANG_CACHE_DIR": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("QLA_SERVE_STARTUP_COMPILE", None)
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in run.stdout.splitlines() if " " in ln}
    assert "1 TileLang kernels for heads 2/8, io bfloat16, state float32, sm_90a ready" in lines["FIRST"]
    assert "0 from the cache, 1 compiled" in lines["FIRST"]
    assert "`qla-serve precompile --heads 2/8 --arch sm_90a -j N`" in lines["FIRST"]
    assert lines["SAME"] == "True"
    assert "marked complete by another process or qla-serve precompile" in lines["OTHER"]
    assert "1 from the cache, 0 compiled" in lines["HITS"]


DAEMON_SCRIPT = r'''
import multiprocessing
from qla_serve.deploy import startup

def rank(queue):
    kw = dict(target="sm_90a", io_dtype="bfloat16", state_dtype="float32",
              match="^gdn_conv_decode_hv8_hk2_w4_bfloat16_cstate-bfloat16_wt-bfloat16_silu_b[01]$")
    try:
        queue.put(("LINE", startup.ensure_kernels(8, 2, **kw)))
    except Exception as e:
        queue.put(("ERROR", repr(e)))

if __name__ == "__main__":
    queue = multiprocessing.get_context("spawn").Queue()
    p = multiprocessing.get_context("spawn").Process(target=rank, args=(queue,), daemon=True)
    p.start()
    print(*queue.get(timeout=900))
    p.join()
'''


@pytest.mark.compile
def test_a_daemon_worker_compiles_in_several_processes(tmp_path):
    """The engines start their workers as daemon processes (vLLM's TP workers), which
    multiprocessing forbids children: QLA_SERVE_STARTUP_JOBS=2 there still builds in 2 processes
    (from a child interpreter), not one. Two real sm_90a variants, a fresh cache."""
    script = tmp_path / "rank.py"
    script.write_text(DAEMON_SCRIPT)
    env = {**os.environ, "TILELANG_CACHE_DIR": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": "",
           "QLA_SERVE_STARTUP_JOBS": "2"}
    env.pop("QLA_SERVE_STARTUP_COMPILE", None)
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.startswith("LINE "), run.stdout[-2000:] + run.stderr[-3000:]
    assert "2 TileLang kernels for heads 2/8" in run.stdout
    assert "0 from the cache, 2 compiled in 2 processes" in run.stdout, run.stdout


def test_a_build_failure_stops_the_start_up(monkeypatch, tmp_path):
    def kernel_variants(hv, hk):
        return [{"name": f"fake_ok_hv{hv}"}, {"name": f"fake_broken_hv{hv}"}]

    def build(variant, target):
        if "broken" in variant["name"]:
            raise RuntimeError("ptxas error: too many resources")

    monkeypatch.setattr(startup, "discover_modules", lambda: ([KernelModule("fake", kernel_variants, build,
                                                                            ("sm_90a",))], []))
    monkeypatch.setattr(startup, "cache_dir", lambda: str(tmp_path))
    monkeypatch.delenv("QLA_SERVE_STARTUP_COMPILE", raising=False)
    monkeypatch.setenv("QLA_SERVE_STARTUP_JOBS", "1")       # in this process: the stand-in module
    with pytest.raises(RuntimeError, match="1 of 2 kernels .* failed to build at start-up: .*fake_broken_hv8: "
                                           "RuntimeError: ptxas error"):
        startup.ensure_kernels(8, 2, target="sm_90a", io_dtype="bfloat16", state_dtype="float32")
    assert not (tmp_path / "qla_serve_ready").exists()      # no marker for a set that failed


def test_switches(monkeypatch):
    monkeypatch.setenv("QLA_SERVE_STARTUP_COMPILE", "0")
    line = startup.ensure_kernels(4, 1, target="sm_90a", io_dtype="float16", state_dtype="bfloat16")
    assert "start-up kernel build off (QLA_SERVE_STARTUP_COMPILE=0)" in line
    monkeypatch.setenv("QLA_SERVE_STARTUP_COMPILE", "yes")
    with pytest.raises(ValueError, match="QLA_SERVE_STARTUP_COMPILE"):
        startup.ensure_kernels(4, 1, target="sm_90a", io_dtype="float16", state_dtype="float32")
    monkeypatch.setenv("QLA_SERVE_STARTUP_JOBS", "0")
    with pytest.raises(ValueError, match="QLA_SERVE_STARTUP_JOBS"):
        startup.build_processes()
    monkeypatch.setenv("QLA_SERVE_STARTUP_JOBS", "3")
    assert startup.build_processes() == 3
    monkeypatch.delenv("QLA_SERVE_STARTUP_JOBS")           # auto: half this process's CPUs, 1..8
    assert startup.build_processes() == max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def test_layer_start_up_hook_names_the_deployment(monkeypatch):
    """gdn_layer.ensure_kernels, what the vLLM layer and SGLang's backend init call on a GPU: the
    target of the device's kernel module and the dtype names; nothing where no op takes the
    TileLang path or off CUDA. The GPU is stubbed (explain_path, the arch lookup): none here."""
    import torch

    import qla_serve
    from qla_serve import paths
    from qla_serve.backends import gdn_layer
    calls = []
    monkeypatch.setattr(startup, "ensure_kernels", lambda *a, **k: calls.append((a, k)) or "line")
    monkeypatch.setattr(qla_serve, "explain_path", lambda op, dev, dt: ("tilelang", "stub"))
    monkeypatch.setattr(paths, "_arch_of", lambda index: "sm90")
    assert gdn_layer.ensure_kernels("cuda:0", 8, 2, torch.bfloat16, torch.float32) == "line"
    assert calls == [((8, 2), dict(target="sm_90a", io_dtype="bfloat16", state_dtype="float32"))]
    monkeypatch.setattr(qla_serve, "explain_path", lambda op, dev, dt: ("fla", "forced"))
    assert gdn_layer.ensure_kernels("cuda:0", 8, 2, torch.bfloat16, torch.float32) is None
    assert gdn_layer.ensure_kernels("cpu", 8, 2, torch.bfloat16, torch.float32) is None
    assert len(calls) == 1


def test_an_arch_not_run_on_hardware_is_said_at_start_up(monkeypatch, caplog):
    """Blackwell's kernels (the Hopper tile programs built for sm_100a) have never run on a
    Blackwell GPU: start-up builds them for sm_100a and logs a WARNING that says so, and the
    path's reason (what the engines log, `qla-serve info` prints) says it too; Hopper's do
    not. The GPU is stubbed (the arch lookup): none here."""
    import logging

    import torch

    from qla_serve import paths
    from qla_serve.backends import gdn_layer
    calls = []
    monkeypatch.setattr(startup, "ensure_kernels", lambda *a, **k: calls.append(k["target"]) or "line")
    for arch, target, warned in (("sm100", "sm_100a", True), ("sm90", "sm_90a", False)):
        monkeypatch.setattr(paths, "_arch_of", lambda index, arch=arch: arch)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qla_serve"):
            assert gdn_layer.ensure_kernels("cuda:0", 8, 2, torch.bfloat16, torch.float32) == "line"
        said = [r.getMessage() for r in caplog.records if "have not been run on sm100 hardware" in r.getMessage()]
        assert bool(said) == warned, caplog.records
        assert calls[-1] == target
        path, why = paths.explain_path("decode", torch.device("cuda", 0), torch.bfloat16)
        assert path == "tilelang" and ("not yet run on this arch's hardware" in why) == warned, why
        assert (paths.unvalidated_note(torch.device("cuda", 0)) is not None) == warned
    assert paths.unvalidated_note("cpu") is None


def _dtype_variants(hv, hk):
    """A stand-in module's variants: one per activation and state dtype start-up can ask for."""
    return [{"name": f"k_hv{hv}_{io}_{st}", "io_dtype": io, "state_dtype": st}
            for io in ("bfloat16", "float16") for st in ("float32", "bfloat16")]


def test_a_set_precompiled_completely_is_skipped_at_start_up(monkeypatch, tmp_path):
    """`qla-serve precompile` marks each start-up set it built completely (deploy/ready.py), and
    start-up then skips the set without building any of its variants (each a ~0.3 s cache check
    on a 2-core host); a set with a failed build gets no marker and start-up checks it. Stand-in
    kernel modules (no compile): start-up's build fails the test if it is called for a marked set."""
    from qla_serve.deploy import precompile as pc
    from qla_serve.deploy import ready

    def precompile_build(variant, target):
        if variant["name"] == "k_hv16_float16_bfloat16":
            raise RuntimeError("ptxas error")

    mod = KernelModule("fake", _dtype_variants, precompile_build, ("sm_90a",))
    requests = [pc.HeadRequest(2, 8, ("sm_90a",)), pc.HeadRequest(4, 16, ("sm_90a",))]
    jobs, problems = pc.enumerate_jobs(requests, [mod])
    assert not problems and len(jobs) == 8
    outcomes, summary = pc.run_jobs(jobs, [mod], progress=False)
    assert summary.failed == 1
    markers = ready.mark_built_sets(requests, [mod], outcomes, str(tmp_path))
    assert len(markers) == 7           # 2 heads x 2 io x 2 state dtypes, less the failed set

    built = []
    monkeypatch.setattr(startup, "_DONE", {})
    monkeypatch.setattr(startup, "discover_modules", lambda: ([KernelModule(
        "fake", _dtype_variants, lambda v, t: built.append(v["name"]), ("sm_90a",))], []))
    monkeypatch.setattr(startup, "cache_dir", lambda: str(tmp_path))
    monkeypatch.delenv("QLA_SERVE_STARTUP_COMPILE", raising=False)
    monkeypatch.setenv("QLA_SERVE_STARTUP_JOBS", "1")       # in this process: the stand-in module
    line = startup.ensure_kernels(8, 2, target="sm_90a", io_dtype="bfloat16", state_dtype="float32")
    assert "marked complete" in line and built == []
    line = startup.ensure_kernels(16, 4, target="sm_90a", io_dtype="float16", state_dtype="bfloat16")
    assert "marked complete" not in line and built == ["k_hv16_float16_bfloat16"]


def test_precompile_cli_packs_its_markers_and_start_up_trusts_them(monkeypatch, tmp_path, capsys):
    """`qla-serve precompile --heads 2/8 --pack` writes the ready markers of the sets it built and
    packs them; unpacked into an empty cache elsewhere, they let start-up skip the set. Stand-in
    kernel modules (their builds write nothing to TileLang's cache) and no TMA memo: no compile."""
    import tarfile

    from qla_serve.cli import main
    from qla_serve.deploy import precompile as pc

    built = []
    fake = [KernelModule("fake", _dtype_variants, lambda v, t: built.append(v["name"]), ("sm_90a",))]
    monkeypatch.setattr(pc, "discover_modules", lambda *a: (fake, []))
    monkeypatch.setattr(pc, "cache_dir", lambda: str(tmp_path / "build"))
    monkeypatch.setenv("QLA_SERVE_TENSORMAP_CACHE", "0")
    pack = tmp_path / "kernels.tar.xz"
    assert main(["precompile", "--heads", "2/8", "--arch", "sm_90a", "--no-progress", "--jobs", "1",
                 "--pack", str(pack)]) == 0
    assert "marked 4 start-up kernel sets complete" in capsys.readouterr().out
    with tarfile.open(pack) as tar:
        assert len([n for n in tar.getnames() if n.startswith("qla_serve_ready/")]) == 4
        tar.extractall(tmp_path / "elsewhere")

    built.clear()
    monkeypatch.setattr(startup, "_DONE", {})
    monkeypatch.setattr(startup, "discover_modules", lambda: (fake, []))
    monkeypatch.setattr(startup, "cache_dir", lambda: str(tmp_path / "elsewhere"))
    monkeypatch.delenv("QLA_SERVE_STARTUP_COMPILE", raising=False)
    line = startup.ensure_kernels(8, 2, target="sm_90a", io_dtype="float16", state_dtype="float32")
    assert "marked complete" in line and built == []
