"""Run a list of vLLM (LLM class) and transformers jobs in ONE process; print JSON on the last line.

    python _offline.py JOBS.json      # [{"engine": "vllm"|"hf", "model": DIR, ...}, ...]

Job keys: prompts ("spec" for SPEC_PROMPTS, "prefix" for PREFIX_PROMPTS one request at a time), block (block_size), tp (tensor parallel size), backend (None = vLLM's default), dtype, max_tokens, chunk (max_num_batched_tokens,
0 = vLLM's default), spec (2 drafts per step: True for prompt lookup, "mtp" for the checkpoint's
MTP layer), eager (default True:
enforce_eager; False runs vLLM's torch.compile, which its CPU build does in mode
DYNAMO_TRACE_ONCE with inductor; the result then says which mode ran). Each result has the
greedy token ids per prompt, or "error" (the exception text) when the engine refused to start;
vLLM jobs also get "counts", the qla_serve path counters of this process during that job.

One process for all jobs because importing vLLM dominates the cost on a 2-core machine; the
engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so "this process" is the
engine's worker. Prompts (PROMPTS): one long enough to be chunked, short ones that decode while
it prefills (mixed decode + prefill steps).
"""

import gc
import json
import os
import sys
import time
import traceback

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 9,
    "Once upon a time",
    "Gated DeltaNet keeps a fixed-size state per head",
]
# The tiny qwen3_next model's greedy continuation of this prompt repeats trigrams, so
# prompt-lookup drafts get accepted (verify steps resume from accepted counts > 1).
SPEC_PROMPTS = PROMPTS[1:] + ["0 1 2 3 0 1 2 3 0 1 2 3 0 1 2 3"]
# Two requests sharing a ~300-token prefix, generated one after the other: the first one's
# prefill writes an align-mode checkpoint inside its step, the second resumes from it.
PREFIX = "The quick brown fox jumps over the lazy dog. " * 30
PREFIX_PROMPTS = [PREFIX + "Once upon a time", PREFIX + "Gated DeltaNet keeps a fixed-size state"]


def run_vllm(job) -> dict:
    from vllm import LLM, SamplingParams

    from qla_serve.backends.vllm import _stats

    kw = dict(model=job["model"], dtype=job.get("dtype", "float32"), max_model_len=512,
              enforce_eager=job.get("eager", True), seed=0)
    if job.get("backend"):
        kw["additional_config"] = {"linear_attn_backend": job["backend"]}
    if job.get("tp", 1) > 1:
        kw["tensor_parallel_size"] = job["tp"]  # workers are separate processes (stats files)
    if job.get("chunk"):
        kw.update(enable_chunked_prefill=True, max_num_batched_tokens=job["chunk"])
    if job.get("block"):
        kw["block_size"] = job["block"]
    if job.get("spec"):
        # Prompt-lookup drafts: 2 per step, so verify batches carry up to 3 tokens per sequence.
        # vLLM's CPU build cannot run prefix caching ('align') with spec decoding (Triton precopy).
        spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        if job["spec"] == "mtp":  # the checkpoint's own MTP layer drafts (Qwen3.5 / 3.6)
            spec = {"method": "mtp", "num_speculative_tokens": 2}
        kw.update(enable_prefix_caching=False, speculative_config=spec)
    before = dict(_stats._counts)
    t0 = time.time()
    try:
        llm = LLM(**kw)
    except Exception as exc:  # the refusal tests look at this text
        return {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"])
    if job.get("prompts") == "prefix":   # one request at a time: the second can hit the first's cache
        outs = [o for p in _prompts(job) for o in llm.generate([p], params)]
    else:
        outs = llm.generate(_prompts(job), params)
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": round(time.time() - t0, 1),
           "compilation_mode": llm.llm_engine.vllm_config.compilation_config.mode.name}
    del llm, outs
    gc.collect()
    res["counts"] = {k: v - before.get(k, 0) for k, v in _stats._counts.items() if v != before.get(k, 0)}
    return res


def _prompts(job):
    return {"spec": SPEC_PROMPTS, "prefix": PREFIX_PROMPTS}.get(job.get("prompts"), PROMPTS)


def run_hf(job) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, job.get("dtype", "float32")))
    tok = AutoTokenizer.from_pretrained(job["model"])
    res = []
    for p in _prompts(job):
        ids = tok(p, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=job["max_tokens"], do_sample=False,
                             pad_token_id=tok.eos_token_id)
        res.append(out[0, ids.shape[1]:].tolist())
    return {"tokens": res}


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    results = [run_vllm(j) if j["engine"] == "vllm" else run_hf(j) for j in jobs]
    print(json.dumps({"pid": os.getpid(), "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
