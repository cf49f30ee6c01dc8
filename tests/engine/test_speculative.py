"""Speculative decoding (``speculative_config``) never changes what the model says.

The verify step samples every position of a row from the target's own distribution,
with the request's own random stream, and emits the draws up to the first one that
differs from the proposal it checks. So with any proposer the emitted tokens are the
ones plain decoding samples, seed for seed: these tests compare token for token against
an engine without speculation, which is stronger than comparing distributions.

Proposers used here besides the real n-gram one: an oracle that proposes the reference
continuation (every proposal must be accepted: pins the KV bookkeeping, as a draft model
equal to the target would), and a mixed one that proposes a random-length prefix of the
reference followed by junk (every accept length from 0 to k happens).
"""

import numpy as np
import pytest

from jaxpage import LLM, SamplingParams
from jaxpage.beam_search import BeamSearchParams
from tests.default_suite import every_nth
from tests.engine.outcomes import outcomes
from tests.engine.prompts import BASE
from tests.options import TINY

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": 8}  # 8: every seat of TINY
# Prompts that repeat themselves, so that prompt lookup finds matches.
REPEATING = ["1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,", "a b c d a b c d a b",
             "the cat sat on the mat and the cat sat on the", "x = x + 1\nx = x + 1\nx = x +"]


class ReferenceProposer:
    """Proposes from reference outputs (prompt ids -> output ids): a prefix of the true
    continuation of random length (``exact=False``; then junk) or all of it."""

    def __init__(self, references: dict[tuple, list[int]], k: int, exact: bool, seed: int = 0):
        self.references, self.k, self.exact = references, k, exact
        self.rng = np.random.default_rng(seed)

    def propose(self, request, max_tokens: int) -> list[int]:
        k = min(self.k, max_tokens)
        done = request.output_token_ids
        reference = self.references[tuple(request.prompt_token_ids)]
        true_next = reference[len(done):len(done) + k]
        if self.exact:
            return list(true_next)
        good = int(self.rng.integers(0, k + 1))
        junk = self.rng.integers(5, 4000, k).tolist()
        return (list(true_next[:good]) + junk)[:k]


def references_of(llm, prompts, params) -> dict[tuple, list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in outputs}


@pytest.fixture(scope="module")
def llama_engines(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return {"plain": LLM(path, **TINY),
            "spec": LLM(path, speculative_config=NGRAM, **TINY)}


def mixed_params(free):
    """Greedy and sampled requests with stops landing inside accepted runs."""
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (40, 40, 40, 17, 1, 25, 40, 40)]
    params[1] = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[free[1][0][0][6]])
    params[2] = SamplingParams(temperature=0, max_tokens=40, stop=[free[2][0][1][8:11]])
    params[3] = SamplingParams(temperature=0, max_tokens=17, min_tokens=9,
                               stop_token_ids=[free[3][0][0][2]])
    params[5] = SamplingParams(temperature=0.8, seed=11, max_tokens=25, presence_penalty=0.5,
                               repetition_penalty=1.2, logprobs=2)
    params[6] = SamplingParams(temperature=1.0, seed=5, max_tokens=12, n=2, logprobs=1)
    params[7] = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=7,
                               max_tokens=40, stop=[free[7][0][1][4:7]])
    return params


def test_ngram_outputs_equal_plain_decoding(llama_engines):
    prompts = REPEATING + BASE[:4]
    free = outcomes(llama_engines["plain"], prompts, SamplingParams(temperature=0, max_tokens=40))
    params = mixed_params(free)
    want = outcomes(llama_engines["plain"], prompts, params)
    got = outcomes(llama_engines["spec"], prompts, params)
    assert got == want
    assert want[1][0][2] == "stop" and want[2][0][2] == "stop"
    # (A random tiny model's outputs seldom repeat its context, so prompt lookup finds
    # little here; the SmolLM2 test below and the proposer tests cover real matches.)


@pytest.mark.parametrize("temperature,top_p", [
    (0.0, 1.0), (1.0, 1.0), pytest.param(0.9, 0.8, marks=pytest.mark.slow)])  # top-p sorts
