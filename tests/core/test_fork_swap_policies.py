"""Copy-on-write forks, swap round trips, priorities with aging, long-prefill chunking."""

import numpy as np
import pytest

from jaxpage.core.request import RequestStatus
from jaxpage.core.sched.step_result import StepResult
from tests.core.helpers import make_request, make_scheduler


def step(s, tokens=None):
    out = s.schedule()
    n = len(out.scheduled)
    s.apply(out, StepResult(np.asarray(tokens if tokens is not None else [50] * n, np.int32)))
    return [(x.request.request_id, x.num_new_tokens) for x in out.scheduled], out


def with_children(request, n):
    request.fork_children = [request.fork(f"{request.request_id}#{i}", i) for i in range(1, n)]
    return request


def test_fork_shares_the_prompt_and_copies_the_partial_block_on_first_write():
    s = make_scheduler(num_blocks=16, enable_caching=False)
    leader = with_children(make_request("p", 10), 3)  # 10 tokens: blocks of 4, 4, 2
    s.add_request(leader)
    got, _ = step(s)
    assert got == [("p", 9)]  # all but the last prompt token
    assert s.kv.block_ids("p") == [1, 2, 3]
    got, _ = step(s)
    # Fork: the siblings share blocks 1, 2, 3 (block 3 partly filled). Each then writes the
    # last prompt token into block 3: the leader (ref 3) copies it to 4, p#1 (ref 2) to 5,
    # and p#2, by then its only holder, writes into block 3 in place.
    assert got == [("p", 1), ("p#1", 1), ("p#2", 1)]
    assert s.kv.block_ids("p") == [1, 2, 4]
    assert s.kv.block_ids("p#1") == [1, 2, 5]
    assert s.kv.block_ids("p#2") == [1, 2, 3]  # the last holder keeps the original
    pool = s.kv.block_pool
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [3, 3, 1, 1, 1]
    assert s.kv.take_pending_block_ops()[2] == [(3, 4), (3, 5)]  # (src, dst) device copies
    assert all(len(r.output_token_ids) == 1 for r in s.running)


def test_fork_on_a_block_boundary_needs_no_copy():
    s = make_scheduler(num_blocks=16, enable_caching=False)
    s.add_request(with_children(make_request("p", 9), 2))  # fork after 8 = 2 full blocks
    step(s)
    step(s)
    assert s.kv.block_ids("p") == [1, 2, 3] and s.kv.block_ids("p#1") == [1, 2, 4]
    assert s.kv.take_pending_block_ops()[2] == []


def test_siblings_reserve_batch_rows_at_admission():
    s = make_scheduler(num_blocks=32, max_num_seqs=4, enable_caching=False)
    s.add_request(with_children(make_request("p", 4), 3))
    s.add_request(make_request("q", 4))
    s.add_request(make_request("r", 4))
    got, _ = step(s)
    assert got == [("p", 3), ("q", 4)]  # r waits: p holds 3 rows, q one
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        s.add_request(with_children(make_request("big", 4), 5))


def _b_swapped_out_for_a(enable_caching: bool):
    """Two 12-token prompts in 6 blocks: a's second step needs one more, so b (the
    youngest) is swapped out to the host. (scheduler, b)."""
    s = make_scheduler(num_blocks=7, enable_caching=enable_caching, num_host_blocks=8,
                       preemption_mode="swap")
    a, b = make_request("a", 12), make_request("b", 12)
    s.add_request(a)
    s.add_request(b)
    step(s)
    got, out = step(s)
    assert got == [("a", 1)] and out.preempted == [b]
    return s, b


def test_swap_out_and_back_in_keeps_progress_and_moves_exact_blocks():
    s, b = _b_swapped_out_for_a(enable_caching=False)
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 12
    assert s.kv.host_block_ids("b") == [0, 1, 2] and s.kv.block_ids("b") == []
    swap_out, swap_in, copies = s.kv.take_pending_block_ops()
    assert swap_out == [(4, 0), (5, 1), (6, 2)] and swap_in == [] and copies == []
    assert s.stats()["num_swapped"] == 1
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    got, _ = step(s)
    assert got == [("b", 1)]  # back with its 12 computed tokens, decoding at once
    swap_out, swap_in, _ = s.kv.take_pending_block_ops()
    # Queue after a's abort: [5, 4] then a's blocks [1, 2, 3, 6] tail first: 6, 3, 2, 1.
    assert swap_in == [(0, 5), (1, 4), (2, 6)]
    assert s.kv.host_pool.num_free_blocks == 8 and s.stats()["num_swapped"] == 0


