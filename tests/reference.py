"""Hugging Face reference models (PyTorch CPU, float32) and tiny random checkpoints."""

from __future__ import annotations

import os

import numpy as np

TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


# kind -> (transformers config class, model class)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def make_tiny_checkpoint(kind: str, directory: str, tokenizer, *, seed: int = 0,
                         max_shard_size: str | None = None, **overrides) -> str:
    """Save a random tiny ``kind`` checkpoint with a tokenizer (``FAMILIES``' keys)."""
    import torch
    import transformers

    config_name, model_name = FAMILIES[kind]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
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


def make_perturbed_checkpoint(source: str, directory: str, *, noise: float, seed: int = 0) -> str:
    """``source``'s checkpoint with Gaussian noise (``noise`` times each tensor's std)
    added to every weight: a draft model that agrees with its target only in part."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.parameters():
            if tensor.ndim > 1:
                tensor += noise * tensor.std() * torch.randn(tensor.shape, generator=generator)
    model.save_pretrained(directory)
    if any(os.path.exists(os.path.join(source, name))
           for name in ("tokenizer.json", "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return directory


def make_token_id_checkpoint(directory: str, *, vocab_size: int, seed: int) -> str:
    """A random tiny Llama over ``vocab_size`` token ids, saved without a tokenizer."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**TINY_SHAPE, vocab_size=vocab_size, bos_token_id=0,
                                      eos_token_id=1, initializer_range=0.3,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(directory)
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


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_lora_adapter(base: str, directory: str, *, rank: int, alpha: float, seed: int,
                      target_modules=tuple(LORA_TARGETS), scale: float = 0.3,
                      use_rslora: bool = False) -> str:
    """A random PEFT LoRA adapter for checkpoint ``base``, saved (safetensors) in
    ``directory``. PEFT starts B at zeros; both A and B are drawn here so the adapter
    really changes the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = load_hf_model(base)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules),
                        lora_dropout=0.0, bias="none", use_rslora=use_rslora,
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in peft_model.named_parameters():
            if "lora_" in name:
                tensor.copy_(scale * torch.randn(tensor.shape, generator=generator))
    peft_model.save_pretrained(directory)
    return directory


def load_hf_merged(base: str, adapter: str):
    """The reference model of ``base`` with PEFT adapter ``adapter`` merged in."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf_model(base), adapter).merge_and_unload().eval()


def round_projection_inputs_to_fp8(model, scale_of) -> None:
    """Hooks on ``model``'s seven projections (``LORA_TARGETS``): each input x becomes
    e4m3(x / s) * s with s = ``scale_of(module_name, x)`` (a number or a tensor that
    broadcasts over x), what a W8A8 FP8 matmul multiplies."""
    import torch

    for name, module in model.named_modules():
        if name.split(".")[-1] not in LORA_TARGETS:
            continue

        def hook(_module, args, name=name):
            x = args[0]
            s = scale_of(name, x)
            q = (x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
            return (q * s).to(x.dtype),

        module.register_forward_pre_hook(hook)

