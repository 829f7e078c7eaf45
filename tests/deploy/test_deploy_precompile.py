"""`qla-serve precompile`: variant enumeration (fast, CPU) and a real compile (marker compile).

Enumeration runs against the kernel modules as they exist in the tree (no stand-ins); the
compile test builds with nvcc into a temporary TILELANG_CACHE_DIR and then proves a second
process gets cache hits only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile

import pytest

from qla_serve.deploy import load_config
from qla_serve.deploy import precompile as pc
from qla_serve.deploy.config import TARGETS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "configs", "deploy")
TP8 = os.path.join(DEPLOY, "qwen3.5-397b-a17b-tp8.yaml")


@pytest.fixture(scope="module")
def modules():
    mods, problems = pc.discover_modules()
    assert not problems, problems
    if not mods:
        pytest.skip("no kernel module defines kernel_variants/build yet")
    return mods


def _state_of(v):
    return next((v[k] for k in ("pool_dtype", "state_dtype") if k in v), None)


def test_config_enumeration_matches_its_heads_dtypes_and_targets(modules):
    cfg = load_config(TP8)
    jobs, problems = pc.enumerate_jobs(pc.requests_from_configs([cfg]), modules)
    assert not problems, problems
    assert {j.target for j in jobs} == set(TARGETS)
    for j in jobs:
        v = j.variant
        # every variant is for the TP-local heads (2/8 at TP8), the config's dtypes
        assert (v.get("num_k_heads", 2), v.get("num_v_heads", 8)) == (2, 8), v
        assert _state_of(v) in (None, "float32"), v
        assert v.get("io_dtype", "bfloat16") == "bfloat16", v
    # no duplicates; per target the same set of variants, except the prefill stage 2 at v_split
    # 1/2 (V-first, wgmma-only, on sm_90a; v8 on sm_100a) and the prep form V-first reads ("_m",
    # sm_90a only: v8 reads form "uw", which both targets build), each for bf16 q/k and for the
    # fp16 q/k the engine layers hand over beside bf16 v ("_qkfloat16"), and each with 1, 2 and
    # 4 v-heads per CTA ("_heads2", "_heads4": Hv / Hk = 4 at TP8), both form "m"'s stage 1 and
    # the V-first output pass at v_split 1 also packed ("_pm": P^T and M in one tile, plans
    # without a cut; prefill_api.packed_tiles); with 2 and 4 heads solved two at a time ("_pair":
    # prefill_api.PREP_PAIR, the default)
    assert len({j.key for j in jobs}) == len(jobs)
    names = {t: sorted(j.name for j in jobs if j.target == t) for t in TARGETS}
    vfirst = [n for n in names["sm_90a"] if "_vfirst" in n]  # (maps passes: "_vfirst_pdl")
    assert vfirst and all(("_vs1" in n or "_vs2" in n) for n in vfirst)
    packed = [n for n in names["sm_90a"] if n.endswith("_pm")]
    assert [n for n in packed if "_main_" in n and "_persistent" not in n] == [
        "gdn_prefill_main_hv8_hk2_bfloat16_poolfloat32_vs1_vfirst_pm"]
    form_m = re.compile(r"gdn_prefill_prep_.*_m(_qkfloat16)?(_heads[24])?(_pm)?(_pair)?$")
    prep_m = [n for n in names["sm_90a"] if form_m.match(n)]
    assert prep_m == sorted(f"gdn_prefill_prep_hv8_hk2_bfloat16_m{qk}{heads}{pm}{'_pair' if heads else ''}"
                            for qk in ("", "_qkfloat16") for heads in ("", "_heads2", "_heads4") for pm in ("", "_pm"))
    assert "gdn_prefill_prep_hv8_hk2_bfloat16_qkfloat16" in names["sm_100a"]
    assert "gdn_prefill_inputs_hk2_bfloat16_to-float16_qk-only" in names["sm_100a"]
    assert not any("_vfirst" in n or form_m.match(n) for n in names["sm_100a"])
    # and the V-first stage 2's persistent grid for plain and V-split plans (sm_90a only; packed
    # at v_split 1)
    persistent = [n for n in names["sm_90a"] if "_vfirst_persistent" in n]
    assert sorted(persistent) == [f"gdn_prefill_main_hv8_hk2_bfloat16_poolfloat32_vs{vs}_vfirst_persistent{pm}"
                                  for vs, pm in ((1, "_pm"), (2, ""))]
    assert sorted(n.replace("_vfirst", "") for n in names["sm_90a"]
                  if n not in prep_m and n not in persistent and n not in packed) == names["sm_100a"]


def test_filtering_is_a_strict_subset_of_heads_enumeration(modules):
    cfg = load_config(TP8)
    by_cfg, _ = pc.enumerate_jobs(pc.requests_from_configs([cfg], ("sm_90a",)), modules)
    by_heads, _ = pc.enumerate_jobs([pc.HeadRequest(2, 8, ("sm_90a",))], modules)
    assert {j.key for j in by_cfg} < {j.key for j in by_heads}
    states = {_state_of(j.variant) for j in by_heads} - {None}
    assert states == {"float32", "bfloat16"}     # --heads keeps every state dtype


def test_same_heads_from_two_configs_compile_once(modules):
    a = load_config(TP8)
    b = load_config(os.path.join(DEPLOY, "qwen3.5-397b-a17b-tp8-sglang.yaml"))
    one, _ = pc.enumerate_jobs(pc.requests_from_configs([a]), modules)
    two, _ = pc.enumerate_jobs(pc.requests_from_configs([a, b]), modules)
    assert [j.key for j in one] == [j.key for j in two]


def test_every_shipped_config_enumerates(modules):
    configs = [load_config(os.path.join(DEPLOY, f)) for f in sorted(os.listdir(DEPLOY)) if f.endswith(".yaml")]
    jobs, problems = pc.enumerate_jobs(pc.requests_from_configs(configs), modules)
    assert not problems, problems
    heads = {(j.variant.get("num_k_heads"), j.variant.get("num_v_heads")) for j in jobs}
    assert {(2, 8), (4, 16), (8, 24), (16, 32), (4, 8)} <= heads


def test_match_filters_by_name(modules):
    jobs, _ = pc.enumerate_jobs([pc.HeadRequest(2, 8, ("sm_90a",))], modules, match=r"^gdn_decode_")
    assert jobs and all(j.name.startswith("gdn_decode_") for j in jobs)


def test_missing_arch_and_broken_module_are_errors():
    jobs, problems = pc.enumerate_jobs([pc.HeadRequest(2, 8, ("sm_100a",))], [])
    assert jobs == [] and problems == [
        "no kernels registered for arch sm_100a (looked in qla_serve.kernels.hopper, "
        "qla_serve.kernels.blackwell; found no kernel modules)"]
    # an absent package is not an error by itself (the arch check above reports it) ...
    assert pc.discover_modules(["qla_serve.kernels.no_such_arch"]) == ([], [])


def test_cli_list_and_bad_input(capsys):
    from qla_serve.cli import main

    assert main(["precompile", "--config", TP8, "--arch", "sm_90a", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    builds = [line for line in out if line.startswith("sm_90a ")]
    assert out[-1] == f"{len(builds)} kernel variant builds" and builds
    assert "heads 2/8 for qwen3.5-397b-a17b-tp8: targets sm_90a, state float32, io bfloat16" in out
    assert main(["precompile"]) == 2                      # neither --config nor --heads
    # several pairs after one --heads, or --heads repeated: every pair is built, none dropped
    for args in (["--heads", "2/8", "4/16"], ["--heads", "2/8", "--heads", "4/16"]):
        assert main(["precompile", *args, "--arch", "sm_90a", "--match", "^gdn_commit_", "--list"]) == 0
        heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("heads ")]
        assert heads == ["heads 2/8 for --heads 2/8: targets sm_90a", "heads 4/16 for --heads 4/16: targets sm_90a"]
    with pytest.raises(SystemExit):
        main(["precompile", "--heads", "3/8"])            # V not a multiple of QK
    with pytest.raises(SystemExit):                       # refused before anything compiles
        main(["precompile", "--heads", "2/8", "--pack", "kernels.zip"])
    assert "--pack: expected a file name ending in .tar.xz" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["precompile", "--heads", "2/8", "--jobs", "0"])
    assert "expected a positive integer or 'auto', got '0'" in capsys.readouterr().err
    from qla_serve.deploy.cli import build_parser
    assert build_parser().parse_args(["precompile", "--heads", "2/8"]).jobs == "auto"   # the default
    assert 1 <= pc.auto_jobs() <= pc.MAX_AUTO_JOBS


def test_engine_keeps_only_that_engines_configs(capsys):
    """--engine (each image's precompile): the configs of the other engine are skipped and
    said so; their heads are not built unless a config of this engine has them too."""
    from qla_serve.cli import main

    def heads_lines(engine):
        assert main(["precompile", "--config", DEPLOY, "--engine", engine, "--arch", "sm_90a", "--list"]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith(("heads ", "skipped "))]

    vllm, sglang = heads_lines("vllm"), heads_lines("sglang")
    assert "skipped config qwen3.5-27b-tp2: engine sglang, not vllm" in vllm
    assert not any("8/24" in line for line in vllm if line.startswith("heads "))
    assert any(line.startswith("heads 8/24 for qwen3.5-27b-tp2") for line in sglang)
    assert not any("qwen3.5-397b-a17b-tp8:" in line for line in sglang if line.startswith("heads "))
    # nothing left for the engine, or --engine without --config: refused, nothing built
    assert main(["precompile", "--config", os.path.join(DEPLOY, "qwen3.5-27b-tp2.yaml"), "--engine", "vllm",
                 "--list"]) == 2
    assert "none of the 1 config(s) is for vllm" in capsys.readouterr().err
    assert main(["precompile", "--heads", "2/8", "--engine", "vllm", "--list"]) == 2


@pytest.mark.compile
def test_precompile_one_small_config_then_all_cache_hits(tmp_path):
    """Compile, with nvcc and no GPU, one variant of every kernel family the TP8 config needs
    (decode, verify, prefill prep and main: the full config is ~16 builds x 3-20 s per arch)
    for sm_90a into a fresh cache; a second run (two worker processes) must then hit the cache
    for all of them."""
    if not _nvcc():
        pytest.skip("nvcc not found")
    mods, _ = pc.discover_modules()
    jobs, _ = pc.enumerate_jobs(pc.requests_from_configs([load_config(TP8)], ("sm_90a",)), mods)
    firsts = {}
    for j in jobs:                      # family = the name up to the head counts
        firsts.setdefault(j.name.split("_hv")[0], j.name)
    if not firsts:
        pytest.skip("no kernel variants registered yet")
    match = "^(" + "|".join(re.escape(n) for n in firsts.values()) + ")$"
    env = {**os.environ, "TILELANG_CACHE_DIR": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "qla_serve.cli", "precompile", "--config", TP8, "--arch", "sm_90a",
           "--match", match, "--no-progress"]

    first = subprocess.run(cmd + ["--jobs", "1", "--json", str(tmp_path / "1.json")], env=env, capture_output=True,
                           text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    s1 = json.load(open(tmp_path / "1.json"))
    assert (s1["compiled"], s1["cached"], s1["failed"]) == (len(firsts), 0, 0), s1
    assert f"{len(firsts)} compiled, 0 cached hits, 0 failed" in first.stdout

    # The second run uses two worker processes: their per-process count must agree. It packs
    # the entries its builds used (all hits) ...
    pack = tmp_path / "kernels.tar.xz"
    second = subprocess.run(cmd + ["--jobs", "2", "--json", str(tmp_path / "2.json"), "--pack", str(pack)],
                            env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    s2 = json.load(open(tmp_path / "2.json"))
    assert (s2["compiled"], s2["cached"], s2["failed"]) == (0, len(firsts), 0), s2
    with tarfile.open(pack) as tar:
        names = tar.getnames()
    entries = {n.split("/kernels/")[1].split("/")[0] for n in names if "/kernels/" in n}
    assert 1 <= len(entries) <= len(firsts), names[:20]
    memo = [n for n in names if n.startswith("qla_serve/")]          # the TMA descriptor memo
    assert all(n.count("/") >= 2 and not n.startswith("/") for n in names if n not in memo), names[:20]
    assert f"packed {len(entries)} cache entries" in second.stdout, second.stdout[-2000:]
    # the TMA descriptor memo (kernels/hopper/host_cache.py) travels with the kernels
    from qla_serve.kernels.hopper import host_cache
    if "and the TMA descriptor memo" in second.stdout:
        assert len(memo) == 1 and memo[0].startswith("qla_serve/tensormap_cache-") and memo[0].endswith(".so"), memo
    else:
        assert "TMA descriptor memo not built" in second.stdout, second.stdout[-2000:]
    assert host_cache.SOURCE.is_file()

    # ... and the pack alone, unpacked into an empty cache, makes every build a hit (one process).
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with tarfile.open(pack) as tar:
        tar.extractall(fresh)
    third = subprocess.run(cmd + ["--json", str(tmp_path / "3.json")],
                           env={**env, "TILELANG_CACHE_DIR": str(fresh)}, capture_output=True, text=True, timeout=900)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    s3 = json.load(open(tmp_path / "3.json"))
    assert (s3["compiled"], s3["cached"], s3["failed"]) == (0, len(firsts), 0), s3


def _nvcc() -> bool:
    from shutil import which
    return which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


def test_a_kernel_module_that_fails_to_import_is_an_error(tmp_path, monkeypatch):
    """... but a package that exists and fails to import is (here one whose code raises)."""
    pkg = tmp_path / "qla_broken_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('half-written kernel module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mods, problems = pc.discover_modules(["qla_broken_kernels"])
    assert mods == [] and problems == [
        "module qla_broken_kernels failed to import: RuntimeError: half-written kernel module"]


def test_another_writer_of_the_cache_does_not_make_a_hit_look_compiled(tmp_path, monkeypatch):
    """In one process (``--jobs 1``, and the engines' start-up) a build counts as compiled only if
    TileLang's cache saved a fresh compile in this process (pc._save_counter, which counts
    KernelCache._save_kernel_to_disk; the real compiles of the test above go through it): an
    entry that another process writes to the same cache meanwhile (here during the build, as a
    concurrent precompile did) is not this build's. No compile: the builds are stand-ins, one
    writing such an entry, one counting a save as the wrapper does."""
    monkeypatch.setattr(pc, "cache_dir", lambda: str(tmp_path))
    saves = pc._save_counter()
    others = tmp_path / "0.1.12" / "linux-x86_64" / "kernels"

    def foreign_write(variant, target):
        others.mkdir(parents=True, exist_ok=True)
        (others / "written-by-another-process").mkdir()

    def own_save(variant, target):
        saves[0] += 1

    mods = [pc.KernelModule("foreign", lambda hv, hk: [], foreign_write, ("sm_90a",)),
            pc.KernelModule("own", lambda hv, hk: [], own_save, ("sm_90a",))]
    jobs = [pc.Job("foreign", "sm_90a", {"name": "a"}, "a"), pc.Job("own", "sm_90a", {"name": "b"}, "b")]
    outcomes, summary = pc.run_jobs(jobs, mods, progress=False, workers=1)
    assert [o.status for o in outcomes] == ["cached", "compiled"], outcomes
    assert (summary.compiled, summary.cached, summary.failed) == (1, 1, 0)
    assert len(pc._cache_entries(str(tmp_path))) == 1   # what a diff of the directory would have counted
