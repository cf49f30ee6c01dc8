"""Steady decoding at K=1 applies its tokens through the scheduler's ``SteadyBatch``
(``StepApplier.apply``'s vectorized path) instead of request by request: tokens, stops,
lengths, streamed deltas, aborts, preemptions and prefix-cache hits are exactly the
waiting engine's (which never takes that path), and no KV block leaks (the suite's
autouse check).

The suite's fast-path checks (``check_fast_paths``, set in ``tests/conftest.py``) sync the
steady batch at every step they check, which would hide a missing sync point; this
module turns them off, so what is tested is the engine as it runs in production."""

import dataclasses

import pytest

from jaxpage import LLM, SamplingParams
from tests.engine.outcomes import outcomes
from tests.engine.prompts import BASE
from tests.options import TINY


@pytest.fixture(autouse=True)
def production_paths(monkeypatch):
    """No fast-path checks (they sync the steady batch): production sync points only."""
    from jaxpage.core.batch.builder import BatchBuilder
    from jaxpage.core.sched.ahead_of_host import AheadOfHost

    monkeypatch.setattr(AheadOfHost, "check_fast_paths", False)
    monkeypatch.setattr(BatchBuilder, "check_fast_paths", False)


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return {"sync": LLM(path, num_scheduler_steps=1, async_scheduling=False, **TINY),
            "k1": LLM(path, num_scheduler_steps=1, **TINY)}


def steady_steps(llm) -> int:
    return llm.llm_engine.scheduler.applier.num_steady_steps


def test_stops_lengths_and_sampling_match_the_waiting_engine(engines):
    free = outcomes(engines["sync"], BASE[:8], SamplingParams(temperature=0, max_tokens=40))
    eos = free[0][0][0][21]  # a token the first prompt makes at step 22: its EOS
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (40, 40, 33, 9, 40, 26, 1, 40)]
    params[1] = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[free[1][0][0][17]])
    params[2] = SamplingParams(temperature=0.9, seed=5, max_tokens=33, ignore_eos=True)
    params[4] = SamplingParams(temperature=0, max_tokens=40, min_tokens=30,
                               stop_token_ids=[free[4][0][0][3], free[4][0][0][31]])
    params[5] = SamplingParams(temperature=1.0, seed=8, max_tokens=26, n=2, ignore_eos=True)
    params[7] = SamplingParams(temperature=0.7, seed=2, max_tokens=40, ignore_eos=True,
                               include_stop_str_in_output=True)
    want = outcomes(engines["sync"], BASE[:8], params, eos=eos)
    before = steady_steps(engines["k1"])
    assert outcomes(engines["k1"], BASE[:8], params, eos=eos) == want
    assert steady_steps(engines["k1"]) - before >= 15
    assert want[0][0][2] == "stop" and len(want[0][0][0]) == 22
    assert want[1][0][2] == "stop" and len(want[1][0][0]) <= 18
    assert len(want[4][0][0]) >= 30 and [len(w[0][0]) for w in (want[3], want[6])] == [9, 1]


def test_streamed_deltas_add_up_to_the_waiting_engines_tokens(engines):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=kind)
              for n, kind in ((30, "delta"), (23, "final"), (30, "delta"), (17, "delta"))]
    want = outcomes(engines["sync"], BASE[8:12], [dataclasses.replace(p, output_kind="final")
                                                   for p in params])
    engine = engines["k1"].llm_engine
    before = steady_steps(engines["k1"])
    ids = [engine.add_request(None, p, sp) for p, sp in zip(BASE[8:12], params)]
    tokens = {i: [] for i in ids}
    finals = {}
    deltas_per_step = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        deltas_per_step.append(sum(o.request_id in (ids[0], ids[2], ids[3]) for o in outputs))
        for output in outputs:
            tokens[output.request_id] += output.outputs[0].token_ids
            if output.finished:
                finals[output.request_id] = output.outputs[0].finish_reason
    assert [tokens[i] for i in ids] == [w[0][0] for w in want]
    assert [finals[i] for i in ids] == ["length"] * 4
    assert steady_steps(engines["k1"]) - before >= 10
    assert max(deltas_per_step) == 3  # every streaming request reported on a steady step


