"""Stop strings, stop token ids, min_tokens, ignore_eos and max_tokens end requests correctly."""

import pytest

from jaxpage import SamplingParams
from tests.engine.prompts import BASE

PROMPT = BASE[3]


@pytest.fixture(scope="module")
def free_run(tiny_llm):
    """The greedy continuation with no stop rule."""
    return tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40),
                             use_tqdm=False)[0].outputs[0]


def test_max_tokens_gives_length(free_run):
    assert len(free_run.token_ids) == 40 and free_run.finish_reason == "length"
    assert free_run.stop_reason is None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(tiny_llm, free_run, include):
    text = free_run.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    first = text.index(stop)
    out = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                     include_stop_str_in_output=include),
                            use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (text[:first + len(stop)] if include else text[:first])
    assert out.token_ids == free_run.token_ids[:len(out.token_ids)]
    assert len(out.token_ids) < 40


def test_stop_token_id_ends_with_that_token(tiny_llm, free_run):
    stop_id = free_run.token_ids[5]
    first = free_run.token_ids.index(stop_id)
    out = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40,
                                                     stop_token_ids=[stop_id]),
                            use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_min_tokens_suppresses_stop_tokens_until_reached(tiny_llm, free_run):
    stop_id = free_run.token_ids[0]
    out = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, min_tokens=4,
                                                     stop_token_ids=[stop_id]),
                            use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:4]
    assert len(out.token_ids) >= 4


def test_eos_stops_unless_ignored(tiny_llm, free_run):
    engine = tiny_llm.llm_engine
    eos = free_run.token_ids[2]
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({eos})  # pretend this token is EOS
    try:
        stopped = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40),
                                    use_tqdm=False)[0].outputs[0]
        ignored = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40,
                                                             ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0]
    finally:
        engine.eos_token_ids = saved
    first = free_run.token_ids.index(eos)
    assert stopped.token_ids == free_run.token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert ignored.token_ids == free_run.token_ids and ignored.finish_reason == "length"


def test_context_limit_clips_max_tokens(tiny_llm):
    ids = list(range(100, 100 + 250))
    out = tiny_llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0,
                                                                        max_tokens=100),
                            use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 256 - 250 and out.finish_reason == "length"


def test_max_tokens_none_runs_to_the_context_limit(tiny_llm):
    ids = list(range(100, 100 + 240))
    out = tiny_llm.generate([{"prompt_token_ids": ids}],
                            SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 16
