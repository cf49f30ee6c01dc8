"""Hugging Face reference models (PyTorch CPU, float32) and tiny random checkpoints."""

from __future__ import annotations

import os

import numpy as np

TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def make_tiny_checkpoint(kind: str, directory: str, tokenizer, *, seed: int = 0,
                         max_shard_size: str | None = None, **overrides) -> str:
    """Save a random tiny ``kind`` ('llama' | 'qwen2' | 'mistral') checkpoint with a tokenizer."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    fields = dict(TINY_SHAPE, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id, initializer_range=0.3,
                  tie_word_embeddings=False)
    if kind == "mistral":
        fields["sliding_window"] = None
    fields.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).to(torch.float32).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    tokenizer.save_pretrained(directory)
    return directory


def load_hf_model(path: str):
    """The reference model for a checkpoint directory or a GGUF file, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


def hf_greedy(model, token_ids: list[int], max_new_tokens: int, eos_token_id) -> list[int]:
    """Greedy continuation of one unpadded prompt, EOS included when produced."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), attention_mask=torch.ones(1, len(token_ids),
                             dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_id,
                             pad_token_id=eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id,
                             min_new_tokens=0)
    return out[0, len(token_ids):].tolist()