def test_swap_falls_back_to_recompute_without_host_room():
    s = make_scheduler(num_blocks=7, enable_caching=False, num_host_blocks=2,
                       preemption_mode="swap")
    a, b = make_request("a", 12), make_request("b", 12)
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0


def test_auto_mode_picks_the_cheaper_preemption():
    for host_bandwidth, expected in ((1e12, RequestStatus.SWAPPED), (1.0, RequestStatus.PREEMPTED)):
        s = make_scheduler(num_blocks=7, enable_caching=False, num_host_blocks=8,
                           preemption_mode="auto")
        s.cost_model.bytes_per_block = 1000
        s.cost_model.host_bandwidth = host_bandwidth
        s.cost_model.prefill_tokens_per_s = 100.0
        a, b = make_request("a", 12), make_request("b", 12)
        s.add_request(a)
        s.add_request(b)
        step(s)
        step(s)
        assert b.status is expected


def test_priority_policy_admits_lower_values_first_and_preempts_the_worst():
    s = make_scheduler(num_blocks=7, enable_caching=False, max_num_seqs=2,
                       scheduling_policy="priority")
    low, high, mid = (make_request("low", 8, priority=5), make_request("high", 8, priority=-1),
                      make_request("mid", 8, priority=0))
    for r in (low, high, mid):
        s.add_request(r)
    got, _ = step(s)
    assert got == [("high", 8), ("mid", 8)]


def test_priority_aging_prevents_starvation():
    s = make_scheduler(num_blocks=64, enable_caching=False, max_num_seqs=1,
                       scheduling_policy="priority", priority_aging_steps=2)
    s.add_request(make_request("old", 2, priority=3, max_tokens=1))
    for i in range(6):  # a stream of better-priority requests keeps arriving
        s.add_request(make_request(f"new{i}", 2, priority=0, max_tokens=1))
        got, _ = step(s)
        if got[0][0] == "old":
            break
    assert got == [("old", 2)], got


def test_long_prefill_threshold_lets_others_in():
    s = make_scheduler(num_blocks=64, enable_caching=False, max_num_batched_tokens=32,
                       long_prefill_token_threshold=8)
    s.add_request(make_request("long", 40))
    s.add_request(make_request("short", 3))
    got, _ = step(s)
    assert got == [("long", 8), ("short", 3)]


def test_decodes_are_served_before_new_prefills():
    s = make_scheduler(num_blocks=64, enable_caching=False, max_num_batched_tokens=8)
    s.add_request(make_request("a", 4))
    step(s)
    s.add_request(make_request("b", 20))
    got, _ = step(s)
    assert got == [("a", 1), ("b", 7)]


def test_swap_in_shares_the_leading_blocks_the_prefix_cache_still_holds():
    """b's blocks stay in the prefix cache after its swap-out until someone takes them:
    coming back it shares the two still there and copies only its third from the host."""
    s, b = _b_swapped_out_for_a(enable_caching=True)
    assert s.kv.host_block_ids("b") == [0, 1, 2]
    swap_out, _, _ = s.kv.take_pending_block_ops()
    assert swap_out == [(4, 0), (5, 1), (6, 2)]
    assert s.kv.block_ids("a") == [1, 2, 3, 6]  # a's new block was b's last (evicted)
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    got, _ = step(s)
    assert got == [("b", 1)]
    _, swap_in, _ = s.kv.take_pending_block_ops()
    assert s.kv.block_ids("b")[:2] == [4, 5]         # shared from the cache, not copied
    assert swap_in == [(2, s.kv.block_ids("b")[2])]  # only the evicted third block moves
    assert s.kv.num_swap_in_shared_blocks == 2
    assert s.kv.host_pool.num_free_blocks == 8
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert s.kv.block_pool.num_free_blocks == 6
