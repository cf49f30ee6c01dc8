"""Greedy outputs equal Hugging Face generate, in one batch under memory and token pressure.

All prompts run as ONE ``generate`` call with a token budget that forces chunked prefill
and a KV cache small enough to force preemption; every output must also equal the same
prompt run alone, and Hugging Face's greedy continuation (PyTorch CPU, float32).
"""

import pytest

from jaxpage import LLM, SamplingParams
from tests.engine.prompts import BASE
from tests.reference import hf_greedy, load_hf_model
from tests.options import FEW_BUCKETS
from tests.default_suite import SLOW

CONFIG = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=32, block_size=8,
              **FEW_BUCKETS)


def check_against_hf(model_path: str, tokenizer, *, max_tokens: int, num_kv_blocks: int) -> None:
    prompts = BASE
    assert len(prompts) >= 16
    ids = [tokenizer(p).input_ids for p in prompts]
    assert max(map(len, ids)) > CONFIG["max_num_batched_tokens"]  # chunked prefill happens
    params = SamplingParams(temperature=0, max_tokens=max_tokens)

    llm = LLM(model_path, num_kv_blocks=num_kv_blocks, **CONFIG)
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats()["num_preemptions"] > 0  # the cache was too small for all at once
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]

    hf = load_hf_model(model_path)
    eos = sorted(llm.llm_engine.eos_token_ids)
    for prompt, prompt_ids, out, single in zip(prompts, ids, batched, alone):
        assert out.prompt == prompt and out.prompt_token_ids == prompt_ids
        tokens = out.outputs[0].token_ids
        assert tokens == single.outputs[0].token_ids, prompt
        assert tokens == hf_greedy(hf, prompt_ids, max_tokens, eos), prompt
        assert out.finished
        expected_reason = "stop" if tokens[-1] in eos else "length"
        assert out.outputs[0].finish_reason == expected_reason
        assert out.outputs[0].text == tokenizer.decode(tokens, skip_special_tokens=True)


# Qwen2 with the slow cases: its prefill logits run by default (tests/models), and the
# engine's scheduling paths do not depend on the family
@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen2", marks=SLOW)])
def test_tiny_checkpoints_greedy_match_hf(kind, tiny_checkpoints, smollm2_tokenizer):
    check_against_hf(tiny_checkpoints[kind], smollm2_tokenizer, max_tokens=24, num_kv_blocks=24)


@pytest.mark.slow  # ~150 s on 2 cores; the fast set checks SmolLM2's logits against HF
def test_smollm2_greedy_matches_hf(smollm2_path, smollm2_tokenizer):  # (tests/models)
    check_against_hf(smollm2_path, smollm2_tokenizer, max_tokens=20, num_kv_blocks=24)