def test_every_accept_length_gives_the_plain_tokens(llama_engines, temperature, top_p):
    """Proposals accepted for 0..k positions, greedy and seeded sampling, 16 prompts in
    one batch (8 seats: a queue), chunked prefill (64-token budget)."""
    plain, spec = llama_engines["plain"], llama_engines["spec"]
    prompts = (BASE * 2)[:16]
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=i, max_tokens=30)
              for i in range(16)]
    want = outcomes(plain, prompts, params)
    scheduler = spec.llm_engine.scheduler
    saved = scheduler.speculation.proposer
    references = {}
    for o in plain.generate(prompts, params, use_tqdm=False):
        references[tuple(o.prompt_token_ids)] = list(o.outputs[0].token_ids)
    scheduler.speculation.proposer = ReferenceProposer(references, 3, exact=False, seed=1)
    before = dict(spec.get_stats())
    try:
        got = outcomes(spec, prompts, params)
    finally:
        scheduler.speculation.proposer = saved
    assert got == want
    stats = spec.get_stats()
    accepted = stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    proposed = stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    assert 0 < accepted < proposed


def test_reference_proposals_are_all_accepted(tiny_checkpoints):
    """The draft-equals-target check: proposals that are the true continuation are all
    accepted, and each verified row emits k + 1 tokens. One stale or misplaced K/V entry
    would change a logit and break it."""
    path = tiny_checkpoints["llama"]
    k = 3
    plain = LLM(path, **TINY)
    spec = LLM(path, speculative_config={**NGRAM, "num_speculative_tokens": k}, **TINY)
    prompts = BASE[:4]  # short: one prefill step for all, then decodes only
    params = SamplingParams(temperature=0, max_tokens=1 + (k + 1) * 6)  # 6 full verify steps
    references = references_of(plain, prompts, params)
    spec.llm_engine.scheduler.speculation.proposer = ReferenceProposer(references, k, exact=True)
    calls = spec.llm_engine.step_profile["calls"]
    got = references_of(spec, prompts, params)
    assert got == references
    stats = spec.get_stats()
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["spec_mean_accepted_length"] == k + 1
    assert stats["spec_num_drafts"] == 4 * 6
    assert spec.llm_engine.step_profile["calls"] - calls == 1 + 6  # prefill, 6 verifies


@pytest.mark.parametrize("mode", every_nth(["recompute", "swap"], 2))  # swap: slow
def test_preemption_and_aborts_with_speculation_leak_no_block(tiny_checkpoints, mode):
    """Few KV blocks: requests are preempted (both modes) between verify steps with
    every accept length; a few are aborted mid-run. Survivors match plain decoding and
    every block is free afterwards (the suite's autouse check)."""
    path = tiny_checkpoints["llama"]
    options = {**TINY, "num_kv_blocks": 40, "preemption_mode": mode}
    plain = LLM(path, **options)
    spec = LLM(path, speculative_config=NGRAM, **options)
    prompts = (BASE * 2)[:12]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=48)
              for i in range(12)]
    want = outcomes(plain, prompts, params)
    assert plain.get_stats()["num_preemptions"] > 0
    references = {}
    for o in plain.generate(prompts, params, use_tqdm=False):
        references[tuple(o.prompt_token_ids)] = list(o.outputs[0].token_ids)
    spec.llm_engine.scheduler.speculation.proposer = ReferenceProposer(references, 3, exact=False, seed=2)
    assert outcomes(spec, prompts, params) == want
    assert spec.get_stats()["num_preemptions"] > 0

    engine = spec.llm_engine
    ids = [engine.add_request(None, prompt, p) for prompt, p in zip(prompts, params)]
    rng = np.random.default_rng(3)
    for step in range(60):
        engine.step()
        if step in (5, 11, 20):
            engine.abort_request([ids[i] for i in rng.choice(12, 3, replace=False)])
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # hand back anything still in flight


def test_qwen2_ngram_matches_plain(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    plain = LLM(path, **TINY)
    spec = LLM(path, speculative_config=NGRAM, **TINY)
    prompts = REPEATING + BASE[4:16]
    params = [SamplingParams(temperature=0.0 if i % 3 else 1.0, seed=i, max_tokens=24)
              for i in range(len(prompts))]
    assert outcomes(spec, prompts, params) == outcomes(plain, prompts, params)


@pytest.mark.slow  # ~45 s on 2 cores; sampled rows equal plain decoding in the default suite
# (test_every_accept_length_gives_the_plain_tokens at temperature 1)
def test_seeded_samples_are_the_plain_samples_seed_for_seed(llama_engines):
    """128 seeded requests, temperature 1 and top-p 0.8, proposals of every accept length:
    the first tokens of each are those of plain decoding with the same seed. Equal draws
    per seed imply equal distributions (what a chi-square test would check, exactly)."""
    plain, spec = llama_engines["plain"], llama_engines["spec"]
    prompt = [BASE[0]] * 128
    for top_p in (1.0, 0.8):
        params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s, max_tokens=4)
                  for s in range(128)]
        want = [list(o.outputs[0].token_ids) for o in plain.generate(prompt, params,
                                                                   use_tqdm=False)]
        assert len({tuple(w) for w in want}) > 64  # the seeds do draw different tokens

        class Junk:
            rng = np.random.default_rng(4)

            def propose(self, request, max_tokens):
                n = len(request.output_token_ids)
                options = [w for w in want if w[:n] == list(request.output_token_ids)]
                guess = options[int(self.rng.integers(len(options)))][n:n + max_tokens]
                return guess if self.rng.random() < 0.7 else [7] * min(3, max_tokens)

        scheduler = spec.llm_engine.scheduler
        saved, scheduler.speculation.proposer = scheduler.speculation.proposer, Junk()
        try:
            got = [list(o.outputs[0].token_ids) for o in spec.generate(prompt, params,
                                                                     use_tqdm=False)]
        finally:
            scheduler.speculation.proposer = saved
        assert got == want


