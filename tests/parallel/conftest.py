"""Tiny checkpoints whose head counts divide 8 devices (the shared ones have 4 heads)."""

import pytest


@pytest.fixture(scope="session")
def tp_checkpoints(tmp_path_factory, smollm2_tokenizer) -> dict[str, str]:
    """Llama: 8 query / 2 KV heads (KV heads repeated at 4 and 8 devices); Qwen2: 8 / 4."""
    from tests.reference import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tp")
    return {
        "llama": make_tiny_checkpoint("llama", str(root / "llama"), smollm2_tokenizer, seed=11,
                                      num_attention_heads=8, num_key_value_heads=2,
                                      num_hidden_layers=2, max_shard_size="2MB"),
        "qwen2": make_tiny_checkpoint("qwen2", str(root / "qwen2"), smollm2_tokenizer, seed=12,
                                      num_attention_heads=8, num_key_value_heads=4,
                                      num_hidden_layers=2, tie_word_embeddings=True),
    }


@pytest.fixture(scope="session")
def tp_prompts(smollm2_tokenizer) -> list[list[int]]:
    """Token-id prompts of mixed lengths (one longer than the 32-token step budget)."""
    from tests.engine.prompts import BASE

    ids = [smollm2_tokenizer(p).input_ids for p in BASE[:5]]
    ids.append((ids[0] * 8)[:45])
    return ids
