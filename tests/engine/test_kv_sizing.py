"""KV cache sizing: device-memory profiling arithmetic, and the CPU byte budget."""

import pytest

from jaxpage import LLM
from jaxpage.runtime.kv_cache import blocks_from_device_memory, bytes_per_block


def test_blocks_from_profiled_device_memory():
    # 80 GB card, 90% usable, 20 GB in use at peak, 1 MB blocks -> 52 GB / 1 MB - 1 null block.
    assert blocks_from_device_memory(80_000_000_000, 20_000_000_000, 0.9, 1_000_000,
                                     10**9) == 51_999
    assert blocks_from_device_memory(80_000_000_000, 20_000_000_000, 0.9, 1_000_000, 4096) == 4096
    with pytest.raises(ValueError, match="no device memory left"):
        blocks_from_device_memory(1_000_000, 950_000, 0.9, 1000, 100)


def test_cpu_budget_sizes_the_cache_and_a_request_too_big_is_rejected(tiny_checkpoints):
    # Tiny Llama: 3 layers x 2 KV heads x head_dim 16, float32: 12288 bytes per 16-token block.
    budget = 10 * 12288 + 100
    llm = LLM(tiny_checkpoints["llama"], max_model_len=512, block_size=16, max_num_seqs=64,
              kv_cache_memory=budget)
    engine = llm.llm_engine
    assert bytes_per_block(engine.arch, 16, "float32") == 12288
    assert engine.num_kv_blocks == 9  # one of the 10 goes to the null block
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(None, {"prompt_token_ids": [5] * 10},
                           __import__("jaxpage").SamplingParams(max_tokens=500))


def test_device_profile_runs_the_step_with_a_grammar_mask(tiny_checkpoints, monkeypatch):
    """On a device that reports memory the cache is sized after a probe step at the
    largest bucket; that probe carries a structured-outputs mask, so the peak it measures
    includes the mask's buffers (a large vocabulary's mask must not take the cache's
    last bytes at run time)."""
    from jaxpage.engine.startup import kv_sizing
    from jaxpage.runtime.model_runner import ModelRunner

    seen = []
    original = ModelRunner.execute

    def execute(self, batch, token_mask=None):
        seen.append((batch.block_tables.shape[0], None if token_mask is None
                     else token_mask.shape))
        return original(self, batch, token_mask=token_mask)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    monkeypatch.setattr(kv_sizing, "device_memory_stats",
                        lambda: {"bytes_limit": 10**9, "peak_bytes_in_use": 10**8})
    llm = LLM(tiny_checkpoints["llama"], max_model_len=256, block_size=16, max_num_seqs=8,
              warmup=False)
    vocab = llm.llm_engine.arch.vocab_size
    rows, mask_shape = seen[0]
    assert mask_shape == (rows, -(-vocab // 32))
    per_block = bytes_per_block(llm.llm_engine.arch, 16, "float32")
    expected = min((int(0.9 * 10**9) - 10**8) // per_block - 1, 8 * (256 // 16))
    assert llm.llm_engine.num_kv_blocks == expected
