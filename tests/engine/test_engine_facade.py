"""LLMEngine's own API, as vLLM users call it: add_request, step, abort_request, counts."""

from jaxpage import SamplingParams


def test_step_loop_with_aborts_by_list(tiny_llm):
    engine = tiny_llm.llm_engine
    assert engine.get_tokenizer() is tiny_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": [20 + i, 30, 40]}, params)
           for i in range(3)]
    engine.add_request("fork", {"prompt_token_ids": [7, 8, 9]},
                       SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=5))
    assert engine.get_num_unfinished_requests() == 4  # the fork's second sequence comes later
    engine.step()
    engine.abort_request([ids[0], "fork", "no-such-id"])  # several at once, unknown ignored
    engine.abort_request(ids[1])
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert list(finished) == [ids[2]] and len(finished[ids[2]]) == 5
    assert engine.get_num_unfinished_requests() == 0
