"""Random sampling is reproducible per request: same seed, same text, alone or batched."""

from jaxpage import SamplingParams
from tests.engine.prompts import BASE


def test_same_seed_same_text_alone_or_in_a_batch(tiny_llm):
    target = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, seed=1234,
                            max_tokens=24)
    alone = tiny_llm.generate([BASE[1]], target, use_tqdm=False)[0].outputs[0]
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=10 + i) for i in range(5)]
    others.append(SamplingParams(temperature=0, max_tokens=12))
    batch = tiny_llm.generate(BASE[2:8] + [BASE[1]], others + [target], use_tqdm=False)
    in_batch = batch[-1].outputs[0]
    assert in_batch.token_ids == alone.token_ids
    assert in_batch.text == alone.text
    again = tiny_llm.generate([BASE[1]], target, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == alone.token_ids


def test_different_seeds_differ_and_unseeded_requests_are_distinct(tiny_llm):
    outs = [tiny_llm.generate([BASE[0]], SamplingParams(temperature=1.0, seed=s, max_tokens=16),
                              use_tqdm=False)[0].outputs[0].token_ids for s in (1, 2, 3)]
    assert len({tuple(o) for o in outs}) == 3
    unseeded = tiny_llm.generate([BASE[0]] * 3, SamplingParams(temperature=1.0, max_tokens=16),
                                 use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) == 3


def test_top_k_one_is_greedy(tiny_llm):
    greedy = tiny_llm.generate([BASE[3]], SamplingParams(temperature=0, max_tokens=12),
                               use_tqdm=False)[0].outputs[0].token_ids
    top1 = tiny_llm.generate([BASE[3]], SamplingParams(temperature=1.5, top_k=1, seed=9,
                                                       max_tokens=12),
                             use_tqdm=False)[0].outputs[0].token_ids
    assert top1 == greedy
