"""The embedded default model through the public API: chat, generate, tokenizer, stats."""

import pytest

from jaxpage import LLM, SamplingParams
from tests.options import FEW_BUCKETS


@pytest.fixture(scope="module")
def default_llm():
    return LLM(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, **FEW_BUCKETS)


def test_chat_answers_the_capital_of_france(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32))
    assert out[0].outputs[0].text == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].prompt.startswith("<|im_start|>system")


def test_generate_forms_and_stats(default_llm):
    tok = default_llm.get_tokenizer()
    ids = tok("The future of AI is").input_ids
    by_text, by_ids = default_llm.generate(
        ["The future of AI is", {"prompt_token_ids": ids}],
        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_ids.prompt is None and by_text.prompt_token_ids == ids
    stats = default_llm.get_stats()
    assert set(stats) >= {"num_kv_blocks", "num_free_blocks", "num_running", "num_waiting",
                          "num_preemptions", "kv_usage"}
    assert stats["kv_usage"] == 0.0


def test_per_prompt_sampling_params(default_llm):
    outs = default_llm.generate(["Hello", "Hello"], [SamplingParams(temperature=0, max_tokens=n)
                                                    for n in (3, 6)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 6]
    assert outs[1].outputs[0].token_ids[:3] == outs[0].outputs[0].token_ids
