"""Penalties and logprobs on device, against a numpy reference over Hugging Face logits.

The reference runs the tiny Llama in PyTorch on prompt + output so far, applies vLLM's
penalty rules in numpy and takes the argmax; the engine must produce the same token ids.
Logprobs must equal log_softmax of the reference logits (raw, before penalties) within
1e-4, with the sampled token's rank, and multi-step decode (K=8) must equal K=1.
"""

import numpy as np
import pytest

from jaxpage import LLM, SamplingParams
from tests.engine.prompts import BASE
from tests.reference import hf_logits, load_hf_model
from tests.options import FEW_BUCKETS, TINY

OPTIONS = TINY


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return (LLM(path, num_scheduler_steps=1, **OPTIONS),
            LLM(path, num_scheduler_steps=8, **OPTIONS), load_hf_model(path))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def reference(hf, prompt_ids, params: SamplingParams, num_tokens: int):
    """Greedy continuation with vLLM's penalties; returns (ids, raw logprobs per step)."""
    out, raws = [], []
    for _ in range(num_tokens):
        raw = hf_logits(hf, prompt_ids + out)[-1].astype(np.float64)
        raws.append(log_softmax(raw))
        logits = raw.copy()
        seen = np.zeros(len(logits), bool)
        seen[prompt_ids + out] = True
        counts = np.bincount(np.asarray(out, np.int64), minlength=len(logits))
        rep = params.repetition_penalty
        logits = np.where(seen, np.where(logits > 0, logits / rep, logits * rep), logits)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        out.append(int(np.argmax(logits)))
    return out, raws


# (prompt, penalties): "The future of AI is" repeats a token unpenalized, so positive
# penalties change it; negative ones pull the random model back to seen tokens.
CASES = [
    (BASE[1], dict(repetition_penalty=1.8)),
    (BASE[0], dict(repetition_penalty=0.3)),
    (BASE[1], dict(presence_penalty=2.0)),
    (BASE[1], dict(frequency_penalty=2.0)),
    (BASE[0], dict(presence_penalty=-2.0, frequency_penalty=0.3)),
    (BASE[1], dict(frequency_penalty=-2.0, repetition_penalty=1.8)),
]


def test_penalties_match_reference_and_multi_step(engines):
    single, multi, hf = engines
    tok = single.get_tokenizer()
    prompts = [prompt for prompt, _ in CASES]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3, **p)
              for _, p in CASES]
    plain = single.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                    ignore_eos=True), use_tqdm=False)
    got = single.generate(prompts, params, use_tqdm=False)
    for prompt, p, o, base in zip(prompts, params, got, plain):
        ids, raws = reference(hf, tok(prompt).input_ids, p, 24)
        assert o.outputs[0].token_ids == ids, p
        assert ids != base.outputs[0].token_ids, f"{p} changed nothing: a weak case"
        check_logprobs(o.outputs[0], raws, 3)
    chained_before = multi.llm_engine.step_profile["chained"]
    again = multi.generate(prompts, params, use_tqdm=False)
    assert multi.llm_engine.runner.programs.decode_loops
    # Penalized decodes chain (the device counts tokens the host has not seen yet).
    assert multi.llm_engine.step_profile["chained"] > chained_before
    for a, b in zip(got, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            for k in x:
                assert x[k].rank == y[k].rank
                assert abs(x[k].logprob - y[k].logprob) < 1e-5


def test_penalties_survive_slot_reuse_preemption_and_chaining(engines, tiny_checkpoints):
    """Two penalty slots for eight requests, a cache too small for two of them at once
    (preemption by recompute), K=4 chained calls: the same tokens as the roomy K=1 engine."""
    single = engines[0]
    prompts = [prompt for prompt, _ in CASES] + [BASE[2], BASE[3]]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **p)
              for _, p in CASES] + [SamplingParams(temperature=0, max_tokens=40,
                                                   ignore_eos=True)] * 2
    expected = single.generate(prompts, params, use_tqdm=False)
    tight = LLM(tiny_checkpoints["llama"], num_scheduler_steps=4, max_model_len=256,
                max_num_seqs=2, max_num_batched_tokens=64, block_size=8, num_kv_blocks=9,
                **FEW_BUCKETS)
    got = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.get_stats()
    assert stats["num_preemptions"] > 0
    assert tight.llm_engine.step_profile["chained"] > 0
    for p, a, b in zip(params, got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, p


def rank_ok(raw, token, rank, tol=1e-4) -> bool:
    """The 1-based rank of ``token`` in ``raw`` is ``rank``, up to near-ties within ``tol``."""
    return (1 + int(np.sum(raw > raw[token] + tol)) <= rank
            <= 1 + int(np.sum(raw > raw[token] - tol)))


def check_logprobs(output, raws, n):
    assert len(output.logprobs) == len(output.token_ids) == len(raws)
    total = 0.0
    for token, entry, raw in zip(output.token_ids, output.logprobs, raws):
        nth_best = np.sort(raw)[::-1][n - 1]
        assert token in entry and len(entry) in (n, n + 1)
        for t, lp in entry.items():
            assert abs(lp.logprob - raw[t]) < 1e-4
            assert rank_ok(raw, t, lp.rank)
            if t != token:
                assert raw[t] >= nth_best - 1e-4 and lp.rank <= n
        total += entry[token].logprob
    assert abs(output.cumulative_logprob - total) < 1e-3


def test_sampled_logprobs_with_temperature_and_n(engines):
    single, multi, hf = engines
    tok = single.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, n=2, logprobs=0,
                            frequency_penalty=0.5)
    a = single.generate(BASE[5:7], params, use_tqdm=False)
    b = multi.generate(BASE[5:7], params, use_tqdm=False)
    for x, y, prompt in zip(a, b, BASE[5:7]):
        ids = tok(prompt).input_ids
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.token_ids == cy.token_ids
            assert all(len(e) == 1 for e in cx.logprobs)  # logprobs=0: the sampled token only
            raws = [log_softmax(hf_logits(hf, ids + cx.token_ids[:i])[-1])
                    for i in range(len(cx.token_ids))]
            for token, entry, raw in zip(cx.token_ids, cx.logprobs, raws):
                assert abs(entry[token].logprob - raw[token]) < 1e-4


def test_without_logprobs_fields_are_none(engines):
    single, _, _ = engines
    o = single.generate(BASE[:1], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert o[0].outputs[0].logprobs is None and o[0].outputs[0].cumulative_logprob is None


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("repetition_penalty", "x"), ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 1)])
def test_bad_values_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    assert SamplingParams(presence_penalty=1).has_penalties
    assert not SamplingParams().has_penalties
