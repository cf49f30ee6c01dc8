"""OpenAI's ``logit_bias`` (``SamplingParams.logit_bias``): a number added to named tokens'
logits before sampling, greedy included, in single steps and multi-step decode calls, only
for the rows that ask for it."""

from __future__ import annotations

import pytest

from jaxpage import SamplingParams
from jaxpage.sampling_params import MAX_LOGIT_BIAS

PROMPT = {"prompt_token_ids": [100 + 3 * i for i in range(12)]}
OTHER = {"prompt_token_ids": [400 + 5 * i for i in range(7)]}


def _tokens(llm, prompts, params):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_large_bias_forces_its_token_in_every_step(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                            logit_bias={1234: 100.0})
    assert _tokens(tiny_llm, [PROMPT], params) == [[1234] * 10]


def test_a_banned_greedy_token_gives_the_second_best(tiny_llm):
    plain = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=2,
                                                       ignore_eos=True), use_tqdm=False)[0]
    top = plain.outputs[0].logprobs[0]
    best, second = sorted(top, key=lambda t: -top[t].logprob)[:2]
    assert plain.outputs[0].token_ids[0] == best
    banned = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                            logit_bias={best: -100.0})
    assert _tokens(tiny_llm, [PROMPT], banned) == [[second]]


def test_only_the_biased_row_changes(tiny_llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = _tokens(tiny_llm, [OTHER], free)
    biased = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            logit_bias={7: 100.0})
    together = _tokens(tiny_llm, [PROMPT, OTHER], [biased, free])
    assert together == [[7] * 12, alone[0]]


def test_bad_biases_are_value_errors(tiny_llm):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    vocab = tiny_llm.llm_engine.arch.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate([PROMPT], SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    assert SamplingParams(logit_bias={}).logit_bias is None
