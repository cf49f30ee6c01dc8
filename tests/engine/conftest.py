import pytest

from jaxpage import LLM


@pytest.fixture(scope="module")
def tiny_llm(tiny_checkpoints):
    """A tiny Llama engine shared by a module's tests (cheap to compile)."""
    return LLM(tiny_checkpoints["llama"], max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=64, block_size=8, num_kv_blocks=64)
