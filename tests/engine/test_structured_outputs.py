"""Structured outputs on the tiny random Llama (SmolLM2's tokenizer): its free outputs are
gibberish, so every well-formed output below is the grammar's doing.

Covers the offline API (``SamplingParams.structured_outputs``): regex, choice, JSON
schema, Lark grammar, json_object, n > 1, preemption, stop strings inside a constrained
output, bad specs (ValueError, no block held), and the device mask itself (random masks,
thousands of sampled tokens, each inside its own row's mask).
"""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import numpy as np
import pytest

from jaxpage import LLM, SamplingParams, StructuredOutputsParams
from tests.options import TINY


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], **TINY)


def _texts(llm, prompts, params):
    return [[c.text for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS = ["Hello there", "The weather today", "1 2 3", "Write JSON:"]


def test_regex_choice_and_grammar_outputs_conform(llm):
    cases = [
        (StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
         lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (StructuredOutputsParams(regex=r"(cat|dog)s? (run|sleep)"),
         lambda t: re.fullmatch(r"(cat|dog)s? (run|sleep)", t)),
        (StructuredOutputsParams(choice=["yes", "no", "maybe later"]),
         lambda t: t in ("yes", "no", "maybe later")),
    ]
    for spec, ok in cases:
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_tokens=24, temperature=temperature, seed=3,
                                    structured_outputs=spec)
            for texts in _texts(llm, PROMPTS, params):
                assert all(ok(t) for t in texts), (spec, texts)


LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


def test_lark_grammar_outputs_parse_with_lark(llm):
    parser = lark.Lark(LARK)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5,
                            structured_outputs=StructuredOutputsParams(grammar=LARK))
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finished = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert finished, [o.outputs[0].text for o in outputs]
    for out in finished:
        parser.parse(out.text)


SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "tag": {"enum": ["a", "b"]}},
          "required": ["ok", "n", "tag"]}


def test_json_schema_and_json_object(llm):
    for spec, schema in ((StructuredOutputsParams(json=SCHEMA), SCHEMA),
                         (StructuredOutputsParams(json=json.dumps(SCHEMA),
                                                  disable_any_whitespace=True), SCHEMA)):
        params = SamplingParams(max_tokens=60, temperature=0.8, seed=1, structured_outputs=spec)
        for texts in _texts(llm, PROMPTS, params):
            jsonschema.validate(json.loads(texts[0]), schema)
    # Any JSON object: the random model must close what it opens within max_tokens, so
    # only finished outputs are checked, and at least one must finish.
    params = SamplingParams(max_tokens=48, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for out in outs:
        assert out.text.lstrip().startswith("{"), out.text
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


def test_n_siblings_each_follow_the_grammar(llm):
    spec = StructuredOutputsParams(choice=["alpha", "beta", "gamma", "delta"])
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=11,
                            structured_outputs=spec)
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for output in outputs:
        assert len(output.outputs) == 4
        assert all(c.text in spec.choice and c.finish_reason == "stop" for c in output.outputs)


def test_stop_string_inside_a_constrained_output(llm):
    spec = StructuredOutputsParams(regex=r"abc-[0-9]{2}-xyz")
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=["-"], structured_outputs=spec)
    for texts in _texts(llm, PROMPTS[:2], params):
        assert texts == ["abc"]


def test_greedy_constrained_is_deterministic_and_mixes_with_free_requests(llm):
    spec = StructuredOutputsParams(regex=r"[a-z]{4,8}")
    constrained = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=spec)
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone_free = _texts(llm, PROMPTS, free)
    alone_constrained = _texts(llm, PROMPTS, constrained)
    mixed = llm.generate(PROMPTS + PROMPTS, [constrained] * 4 + [free] * 4, use_tqdm=False)
    assert [[c.text for c in o.outputs] for o in mixed] == alone_constrained + alone_free
    assert all(re.fullmatch(r"[a-z]{4,8}", t[0]) for t in alone_constrained)


def test_bad_specs_are_value_errors_and_hold_no_blocks(llm):
    engine = llm.llm_engine
    free_before = engine.block_pool.num_free_blocks
    bad = [dict(regex="a(b"), dict(json={"type": "object", "properties": {"x": {"type": "nope"}}}),
           dict(grammar="start: foo\nfoo: (")]
    for fields in bad:
        params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**fields))
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(["x"], params, use_tqdm=False)
    for fields in (dict(), dict(regex="a", choice=["b"]), dict(choice=[]), dict(json="{x")):
        with pytest.raises(ValueError, match="StructuredOutputsParams"):
            StructuredOutputsParams(**fields)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    assert engine.block_pool.num_free_blocks == free_before
    assert not engine.scheduler.has_constrained
    # The engine goes on serving.
    assert _texts(llm, ["ok"], SamplingParams(max_tokens=3, temperature=0,
                                              structured_outputs=StructuredOutputsParams(
                                                  choice=["fine"]))) == [["fine"]]


