"""Overlapped scheduling (``async_scheduling``, the default) gives exactly the tokens of
the engine that waits for every call before scheduling the next, at K=1 and K=8.

While the device runs one call the host schedules the next from what it already knows;
the sampled tokens reach that call on the device. Stops, ``max_tokens``, aborts and
preemption must stay exact: no request returns a token past its stop, and no KV block
leaks (the suite's autouse check also asserts every block is free after each test).
"""

import pytest

from jaxpage import LLM, SamplingParams
from tests.engine.outcomes import outcomes
from tests.engine.prompts import BASE
from tests.options import TINY


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return {"sync": LLM(path, num_scheduler_steps=1, async_scheduling=False, **TINY),
            "k1": LLM(path, num_scheduler_steps=1, **TINY),
            "k8": LLM(path, num_scheduler_steps=8, **TINY)}


def summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outputs]


def mixed_params(free):
    """Stops that land at different steps, from a free greedy run's tokens and text."""
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (30, 30, 30, 13, 1, 21, 2, 30)]
    params[1] = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[free[1][0][0][5]])
    params[2] = SamplingParams(temperature=0, max_tokens=30, stop=[free[2][0][1][8:11]])
    params[3] = SamplingParams(temperature=0, max_tokens=13, min_tokens=9,
                               stop_token_ids=[free[3][0][0][2]])
    params[5] = SamplingParams(temperature=0.8, seed=11, max_tokens=21, presence_penalty=0.5,
                               repetition_penalty=1.2, logprobs=2)
    params[6] = SamplingParams(temperature=1.0, seed=5, max_tokens=2, n=2)
    params[7] = SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=30,
                               stop=[free[7][0][1][4:7]])
    return params


@pytest.mark.parametrize("name", ["k1", "k8"])
def test_stops_lengths_and_sampling_match_the_waiting_engine(engines, name):
    prompts = BASE[:8]
    free = outcomes(engines["sync"], prompts, SamplingParams(temperature=0, max_tokens=30))
    eos = free[0][0][0][11]  # a token the first prompt produces at step 12: its EOS
    params = mixed_params(free)
    want = outcomes(engines["sync"], prompts, params, eos=eos)
    overlapped = engines[name].llm_engine.step_profile["chained"]
    got = outcomes(engines[name], prompts, params, eos=eos)
    assert got == want
    assert want[0][0][2] == "stop" and len(want[0][0][0]) <= 12
    assert [len(w[0][0]) for w in want[3:5]] == [13, 1]
    assert engines[name].llm_engine.step_profile["chained"] > overlapped  # calls overlapped


def test_a_prefix_shared_after_a_stop_is_intact(engines):
    """A request that stops while its next step is already queued: that step writes past
    its end into a block of its own, never into the full blocks it leaves in the prefix
    cache, which a later request then reads."""
    first = BASE[3]
    base = outcomes(engines["sync"], [first], SamplingParams(temperature=0, max_tokens=24))[0][0]
    stop_id = base[0][17]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    for name in ("k1", "k8"):
        stopped = outcomes(engines[name], [first], params)[0][0]
        assert stopped[0] == base[0][:base[0].index(stop_id) + 1]
        follow = {"prompt_token_ids": engines[name].get_tokenizer()(first)["input_ids"]
                  + stopped[0] + [5, 6, 7]}
        again = SamplingParams(temperature=0, max_tokens=12)
        cached = engines[name].llm_engine.kv_cache_manager.num_prefix_hit_tokens
        got = outcomes(engines[name], [follow], again)
        assert engines[name].llm_engine.kv_cache_manager.num_prefix_hit_tokens > cached
        assert got == outcomes(engines["sync"], [follow], again)


@pytest.mark.parametrize("steps", [1, 8])
def test_preemption_matches_the_waiting_engine(tiny_checkpoints, steps):
    """A cache too small for every request at once: requests are preempted (only ever by
    a schedule made with nothing in flight) and still give the waiting engine's tokens."""
    options = dict(TINY, num_kv_blocks=20, max_num_batched_tokens=64)
    path = tiny_checkpoints["llama"]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=33, ignore_eos=True)] * 4
    prompts = BASE[8:16]
    results = {}
    for name, extra in (("sync", {"async_scheduling": False}), ("overlap", {})):
        llm = LLM(path, num_scheduler_steps=steps, **options, **extra)
        results[name] = outcomes(llm, prompts, params)
        assert llm.get_stats()["num_preemptions"] > 0, name
        if name == "overlap":
            assert llm.llm_engine.step_profile["chained"] > 0
    assert results["overlap"] == results["sync"]


@pytest.mark.parametrize("name", ["k1", "k8"])
def test_aborts_while_a_call_is_queued(engines, name):
    """Aborting requests whose next call is already on the device frees their blocks at
    once; the others finish exactly as if the aborted ones had never been there."""
    engine = engines[name].llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=21, max_tokens=25, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompts, params = BASE[:6], [greedy, seeded] * 2 + [long, long]
    want = outcomes(engines["sync"], prompts[:4], params[:4])
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done = {}
    for victim in ids[4:]:
        for _ in range(2):
            done.update((o.request_id, o) for o in engine.step())
        for _ in range(5):
            if engine.device_calls.inflight is not None:
                break
            done.update((o.request_id, o) for o in engine.step())
        assert engine.device_calls.inflight is not None  # the next call is queued
        free_before = engine.block_pool.num_free_blocks
        engine.abort_request(victim)
        assert engine.block_pool.num_free_blocks > free_before
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    assert sorted(done) == sorted(ids[:4])
    assert summary(done[i] for i in ids[:4]) == want
    assert engine.num_used_blocks() == 0


def test_steady_decoding_is_scheduled_from_the_call_before(engines):
    """Decoding the same requests step after step (K=1) is scheduled and built from the
    call in flight alone; every such step is checked against the row by row scheduler
    and batch build (the suite's ``check_fast_paths``), block boundaries (block size 8)
    and requests finishing, joining from the queue (more than ``max_num_seqs``) and
    stopping on ids and strings included, with exactly the waiting engine's tokens."""
    free = outcomes(engines["sync"], BASE[:12], SamplingParams(temperature=0, max_tokens=40))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (40, 17, 33, 9, 40, 25, 12, 40, 31, 40, 8, 22)]
    params[2] = SamplingParams(temperature=0.8, seed=9, max_tokens=33, ignore_eos=True)
    params[5] = SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[free[5][0][0][19]])
    params[8] = SamplingParams(temperature=0, max_tokens=31, stop=[free[8][0][1][30:33]])
    params[9] = SamplingParams(temperature=1.0, top_p=0.9, seed=4, max_tokens=40,
                               ignore_eos=True, logprobs=1)
    want = outcomes(engines["sync"], BASE[:12], params)
    profile = engines["k1"].llm_engine.step_profile
    steady = profile["steady"]
    assert outcomes(engines["k1"], BASE[:12], params) == want
    assert profile["steady"] - steady >= 20
