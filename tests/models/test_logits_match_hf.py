"""Prefill logits of the paged model equal Hugging Face's (float32) within 1e-4 relative.

The prompts run as one batch through the ordinary scheduler, with a token budget small
enough that the longer prompts are prefilled in chunks.
"""

import numpy as np
import pytest

from jaxpage import LLM
from tests.reference import hf_logits, load_hf_model
from tests.options import FEW_BUCKETS

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because it was",
           "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28",
           "Paris"]


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def check_logits(model_path: str, tokenizer) -> None:
    llm = LLM(model_path, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
              **FEW_BUCKETS)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    assert max(map(len, prompts)) > 16  # at least one prompt is chunked
    ours = llm.llm_engine.prompt_logits([{"prompt_token_ids": p} for p in prompts])
    hf = load_hf_model(model_path)
    for ids, logits in zip(prompts, ours):
        ref = hf_logits(hf, ids)
        assert logits.shape == ref.shape
        assert relative_error(logits, ref) < 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_tiny_checkpoint_logits(kind, tiny_checkpoints, smollm2_tokenizer):
    check_logits(tiny_checkpoints[kind], smollm2_tokenizer)


def test_smollm2_gguf_logits(smollm2_path, smollm2_tokenizer):
    check_logits(smollm2_path, smollm2_tokenizer)
