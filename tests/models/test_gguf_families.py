"""GGUF files of the newer families load and match Hugging Face.

Each file is written here from a tiny random checkpoint the way llama.cpp's converter
writes one: tensor names from gguf-py's own map for the architecture, Gemma's norm
scales with the 1 added, Mixtral stored as ``llama`` with its q/k rows permuted and its
experts stacked ``[E, out, in]``, the family's metadata keys. Prefill logits of the file
equal the checkpoint's under Hugging Face within 1e-4 relative (float32).
"""

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.tensor_mapping import get_tensor_name_map
from safetensors.numpy import load_file

from jaxpage import LLM
from tests.models.test_logits_match_hf import PROMPTS, relative_error
from tests.models.test_model_families import FAMILY_SHAPES
from tests.options import FEW_BUCKETS
from tests.reference import hf_logits, load_hf_model, make_tiny_checkpoint

ARCH = {"qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3",
        "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
SHAPES = dict(FAMILY_SHAPES)
# a GGUF file cannot say that some layers are dense: llama.cpp's qwen2moe has experts in all
SHAPES["qwen2_moe"] = {k: v for k, v in SHAPES["qwen2_moe"].items() if k != "mlp_only_layers"}
# nor Gemma's query_pre_attn_scalar: llama.cpp takes head_dim (hidden / heads for 27B)
for _gemma in ("gemma2", "gemma3"):
    SHAPES[_gemma] = dict(SHAPES[_gemma], query_pre_attn_scalar=16,
                          tie_word_embeddings=True)  # (llama.cpp's gemma2 has no output)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's per-head row interleave of q/k for the llama architecture."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _gguf_name(table, hf_name: str) -> str:
    name = table.get_name(hf_name)
    assert name is not None, f"llama.cpp has no GGUF name for {hf_name}"
    return name


def write_gguf(checkpoint: str, kind: str, path: Path) -> Path:
    import json

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    tensors = load_file(str(Path(checkpoint) / "model.safetensors"))
    arch = ARCH[kind]
    layers = config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("full_attention", rope).get("rope_theta", 1e4)))
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config.get("moe_intermediate_size")
                                              or config["intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        if kind != "mixtral":
            writer.add_expert_weights_norm(bool(config.get("norm_topk_prob")))
    if kind.startswith("gemma"):
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
        for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                         ("final_logit_softcapping", writer.add_final_logit_softcapping)):
            if config.get(key) is not None:
                add(config[key])
    if kind == "gemma3":
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    if kind == "phi3":
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))

    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(model_arch, layers)
    stacked: dict[str, list] = {}
    for name, array in tensors.items():
        base, suffix = name.rsplit(".", 1)
        if ".experts." in base:  # per expert -> one stacked tensor per projection
            head, rest = base.split(".experts.")
            index, projection = rest.split(".", 1)
            stacked.setdefault(f"{head}.experts.{projection}", []).append((int(index), array))
            continue
        if kind.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1.0
        if kind == "mixtral" and base.endswith(("q_proj", "k_proj")):
            array = _permute(array, heads if base.endswith("q_proj") else kv_heads)
        writer.add_tensor(f"{_gguf_name(table, base)}.{suffix}", np.ascontiguousarray(array))
    for base, items in stacked.items():
        array = np.stack([a for _, a in sorted(items, key=lambda item: item[0])])
        writer.add_tensor(f"{_gguf_name(table, base)}.weight", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind", sorted(ARCH))
def test_gguf_of_the_family_matches_hf(kind, tmp_path, smollm2_tokenizer):
    checkpoint = make_tiny_checkpoint(kind, str(tmp_path / "hf"), smollm2_tokenizer, seed=40,
                                      **SHAPES[kind])
    path = write_gguf(checkpoint, kind, tmp_path / f"{kind}.gguf")
    llm = LLM(str(path), tokenizer=checkpoint, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=16, **FEW_BUCKETS)
    prompts = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    ours = llm.llm_engine.prompt_logits([{"prompt_token_ids": p} for p in prompts])
    hf = load_hf_model(checkpoint)
    for ids, logits in zip(prompts, ours):
        assert relative_error(logits, hf_logits(hf, ids)) < 1e-4
