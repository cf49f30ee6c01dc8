"""AheadOfHost.chain_multi_step: when a multi-step call may be queued behind a running one."""

import numpy as np

from jaxpage.core.batch.builder import BatchBuilder
from jaxpage.core.request import RequestStatus
from jaxpage.core.sched.step_result import StepResult
from tests.core.helpers import make_request, make_scheduler


def decode_window(s, num_steps=4):
    """Prefill every request, then schedule one all-decode window of ``num_steps``."""
    out = s.schedule()
    s.apply(out, StepResult(np.full(len(out.scheduled), 50, np.int32)))  # prefill + 1 token
    out = s.schedule()
    assert s.ahead.reserve_multi_step(out, num_steps) == num_steps
    return out


def block_ids(s, request_id):
    return s.kv.block_ids(request_id)


def test_chain_reserves_the_next_window_and_builds_ahead():
    s = make_scheduler(num_blocks=32, block_size=4)
    s.add_request(make_request("a", 6, max_tokens=20))
    s.add_request(make_request("b", 3, max_tokens=20))
    out = decode_window(s)
    # prefill: a takes blocks 1-2 (6 tokens), b block 3; the window (slots to 10 and 7)
    # adds one block each
    assert block_ids(s, "a") == [1, 2, 4] and block_ids(s, "b") == [3, 5]
    chained = s.ahead.chain_multi_step(out, 4)
    assert [(i.request.request_id, i.num_new_tokens) for i in chained.scheduled] == [("a", 1), ("b", 1)]
    assert block_ids(s, "a") == [1, 2, 4, 6] and block_ids(s, "b") == [3, 5, 7]  # to 14 / 11
    builder = BatchBuilder(s.kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1024)
    batch = builder.build(chained, ahead=4).metadata
    assert batch.positions[:2].tolist() == [10, 7]      # 4 ahead of the host's 6 and 3
    assert batch.kv_lens[:2].tolist() == [11, 8]
    assert batch.sample_index[:2].tolist() == [5, 5]
    assert batch.input_ids[:2].tolist() == [0, 0]       # the device supplies them


def test_no_chain_when_the_next_batch_depends_on_the_host():
    s = make_scheduler(num_blocks=32, block_size=4)
    s.add_request(make_request("a", 6, max_tokens=20))
    out = decode_window(s)
    s.add_request(make_request("late", 3))
    assert s.ahead.chain_multi_step(out, 4) is None           # a new request must be admitted
    s = make_scheduler(num_blocks=32, block_size=4)
    s.add_request(make_request("short", 6, max_tokens=5))
    out = decode_window(s)
    assert s.ahead.chain_multi_step(out, 4) is None           # nothing can outlive the window
    assert s.ahead.chain_multi_step(out, 1) is None           # single steps never chain
    s = make_scheduler(num_blocks=5, block_size=4)      # null block + 4 blocks: 16 slots
    s.add_request(make_request("a", 6, max_tokens=40))
    out = decode_window(s, 8)                           # slots 6..13: blocks 1-4, all of them
    assert block_ids(s, "a") == [1, 2, 3, 4]
    assert s.ahead.chain_multi_step(out, 8) is None           # slots to 21 do not fit: no chain


def test_chain_skips_finished_requests():
    s = make_scheduler(num_blocks=32, block_size=4)
    for name in "abc":
        s.add_request(make_request(name, 5, max_tokens=30))
    out = decode_window(s)
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    chained = s.ahead.chain_multi_step(out, 4)
    assert [i.request.request_id for i in chained.scheduled] == ["a", "c"]


def test_chain_leaves_out_requests_the_running_window_finishes():
    """A request with at most ``num_steps`` tokens to go reaches ``max_tokens`` inside the
    window in flight: the chained window has no row for it, and reserves nothing for it."""
    s = make_scheduler(num_blocks=32, block_size=4)
    s.add_request(make_request("long", 5, max_tokens=30))
    s.add_request(make_request("edge", 5, max_tokens=5))   # 1 out + 4 in the window: done
    s.add_request(make_request("past", 5, max_tokens=6))   # 1 out + 4: one more to go
    out = decode_window(s)
    edge_blocks = block_ids(s, "edge")
    chained = s.ahead.chain_multi_step(out, 4)
    assert [i.request.request_id for i in chained.scheduled] == ["long", "past"]
    assert block_ids(s, "edge") == edge_blocks
