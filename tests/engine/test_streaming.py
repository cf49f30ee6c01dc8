"""Streaming: ``output_kind="delta"`` outputs add up to exactly the final outputs."""

from collections import defaultdict

from jaxpage import SamplingParams
from jaxpage.engine.output_processor import held_back
from tests.engine.prompts import BASE


def test_held_back_covers_partial_characters_and_stop_prefixes():
    assert held_back("abc", ()) == 0
    assert held_back("abc\ufffd\ufffd", ()) == 2
    assert held_back("hello wo", ("world",)) == 2
    assert held_back("hello w", ("xyz", "wo", " w")) == 1
    assert held_back("hello w", ("xyz", " wo")) == 2
    assert held_back("hello", ("hello",)) == 0  # a whole stop string is the search's job
    assert held_back("ab\ufffd", ("\ufffdzz",)) == 1


def stream(engine, prompts, params):
    """Run requests with delta outputs; returns {(request, index): [deltas]} and the outputs."""
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    deltas, outputs = defaultdict(list), defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
            for completion in out.outputs:
                deltas[out.request_id, completion.index].append(completion)
    return ids, deltas, outputs


def test_deltas_concatenate_to_the_final_outputs(tiny_llm):
    engine = tiny_llm.llm_engine
    free = tiny_llm.generate(BASE[:2], SamplingParams(temperature=0, max_tokens=40),
                             use_tqdm=False)
    stop = free[1].outputs[0].text[10:14]
    finals = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
              SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=23, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1)]
    prompts = [BASE[0], BASE[1], BASE[2], BASE[3]]
    want = tiny_llm.generate(prompts, finals, use_tqdm=False)
    deltas_params = [SamplingParams(**{**p.__dict__, "output_kind": "delta"}) for p in finals]
    ids, deltas, outputs = stream(engine, prompts, deltas_params)
    assert want[1].outputs[0].stop_reason == stop  # the stop string really stopped it
    for request_id, final in zip(ids, want):
        sent = outputs[request_id]
        assert [o.finished for o in sent] == [False] * (len(sent) - 1) + [True]
        for completion in final.outputs:
            parts = deltas[request_id, completion.index]
            assert "".join(p.text for p in parts) == completion.text
            assert sum((p.token_ids for p in parts), []) == completion.token_ids
            assert [p.finish_reason for p in parts][-1] == completion.finish_reason
            assert all(p.finish_reason is None for p in parts[:-1])
    assert len(outputs[ids[0]]) > 3  # 40 tokens arrive in several pieces, not at the end
    assert engine.num_used_blocks() == 0