def test_bad_speculative_configs_and_beam_search_are_refused(tiny_checkpoints, llama_engines):
    path = tiny_checkpoints["llama"]
    for config, message in [({"method": "eagle"}, "method='eagle'"),
                            ({"num_speculative_tokens": 0}, "num_speculative_tokens=0"),
                            ({"prompt_lookup_min": 4, "prompt_lookup_max": 2},
                             "prompt_lookup_min=4"),
                            ({"lookahead": 2}, "lookahead"),
                            ("ngram", "must be None or a dict")]:
        with pytest.raises(ValueError, match=message):
            LLM(path, speculative_config=config, **TINY)
    with pytest.raises(ValueError, match="beam search is not supported with speculative"):
        llama_engines["spec"].beam_search([BASE[0]], BeamSearchParams(beam_width=2,
                                                                      max_tokens=4))


def test_penalized_rows_speculate_and_keep_plain_decoding_tokens(tmp_path):
    """Presence, frequency and repetition penalties at a proposal's position count the
    proposals before it: proposals that are plain decoding's own continuation are all
    accepted (a penalty that missed them would change the target's choice somewhere).
    A 24-token vocabulary, so that outputs repeat tokens and penalties matter."""
    from tests.reference import make_token_id_checkpoint

    path = make_token_id_checkpoint(str(tmp_path / "small"), vocab_size=24, seed=5)
    k = 3
    plain = LLM(path, **TINY)
    spec = LLM(path, speculative_config={**NGRAM, "num_speculative_tokens": k}, **TINY)
    prompts = [{"prompt_token_ids": ids} for ids in ([3, 7, 11, 5], [9, 9, 2, 4, 6],
                                                      [12, 3, 3, 8], [20, 1, 5, 7, 7, 2])]
    base = dict(max_tokens=25, ignore_eos=True)
    params = [SamplingParams(temperature=0, frequency_penalty=1.5, **base),
              SamplingParams(temperature=0, repetition_penalty=1.8, **base),
              SamplingParams(temperature=0.9, seed=3, presence_penalty=1.2, **base),
              SamplingParams(temperature=0, presence_penalty=0.8, frequency_penalty=0.8,
                             repetition_penalty=1.3, **base)]
    references = references_of(plain, prompts, params)
    unpenalized = references_of(plain, prompts, SamplingParams(temperature=0, **base))
    assert references != unpenalized  # the penalties do change the outputs here
    spec.llm_engine.scheduler.speculation.proposer = ReferenceProposer(references, k, exact=True)
    assert references_of(spec, prompts, params) == references
    stats = spec.get_stats()
    assert stats["spec_num_drafts"] >= 4 * 5
    assert stats["spec_acceptance_rate"] == 1.0


def test_no_proposals_while_a_grammar_request_runs(llama_engines):
    """A request with a grammar needs a mask per token, which a verify step does not take:
    while one is in the scheduler no row carries proposals (not even a free request's),
    the constrained output conforms, and speculation resumes once it is gone."""
    import re

    from jaxpage import StructuredOutputsParams

    spec = llama_engines["spec"]
    scheduler = spec.llm_engine.scheduler

    class Always:  # proposes on every row, so any speculation would show
        def propose(self, request, max_tokens):
            return [5] * min(3, max_tokens)

    saved, scheduler.speculation.proposer = scheduler.speculation.proposer, Always()
    try:
        before = spec.get_stats()["spec_num_drafts"]
        constrained = SamplingParams(temperature=0, max_tokens=12, structured_outputs=
                                     StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))
        free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outputs = spec.generate(BASE[:2], [constrained, free])
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outputs[0].outputs[0].text)
        assert spec.get_stats()["spec_num_drafts"] == before
        spec.generate(BASE[2:3], free)
        assert spec.get_stats()["spec_num_drafts"] > before
    finally:
        scheduler.speculation.proposer = saved
