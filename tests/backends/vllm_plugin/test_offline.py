"""End to end on CPU, offline: vLLM (LLM class) with linear_attn_backend=flashqla on tiny random
Qwen3-Next and Qwen3.5 models, against transformers run on the same checkpoint. The Qwen3.5 MoE
model is the class the released Qwen3.5 MoE and Qwen3.6-35B-A3B checkpoints name
(Qwen3_5MoeForConditionalGeneration: text config nested, vision tower, processor), served as
vLLM serves those by default, multimodal, with text prompts.

* float32 greedy tokens equal transformers' float32 greedy tokens (bf16 tokens of two correct
  implementations drift apart on random weights from rounding alone, so fp32 is compared);
* prompts are chunked (max_num_batched_tokens=32), so a prefill resumes from its saved state, and
  short prompts decode while the long one still prefills (mixed decode + prefill steps);
  prefix caching is on (vLLM's default, mamba_cache_mode 'align'), and with 64-token blocks a
  second request resumes from the checkpoint the first one's prefill wrote inside its step;
* the path counters show qla_serve's prefill, decode and resumed-prefill paths ran in the
  engine's worker process (this job process: VLLM_ENABLE_V1_MULTIPROCESSING=0) and vLLM's own
  GDN layer and kernels ran zero times;
* speculative decoding (prompt-lookup drafts, up to 3 tokens per verify, some accepted, steps
  mixing verifies with a chunked prefill) gives the same tokens, and so does MTP speculative
  decoding on the Qwen3.5 MoE model (its checkpoint's MTP layer drafting);
* the default backend is the control: vLLM's stock path runs and qla_serve's does not;
* a model qla_serve cannot serve (linear head dim 64) fails at start-up with the reason;
* tensor parallel 2 (two worker processes, each with half the GDN heads) gives the same tokens.
* vLLM's torch.compile (``enforce_eager=False``; its CPU build compiles in mode DYNAMO_TRACE_ONCE
  with inductor, around qla_serve's opaque custom op) gives the same tokens as transformers too.

All engine jobs run in one subprocess (see _offline.py): importing vLLM dominates on 2 cores.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.engine.arg_utils", reason="vllm is not installed (run scripts/setup_vllm_env.sh; tests use .venv-vllm)")

import os  # noqa: E402

from vllm_helpers import engine_env, run_jobs  # noqa: E402

from qla_serve.backends.vllm._stats import read_all  # noqa: E402

MAX_TOKENS = 12
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    from qla_serve.backends.vllm.tiny_model import build_tiny_model

    tmp = tmp_path_factory.mktemp("offline")
    hd64 = build_tiny_model(tmp / "hd64", "qwen3_next", linear_head_dim=64)
    nxt, q35, moe = tiny_models["qwen3_next"], tiny_models["qwen3_5"], tiny_models["qwen3_5_moe"]
    jobs = {
        "control": dict(engine="vllm", model=nxt, dtype="bfloat16", max_tokens=4),
        "next": dict(engine="vllm", model=nxt, backend="flashqla", max_tokens=MAX_TOKENS, chunk=32),
        "q35": dict(engine="vllm", model=q35, backend="flashqla", max_tokens=MAX_TOKENS, chunk=32),
        "q35_moe": dict(engine="vllm", model=moe, backend="flashqla", max_tokens=MAX_TOKENS, chunk=32),
        "hd64": dict(engine="vllm", model=hd64, backend="flashqla", max_tokens=2),
        # vLLM's torch.compile instead of eager: Dynamo traces the model around qla_serve's
        # custom op (opaque, its fake impl), inductor compiles the rest.
        "next_compiled": dict(engine="vllm", model=nxt, backend="flashqla", max_tokens=MAX_TOKENS, chunk=32,
                              eager=False),
        "next_prefix": dict(engine="vllm", model=nxt, backend="flashqla", max_tokens=8, prompts="prefix", block=64),
        # Last engine of the process: vLLM 0.32's CPU worker cannot start a second engine in a
        # process after a speculative one (its Triton-override rebinding fails).
        "next_spec": dict(engine="vllm", model=nxt, backend="flashqla", max_tokens=16, spec=True,
                          prompts="spec", chunk=16),
        "hf_next": dict(engine="hf", model=nxt, max_tokens=MAX_TOKENS),
        "hf_q35": dict(engine="hf", model=q35, max_tokens=MAX_TOKENS),
        "hf_q35_moe": dict(engine="hf", model=moe, max_tokens=MAX_TOKENS),
        "hf_spec": dict(engine="hf", model=nxt, max_tokens=16, prompts="spec"),
        "hf_prefix": dict(engine="hf", model=nxt, max_tokens=8, prompts="prefix"),
    }
    out = run_jobs(list(jobs.values()), tmp, env=engine_env(tmp / "stats"))
    return dict(zip(jobs, out["results"]))


def _stock(counts: dict) -> dict:
    return {k: v for k, v in counts.items() if k.startswith("stock:")}


def _equal(got, want) -> str:
    n = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    return f"{n}/{sum(len(w) for w in want)} tokens equal"


def _same_tokens(got: dict, want: dict) -> dict:
    """The vLLM job started and gave transformers' tokens; returns its path counters."""
    assert "error" not in got, got.get("error")
    assert got["tokens"] == want["tokens"], _equal(got["tokens"], want["tokens"])
    return got["counts"]


