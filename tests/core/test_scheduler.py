import numpy as np
import pytest

from jaxpage.core.request import RequestStatus
from jaxpage.core.sched.step_result import StepResult
from tests.core.helpers import make_request, make_scheduler


def run_step(scheduler, token=50):
    out = scheduler.schedule()
    tokens = np.full(max(1, len(out.scheduled)), token, np.int32)
    scheduler.apply(out, StepResult(tokens))
    return out


def scheduled(out):
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_new_requests_join_the_running_batch_at_the_next_step():
    s = make_scheduler(num_blocks=32)
    s.add_request(make_request("a", 5))
    assert scheduled(run_step(s)) == [("a", 5)]
    s.add_request(make_request("b", 3))
    assert scheduled(run_step(s)) == [("a", 1), ("b", 3)]
    assert scheduled(run_step(s)) == [("a", 1), ("b", 1)]


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=8)
    s.add_request(make_request("short", 3))
    s.add_request(make_request("long", 20))
    assert scheduled(run_step(s)) == [("short", 3), ("long", 5)]
    assert scheduled(run_step(s)) == [("short", 1), ("long", 7)]
    assert scheduled(run_step(s)) == [("short", 1), ("long", 7)]
    long = s.requests["long"]
    assert long.num_computed_tokens == 19 and long.num_output_tokens == 0
    assert scheduled(run_step(s)) == [("short", 1), ("long", 1)]
    assert long.num_output_tokens == 1


def test_finished_requests_leave_at_once_and_free_their_blocks():
    s = make_scheduler(num_blocks=32)
    s.add_request(make_request("a", 4, max_tokens=2))
    s.add_request(make_request("b", 4, max_tokens=5))
    run_step(s)
    run_step(s)
    assert [r.request_id for r in s.running] == ["b"]
    assert s.kv.block_ids("a") == []
    assert s.kv.block_pool.num_free_blocks == 31 - len(s.kv.block_ids("b"))


def test_eos_and_stop_token_finish_with_their_reasons():
    s = make_scheduler(num_blocks=32)
    s.add_request(make_request("eos", 4))
    s.add_request(make_request("stop", 4, stop_token_ids=[77]))
    out = s.schedule()
    s.apply(out, StepResult(np.array([2, 77], np.int32)))
    assert not s.has_unfinished_requests()
    assert s.kv.block_pool.num_free_blocks == 31


def test_min_tokens_defers_eos():
    s = make_scheduler(num_blocks=32)
    req = make_request("a", 4, min_tokens=2)
    s.add_request(req)
    out = s.schedule()
    s.apply(out, StepResult(np.array([2], np.int32)))
    assert req.status is RequestStatus.RUNNING
    out = s.schedule()
    s.apply(out, StepResult(np.array([2], np.int32)))
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_youngest_running_request_is_preempted_by_recompute():
    # 6 usable blocks of 4 tokens. a and b each take 3 blocks for 12-token prompts;
    # when a needs a 4th block, b (younger) is preempted and its blocks freed.
    s = make_scheduler(num_blocks=7)
    a, b = make_request("a", 12), make_request("b", 12)
    s.add_request(a)
    s.add_request(b)
    assert scheduled(run_step(s)) == [("a", 12), ("b", 12)]
    assert s.kv.block_ids("a") == [1, 2, 3] and s.kv.block_ids("b") == [4, 5, 6]
    out = run_step(s)
    assert scheduled(out) == [("a", 1)]
    assert [r.request_id for r in out.preempted] == ["b"]
    assert s.kv.block_ids("a") == [1, 2, 3, 6]  # b's last block is the first reused
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [50]
    assert list(s.waiting) == [b] and s.num_preemptions == 1


@pytest.mark.parametrize("enable_caching", [False, True])
def test_preempted_request_resumes_with_its_outputs_recomputed(enable_caching):
    s = make_scheduler(num_blocks=7, enable_caching=enable_caching)
    a, b = make_request("a", 12, max_tokens=2), make_request("b", 12, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    run_step(s)  # preempts b, a finishes (2 tokens)
    assert a.is_finished
    out = run_step(s)
    if enable_caching:
        # b's first two blocks (4, 5) were freed still cached: only 13 - 8 tokens recompute.
        assert scheduled(out) == [("b", 5)]
        assert s.kv.block_ids("b")[:2] == [4, 5]
    else:
        assert scheduled(out) == [("b", 13)]  # prompt + the one output token, recomputed
    assert b.output_token_ids == [50, 50]


def test_request_preempting_itself_when_it_is_the_youngest():
    s = make_scheduler(num_blocks=4)  # 3 usable blocks
    a = make_request("a", 12)
    s.add_request(a)
    run_step(s)
    out = run_step(s)  # needs a 4th block; nobody else to evict
    assert scheduled(out) == [] and out.preempted == [a]
    assert s.kv.block_pool.num_free_blocks == 3


def test_max_num_seqs_caps_the_running_batch():
    s = make_scheduler(num_blocks=64, max_num_seqs=2)
    for name in "abc":
        s.add_request(make_request(name, 2))
    assert [i for i, _ in scheduled(run_step(s))] == ["a", "b"]
    assert len(s.waiting) == 1


def test_abort_frees_blocks_at_every_stage():
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request("waiting", 4))
    assert s.finish_request("waiting", RequestStatus.FINISHED_ABORTED).is_finished
    s.add_request(make_request("running", 4))
    run_step(s)
    s.finish_request("running", RequestStatus.FINISHED_ABORTED)
    assert s.kv.block_pool.num_free_blocks == 15
    assert not s.has_unfinished_requests()
    assert s.finish_request("unknown", RequestStatus.FINISHED_ABORTED) is None


def test_duplicate_request_id_is_rejected():
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already"):
        s.add_request(make_request("a", 4))


def test_decode_positions_find_the_rows_starting_a_block_without_a_pass():
    from jaxpage.core.sched.ahead_of_host import DecodePositions

    positions = DecodePositions.of([15, 16, 31, 1, 32], block_size=16)
    assert positions.starting_block() == [1, 4]  # 16 and 32 start blocks
    later = positions.next()
    assert [later.position(row) for row in range(5)] == [16, 17, 32, 2, 33]
    assert later.starting_block() == [0, 2]
    for _ in range(14):
        later = later.next()
    assert later.starting_block() == [3] and later.position(3) == 16
    assert positions.starting_block() == [1, 4]  # next() leaves the original as it was
