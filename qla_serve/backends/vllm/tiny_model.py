"""Tiny random-weight Qwen3-Next and Qwen3.5 checkpoints, built offline in about a second.

Used by the vLLM backend tests and by scripts/serve_demo.sh: a real model directory
(config.json, safetensors, a byte-level BPE tokenizer trained on the spot) that vLLM and
transformers both load, with the GDN shapes qla_serve serves: 4 layers (3 Gated DeltaNet +
1 full attention), linear key/value head dim 128, 2 key heads and 4 value heads, hidden 256,
vocab 512. lm_head is scaled up so greedy decoding on random weights has clear winners (fewer
near-ties between two correct implementations). The kinds:

- ``qwen3_next``: Qwen3NextForCausalLM. vLLM's Qwen3-Next needs at least one MoE layer, so the
  last layer is MoE (4 experts, top-2) and the others are in ``mlp_only_layers``.
- ``qwen3_5``: Qwen3_5ForCausalLM, dense (the text-only class).
- ``qwen3_5_moe``: Qwen3_5MoeForConditionalGeneration, the class the released Qwen3.5 MoE
  checkpoints (Qwen3.5-397B-A17B, the TP8 deployment) and Qwen3.6-35B-A3B name in their
  config.json: the text model nested under ``text_config``, every layer MoE (4 experts, top-2,
  a shared expert), a one-block vision tower, and a processor (image and video processors, the
  tokenizer with the four vision special tokens) so that vLLM serves it as a multimodal model,
  as it does the real checkpoints by default; and an MTP layer (``mtp.*``) for vLLM's MTP
  speculative decoding, as the released checkpoints ship.

    python -m qla_serve.backends.vllm.tiny_model OUT_DIR [--kind qwen3_next|qwen3_5|qwen3_5_moe] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import pathlib

KINDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
VOCAB = 512
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Gated DeltaNet keeps a fixed-size state per "
    "head and updates it with a delta rule. Linear attention serves long prompts in constant "
    "memory per request. vLLM and SGLang batch prefills and decodes together. Once upon a time "
    "there was a tiny model with random weights that answered every question with confidence. "
    "0123456789 + - * / = ( ) [ ] { } , . ; : ! ? "
)


# The special tokens Qwen3-VL's processor looks up (transformers' processing_qwen3_vl.py).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _tokenizer(out: pathlib.Path, vision: bool = False):
    """A byte-level BPE tokenizer of VOCAB ids, saved to ``out`` and returned; with ``vision``
    VISION_TOKENS are special tokens of it too (ids 1-4, inside VOCAB)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    extra = list(VISION_TOKENS) if vision else []
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"] + extra,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   **({"additional_special_tokens": extra} if extra else {}))
    fast.save_pretrained(str(out))
    return fast


def _save_processor(out: pathlib.Path, tokenizer) -> None:
    """Qwen3-VL's processor (what the Qwen3.5 checkpoints ship) with the smallest image sizes."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    images = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2,
                                   min_pixels=32 * 32, max_pixels=64 * 64)
    videos = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
    Qwen3VLProcessor(image_processor=images, video_processor=videos,
                     tokenizer=tokenizer).save_pretrained(str(out))


def _config(kind: str, eos: int, linear_head_dim: int = 128, tokenizer=None):
    common = dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig
        return Qwen3NextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                               shared_expert_intermediate_size=128, decoder_sparse_step=1,
                               mlp_only_layers=[0, 1, 2], **common)
    if kind == "qwen3_5_moe":
        from transformers import Qwen3_5MoeConfig
        text = dict(common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                    shared_expert_intermediate_size=128)
        del text["intermediate_size"], text["tie_word_embeddings"]
        vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                      out_hidden_size=common["hidden_size"], num_position_embeddings=64)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
        return Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                vision_start_token_id=ids["<|vision_start|>"],
                                vision_end_token_id=ids["<|vision_end|>"],
                                image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(**common)


def build_tiny_model(out_dir, kind: str = "qwen3_next", *, dtype: str = "bfloat16", seed: int = 0,
                     linear_head_dim: int = 128) -> pathlib.Path:
    """Write a tiny random ``kind`` model to ``out_dir`` (created); returns the path.

    ``linear_head_dim`` != 128 builds a model qla_serve must refuse (tests of start-up errors).
    """
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    import torch
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vision = kind == "qwen3_5_moe"
    tokenizer = _tokenizer(out, vision)
    if vision:
        _save_processor(out, tokenizer)
    eos = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]["<|endoftext|>"]
    config = _config(kind, eos, linear_head_dim, tokenizer)
    torch.manual_seed(seed)
    if kind == "qwen3_next":
        from transformers import Qwen3NextForCausalLM as Model
    elif kind == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForConditionalGeneration as Model
    else:
        from transformers import Qwen3_5ForCausalLM as Model
    model = Model(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.to(getattr(torch, dtype)).save_pretrained(str(out), safe_serialization=True)
    if kind == "qwen3_5_moe":
        _add_mtp_layer(out, seed)
    return out


def _add_mtp_layer(out: pathlib.Path, seed: int) -> None:
    """Give the checkpoint an MTP module as the released Qwen3.5 / 3.6 ones have (``mtp.*``
    weights, ``mtp_num_hidden_layers`` in text_config), which vLLM's ``method: mtp`` speculative
    decoding loads (vllm/model_executor/models/qwen3_5_mtp.py): one full-attention MoE decoder
    layer (the last model layer's weights, perturbed), the fc over [embedding | hidden] and
    three norms. transformers does not build it (it ignores ``mtp.*``). Random, so its drafts
    are almost never accepted."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    weights = load_file(str(path))
    gen = torch.Generator().manual_seed(seed + 1)
    last = "model.language_model.layers.3."          # the full-attention layer
    for name, w in list(weights.items()):
        if name.startswith(last):
            noisy = w.float() + 0.02 * torch.randn(w.shape, generator=gen)
            weights["mtp.layers.0." + name[len(last):]] = noisy.to(w.dtype)
    hidden = weights["lm_head.weight"].shape[1]
    dtype = weights["lm_head.weight"].dtype
    weights["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5).to(dtype)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        weights[f"mtp.{norm}.weight"] = torch.zeros(hidden, dtype=dtype)   # Gemma-style: scale 1 + w
    save_file(weights, str(path), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--kind", choices=KINDS, default="qwen3_next")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(build_tiny_model(a.out_dir, a.kind, dtype=a.dtype, seed=a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