def test_one_compile_per_distinct_spec(llm):
    grammars = llm.llm_engine.grammars
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"q": {"type": "integer"}}})
    same = StructuredOutputsParams(json=json.dumps({"properties": {"q": {"type": "integer"}},
                                                    "type": "object"}))
    before = grammars.num_compiles
    params = [SamplingParams(max_tokens=8, structured_outputs=s) for s in (spec, same, spec)]
    llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert grammars.num_compiles == before + 1


def test_preemption_by_recompute_keeps_the_grammar(tiny_checkpoints):
    # 16 blocks of 8 tokens for 8 requests growing past 40 tokens each: some are preempted
    # and recomputed; their grammar state must carry on from their output.
    llm = LLM(tiny_checkpoints["llama"], **{**TINY, "num_kv_blocks": 16,
                                            "preemption_mode": "recompute"})
    pattern = r"[a-z]{60,80}"
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=2,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    outputs = llm.generate([p * 2 for p in PROMPTS + PROMPTS], params, use_tqdm=False)
    assert llm.get_stats()["num_preemptions"] > 0
    for output in outputs:
        assert re.fullmatch(pattern, output.outputs[0].text), output.outputs[0].text


class _RandomMaskMatcher:
    """A stand-in grammar whose every mask is random: tests that the device applies the
    mask of the right row (``fill_masks`` is replaced below)."""

    def __init__(self):
        self.masks: dict[int, np.ndarray] = {}   # output count -> the mask filled then

    def consume_token(self, token):
        return True

    def is_error(self):
        return False

    def is_stopped(self):
        return False


class _State:
    def __init__(self):
        self.matcher = _RandomMaskMatcher()
        self.consumed = 0


RANDOM_MASK_STEPS = 120  # tokens a request; 7 masked requests and one free row a step


def test_random_masks_are_never_violated(llm, monkeypatch):
    engine = llm.llm_engine
    grammars = engine.grammars
    rng = np.random.default_rng(0)
    vocab = engine.arch.vocab_size
    requests = {}

    def fill_masks(rows, num_rows):
        mask = np.full((num_rows, grammars.mask_words), -1, np.int32)
        for row, state in rows:
            allowed = rng.random(vocab) < rng.choice([0.001, 0.01, 0.2])
            allowed[rng.integers(vocab)] = True
            bits = np.zeros(grammars.mask_words * 32, bool)
            bits[:vocab] = allowed
            mask[row] = np.packbits(bits, bitorder="little").view(np.int32)
            request = requests[id(state)]
            state.matcher.masks[len(request.output_token_ids)] = allowed
        return mask

    monkeypatch.setattr(grammars, "fill_masks", fill_masks)
    params = [SamplingParams(max_tokens=RANDOM_MASK_STEPS, ignore_eos=True, temperature=t,
                             top_k=k, top_p=p, min_p=m, seed=i, presence_penalty=pp)
              for i, (t, k, p, m, pp) in enumerate([
                  (0.0, -1, 1.0, 0.0, 0.0), (1.0, -1, 1.0, 0.0, 0.0), (0.7, 50, 1.0, 0.0, 0.5),
                  (1.3, -1, 0.9, 0.0, 0.0), (1.0, 5, 0.5, 0.0, 0.0), (0.0, -1, 1.0, 0.0, 1.0),
                  (2.0, -1, 1.0, 0.05, 0.0)])]
    made = []
    for i, p in enumerate(params):
        request = engine.make_request(f"mask-{i}", {"prompt_token_ids": [5 + i, 17, 300 + i]}, p)
        request.grammar = _State()
        requests[id(request.grammar)] = request
        made.append(request)
    free = engine.make_request("free", {"prompt_token_ids": [9, 9, 9]},
                               SamplingParams(max_tokens=RANDOM_MASK_STEPS, ignore_eos=True,
                                              temperature=1.0))
    for request in made + [free]:
        engine.add_validated_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    checked = 0
    for request in made:
        tokens = request.output_token_ids
        assert len(tokens) == RANDOM_MASK_STEPS
        for k, token in enumerate(tokens):
            assert request.grammar.matcher.masks[k][token], (request.request_id, k, token)
            checked += 1
    assert checked == 7 * RANDOM_MASK_STEPS