def test_aborts_while_in_the_steady_batch(engines):
    """Requests aborted while their next step is on the device (their rows written after
    they left) free their blocks at once; the others finish as if alone."""
    engine = engines["k1"].llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=21, max_tokens=30, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompts, params = BASE[:6], [greedy, seeded] * 2 + [long, long]
    want = outcomes(engines["sync"], prompts[:4], params[:4])
    before = steady_steps(engines["k1"])
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done = {}
    for victim in ids[4:]:
        while steady_steps(engines["k1"]) - before < 5 or engine.device_calls.inflight is None:
            done.update((o.request_id, o) for o in engine.step())
        free_before = engine.block_pool.num_free_blocks
        engine.abort_request(victim)
        assert engine.block_pool.num_free_blocks > free_before
        before = steady_steps(engines["k1"])
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    assert sorted(done) == sorted(ids[:4])
    got = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in done[i].outputs]
           for i in ids[:4]]
    assert got == want
    assert engine.num_used_blocks() == 0


def test_preemption_matches_the_waiting_engine(tiny_checkpoints):
    options = dict(TINY, num_kv_blocks=24, max_num_batched_tokens=64)
    path = tiny_checkpoints["llama"]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=37, ignore_eos=True)] * 3
    results = {}
    for name, extra in (("sync", {"async_scheduling": False}), ("k1", {})):
        llm = LLM(path, num_scheduler_steps=1, **options, **extra)
        results[name] = outcomes(llm, BASE[8:14], params)
        assert llm.get_stats()["num_preemptions"] > 0, name
        results[name + " steady"] = steady_steps(llm)
    assert results["k1"] == results["sync"]
    assert results["k1 steady"] > 0 and results["sync steady"] == 0


def test_blocks_filled_in_the_steady_batch_are_cached(engines):
    """Blocks a request fills while its tokens wait in the steady batch enter the prefix cache as they fill: a later prompt
    repeating its prompt and output hits as many tokens as on the waiting engine."""
    prompt = BASE[5]
    params = SamplingParams(temperature=0, max_tokens=35, ignore_eos=True)
    hits = {}
    for name in ("sync", "k1"):
        llm = engines[name]
        before = steady_steps(llm)
        first = outcomes(llm, [prompt], params)[0][0]
        follow = {"prompt_token_ids": llm.get_tokenizer()(prompt)["input_ids"] + first[0]}
        manager = llm.llm_engine.kv_cache_manager
        cached = manager.num_prefix_hit_tokens
        outcomes(llm, [follow], SamplingParams(temperature=0, max_tokens=4))
        hits[name] = (manager.num_prefix_hit_tokens - cached, steady_steps(llm) > before)
    assert hits["k1"] == (hits["sync"][0], True) and hits["sync"][0] >= 32


def test_a_sibling_that_stops_first_takes_no_later_token(engines):
    """n=2: the sibling that stops first leaves the steady batch then; its group's output
    comes steps later, when the other one finishes, and holds no token written in
    between."""
    free_params = SamplingParams(temperature=1.0, seed=8, max_tokens=30, n=2, ignore_eos=True)
    free = outcomes(engines["sync"], [BASE[6]], free_params)[0]
    stop = next(t for t in free[0][0][4:] if t not in free[1][0])
    params = dataclasses.replace(free_params, stop_token_ids=[stop])
    want = outcomes(engines["sync"], [BASE[6]], params)
    before = steady_steps(engines["k1"])
    assert outcomes(engines["k1"], [BASE[6]], params) == want
    assert steady_steps(engines["k1"]) - before >= 10
    assert len(want[0][0][0]) < 30 and len(want[0][1][0]) == 30


def test_a_batch_rebuilt_from_the_requests_mid_run_reads_their_steady_tokens(tiny_checkpoints):
    """A continuing build whose block-table bucket grows falls back to building from the
    requests' state while the steady batch still holds their newest tokens: the builder
    syncs them first (``BatchBuilder.sync_requests``). Checked with the suite's fast-path
    checks off (``production_paths``), with the jnp reference attention and every
    block-width rung (1, 2, 4, ... blocks: several rebuilds along 40 tokens)."""
    path = tiny_checkpoints["llama"]
    options = dict(TINY, bucket_growth=2, attention_backend="reference")
    steady = LLM(path, num_scheduler_steps=1, **options)
    waiting = LLM(path, num_scheduler_steps=1, async_scheduling=False, **options)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    got = outcomes(steady, BASE[:4], params)
    assert steady_steps(steady) >= 20
    assert got == outcomes(waiting, BASE[:4], params)