@pytest.mark.parametrize("job,ref", [("next", "hf_next"), ("q35", "hf_q35"), ("q35_moe", "hf_q35_moe"),
                                     ("next_compiled", "hf_next")])
def test_flashqla_fp32_greedy_equals_transformers(runs, job, ref):
    c = _same_tokens(runs[job], runs[ref])
    if job == "next_compiled":  # vLLM compiled the model (its CPU build: DYNAMO_TRACE_ONCE)
        assert runs[job]["compilation_mode"] != "NONE", runs[job]["compilation_mode"]
    else:
        assert runs[job]["compilation_mode"] == "NONE", runs[job]["compilation_mode"]
    assert c.get("qla:prefill", 0) > 0 and c.get("qla:decode", 0) > 0, c
    assert c.get("qla:resumed_prefill", 0) > 0, f"no chunked prefill resumed from its state: {c}"
    # One PrefillPlan per step, shared by the 3 GDN layers (not one per layer).
    assert 0 < 3 * c["qla:prefill_plans"] <= c["qla:prefill_layer_calls"], c
    assert _stock(c) == {}, f"vLLM's own GDN path ran: {c}"


def test_moe_model_is_the_released_checkpoints_class(tiny_models):
    """What q35_moe serves is the released Qwen3.5 MoE layout: the multimodal class, the text
    model's GDN geometry nested under text_config, and a processor beside it."""
    import json

    moe = tiny_models["qwen3_5_moe"]
    cfg = json.loads((moe / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"], cfg["architectures"]
    assert cfg["text_config"]["linear_num_value_heads"] == 4 and "vision_config" in cfg
    assert (moe / "processor_config.json").exists() or (moe / "preprocessor_config.json").exists()


def test_flashqla_spec_decode_fp32_equals_transformers(runs):
    c = _same_tokens(runs["next_spec"], runs["hf_spec"])
    assert c.get("qla:spec", 0) > 0, c
    # Chunked prompts: some steps hold spec decodes beside a prefill's tokens; vLLM's batch
    # reorder puts the spec requests first, so the layer takes those rows as views (no gather).
    assert c.get("qla:spec_with_prefill_calls", 0) > 0, c
    assert c.get("qla:spec_rows_as_views", 0) > 0, c
    # Some verify step resumed from a state after more than one accepted token.
    assert c.get("qla:spec_accepted", 0) > c["qla:spec"], f"no draft was ever accepted: {c}"
    assert _stock(c) == {}, c


def test_flashqla_prefix_caching_checkpoints(runs):
    """Align-mode prefix caching with prefill checkpoints (docs/vllm_checkpoints.md): the first
    request's single prefill step writes a checkpoint inside itself (vLLM 0.32 reads flashqla's
    KV-cache spec: one checkpoint block per request, 64-token alignment), so each prompt takes
    one prefill step (without checkpoints vLLM cuts the first one at its replay boundary: two);
    the second request, sharing a ~300-token prefix, resumes from the cache; float32 greedy
    tokens equal transformers' for both."""
    counts = _same_tokens(runs["next_prefix"], runs["hf_prefix"])
    assert counts.get("qla:prefill_checkpoints", 0) > 0, counts
    assert counts.get("qla:resumed_prefill", 0) > 0, counts
    assert counts.get("qla:prefill_plans") == 2, counts
    assert not _stock(counts), counts


def test_default_backend_runs_vllms_own_path(runs):
    """The control that makes the counters meaningful (vLLM's CPU GDN path is bf16-only)."""
    c = runs["control"]["counts"]
    assert _stock(c), c
    assert not any(k.startswith("qla:") for k in c), c


def test_flashqla_refuses_unsupported_model_at_startup(runs):
    err = runs["hd64"].get("error", "")
    assert "linear_attn_backend=flashqla cannot run layer" in err, err[-3000:]
    assert "linear key/value head dim 128, the model has 64/64" in err


def test_flashqla_mtp_spec_decode_qwen3_5_moe(tiny_models, tmp_path):
    """vLLM's MTP speculative decoding (``method: mtp``, the drafter Qwen3.5 / 3.6 checkpoints
    ship) on the Qwen3.5 MoE model: the verify steps run on qla_serve (some beside a chunked
    prefill), fp32 greedy tokens equal transformers'. The tiny MTP layer is random, so its drafts
    are rejected: the accepted-draft path is test_flashqla_spec_decode_fp32_equals_transformers'.
    Its own process: vLLM 0.32's CPU worker starts no engine after a speculative one."""
    moe = tiny_models["qwen3_5_moe"]
    out = run_jobs([dict(engine="vllm", model=moe, backend="flashqla", max_tokens=16, spec="mtp",
                         prompts="spec", chunk=16),
                    dict(engine="hf", model=moe, max_tokens=16, prompts="spec")],
                   tmp_path, env=engine_env(tmp_path / "stats"))
    c = _same_tokens(*out["results"])
    assert c.get("qla:spec", 0) > 0 and c.get("qla:spec_with_prefill_calls", 0) > 0, c
    assert _stock(c) == {}, c


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 on CPU needs 2 cores (one per worker)")
def test_flashqla_tensor_parallel_2(tiny_models, tmp_path):
    """TP=2: the plugin loads in both worker processes, each serves its half of the GDN heads
    (Hk/TP=1, Hv/TP=2) and the fp32 greedy tokens still equal transformers'."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    nxt = tiny_models["qwen3_next"]
    env = engine_env(tmp_path / "stats", VLLM_ENABLE_V1_MULTIPROCESSING=1,
                     VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}|{cpus[1]}")
    out = run_jobs([dict(engine="vllm", model=nxt, backend="flashqla", max_tokens=8, chunk=32, tp=2),
                    dict(engine="hf", model=nxt, max_tokens=8)], tmp_path, env=env)
    _same_tokens(*out["results"])
    per = read_all(tmp_path / "stats")["per_pid"]
    workers = {pid: c for pid, c in per.items() if c.get("qla:calls")}
    assert len(workers) == 2 and out["pid"] not in workers, per
    for c in workers.values():
        assert c.get("qla:prefill", 0) > 0 and c.get("qla:decode", 0) > 0 and c.get("qla:resumed_prefill", 0) > 0, c
    assert not any(k.startswith("stock:") for c in per.values() for k in c), per
