"""Sliding-window models through the engine: HF's tokens, and only the window held.

A Mistral-shaped model attends within its window in every layer, so the KV manager gives
back the blocks behind it (``KVCacheManager.drop_behind_window``); Gemma-style models
that mix local and global layers keep whole tables (tested in tests/models).
"""

import pytest

from jaxpage import LLM, SamplingParams
from tests.engine.test_greedy_matches_hf import check_against_hf
from tests.options import FEW_BUCKETS
from tests.reference import make_tiny_checkpoint


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, smollm2_tokenizer):
    root = tmp_path_factory.mktemp("windowed")
    return {window: make_tiny_checkpoint("mistral", str(root / f"w{window}"), smollm2_tokenizer,
                                         seed=21, sliding_window=window)
            for window in (8, 64)}


def test_window_shorter_than_the_prompts_matches_hf_with_blocks_given_back(
        windowed, smollm2_tokenizer):
    # block_size 8 and a window of 8: every prompt outgrows its window while it runs
    check_against_hf(windowed[8], smollm2_tokenizer, max_tokens=24, num_kv_blocks=12)


def test_a_long_generation_holds_only_its_window(windowed, smollm2_tokenizer):
    window, block_size = 64, 16
    llm = LLM(windowed[window], max_model_len=1024, block_size=block_size, num_kv_blocks=64,
              max_num_batched_tokens=64, **FEW_BUCKETS)
    engine, kv = llm.llm_engine, llm.llm_engine.kv_cache_manager
    assert kv.sliding_window == window
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    prompts = ["The quick brown fox", "Once upon a time, in a land far away, there lived"]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    most, lengths = 0, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            lengths[output.request_id] = len(output.outputs[0].token_ids)
        for request in engine.scheduler.running:
            most = max(most, kv.num_live_blocks(request.request_id))
    assert lengths == {"0": 1000, "1": 1000}
    assert most <= window // block_size + 2, most
    # a full-table engine could not even admit both: 1000+ tokens need 63+ blocks each
    assert kv.num_blocks_for(1000 + 4) * 2 > 64
