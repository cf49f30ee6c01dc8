"""Multi-step decode (K iterations per device call) gives exactly the single-step outputs."""

import pytest

from jaxpage import LLM, SamplingParams
from tests.engine.outcomes import outcomes
from tests.engine.prompts import BASE
from tests.options import TINY


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    return (LLM(tiny_checkpoints["llama"], num_scheduler_steps=1, **TINY),
            LLM(tiny_checkpoints["llama"], num_scheduler_steps=8, **TINY))


def run(llm, prompts, params, eos=None):
    """The first completion's (token ids, text, finish reason, stop reason) per request."""
    return [completions[0] for completions in outcomes(llm, prompts, params, eos)]


def test_stops_in_the_middle_of_a_window_match_single_steps(engines):
    single, multi = engines
    prompts = BASE[:6]
    free = run(single, prompts, SamplingParams(temperature=0, max_tokens=30))
    eos = free[0][0][11]          # a token the first prompt produces at step 12
    stop_id = free[1][0][5]       # at step 6 for the second prompt
    stop_str = free[2][1][8:11]   # a piece of the third prompt's text
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (30, 30, 30, 13, 5, 21)]
    params[1] = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id])
    params[2] = SamplingParams(temperature=0, max_tokens=30, stop=[stop_str])
    params[3] = SamplingParams(temperature=0, max_tokens=13, min_tokens=9,
                               stop_token_ids=[free[3][0][2]])
    want = run(single, prompts, params, eos=eos)
    got = run(multi, prompts, params, eos=eos)
    assert got == want
    assert want[0][2] == "stop" and len(want[0][0]) <= 12           # EOS mid-window
    assert want[1][3] == stop_id and len(want[1][0]) <= 6           # stop token mid-window
    assert want[2][3] == stop_str                                    # stop string
    assert [len(w[0]) for w in want[3:]] == [13, 5, 21]              # max_tokens mid-window
    assert multi.llm_engine.runner.programs.decode_loops  # the multi-step path really ran
    assert multi.llm_engine.step_profile["chained"] > 0  # and calls were queued ahead


def test_seeded_sampling_and_max_model_len(engines):
    single, multi = engines
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=19)
    assert run(multi, BASE[6:10], params) == run(single, BASE[6:10], params)
    ids = list(range(100, 100 + 243))  # 13 tokens of room before max_model_len=256
    edge = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    a = run(single, [{"prompt_token_ids": ids}], edge)
    b = run(multi, [{"prompt_token_ids": ids}], edge)
    assert a == b and len(a[0][0]) == 13 and a[0][2] == "length"


def test_abort_while_a_chained_call_is_queued(engines):
    """Aborting a request whose next call is already on the device frees its blocks at once;
    the others finish exactly as if it had never been there."""
    _, multi = engines
    engine = multi.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = run(multi, BASE[:3], params)
    ids = [engine.add_request(None, prompt, params) for prompt in BASE[:4]]
    chained_before = engine.step_profile["chained"]
    while engine.step_profile["chained"] == chained_before:
        assert not engine.step()
    assert engine.device_calls.inflight is not None
    free_before = engine.block_pool.num_free_blocks
    engine.abort_request(ids[3])
    assert engine.block_pool.num_free_blocks > free_before
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    assert sorted(done) == sorted(ids[:3])
    got = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
            o.outputs[0].stop_reason) for o in (done[i] for i in ids[:3])]
    assert got == want
    assert engine.num_used_blocks() == 0
