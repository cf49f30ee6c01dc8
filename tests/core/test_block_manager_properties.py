"""Property test: random interleavings keep every block-accounting invariant.

Operations: add (with shared prefixes and n > 1 forks), step (with random sampled tokens,
some of them EOS), abort, finish, forced preemption (recompute or swap). After every
operation: no block is both free and referenced; each block's ref_cnt equals the number
of block-table entries pointing to it; free + referenced covers every block exactly once;
host blocks are held by one request or free; and once all requests end, every block is free.
"""

from collections import Counter

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxpage.core.request import RequestStatus
from jaxpage.core.sched.step_result import StepResult
from tests.core.helpers import make_request, make_scheduler

PREFIXES = [list(range(100, 108)), list(range(200, 206)), []]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.s = make_scheduler(num_blocks=13, block_size=4, max_num_seqs=6,
                                max_num_batched_tokens=24, num_host_blocks=6,
                                preemption_mode="auto")
        self.s.cost_model.bytes_per_block = 1
        self.count = 0

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), extra=st.integers(1, 9),
          max_tokens=st.integers(1, 6), n=st.integers(1, 3))
    def add(self, prefix, extra, max_tokens, n):
        rid = f"r{self.count}"
        self.count += 1
        prompt = PREFIXES[prefix] + [300 + self.count * 10 + i for i in range(extra)]
        request = make_request(rid, 0, prompt=prompt, max_tokens=max_tokens)
        request.fork_children = [request.fork(f"{rid}#{i}", i) for i in range(1, n)]
        self.s.add_request(request)

    @rule(data=st.data())
    def step(self, data):
        out = self.s.schedule()
        self.s.kv.take_pending_block_ops()
        tokens = data.draw(st.lists(st.sampled_from([2, 7, 8, 9]), min_size=len(out.scheduled),
                                    max_size=len(out.scheduled)))
        self.s.apply(out, StepResult(np.asarray(tokens, np.int32)))

    @rule(data=st.data())
    def abort(self, data):
        if self.s.requests:
            rid = data.draw(st.sampled_from(sorted(self.s.requests)))
            self.s.finish_request(rid, RequestStatus.FINISHED_ABORTED)

    @rule(data=st.data())
    def finish(self, data):
        if self.s.running:
            rid = data.draw(st.sampled_from(sorted(r.request_id for r in self.s.running)))
            self.s.finish_request(rid, RequestStatus.FINISHED_STOPPED)

    @rule(swap=st.booleans())
    def preempt_youngest(self, swap):
        if self.s.running:
            self.s.cost_model.host_bandwidth = 1e30 if swap else 1e-30
            victim = self.s.running.pop()
            self.s._preempt(victim)

    @rule()
    def drain(self):
        for _ in range(200):
            if not self.s.has_unfinished_requests():
                break
            out = self.s.schedule()
            self.s.kv.take_pending_block_ops()
            self.apply_drain_step(out)
        assert not self.s.has_unfinished_requests()
        pool = self.s.kv.block_pool
        assert pool.num_free_blocks == pool.num_usable_blocks

    def apply_drain_step(self, out):
        """``drain``'s step: every row samples token 7."""
        self.s.apply(out, StepResult(np.full(len(out.scheduled), 7, np.int32)))

    @invariant()
    def blocks_are_accounted_for(self):
        kv = self.s.kv
        pool = kv.block_pool
        held = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
        free = pool.free_queue.block_ids()
        assert len(free) == len(set(free)) == pool.num_free_blocks
        assert 0 not in free and 0 not in held
        for block in pool.blocks[1:]:
            assert block.ref_cnt == held.get(block.block_id, 0), block
            assert (block.ref_cnt == 0) == (block.block_id in set(free)), block
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash
        host_held = [h for ids in kv.req_to_host_blocks.values() for h in ids]
        assert len(host_held) == len(set(host_held))
        assert sorted(host_held + kv.host_pool._free) == list(range(kv.host_pool.num_blocks))

    @invariant()
    def request_holdings_match_their_state(self):
        for rid, request in self.s.requests.items():
            holds_device = rid in self.s.kv.req_to_blocks
            if request.status is RequestStatus.SWAPPED:
                assert not holds_device and rid in self.s.kv.req_to_host_blocks
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED,
                                  RequestStatus.FORK_PENDING):
                assert not self.s.kv.req_to_blocks.get(rid)


# Derandomized: CI replays the same 150 examples every run (1000 random ones passed when
# this was written); raise max_examples and drop derandomize locally to hunt for more.
BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                 deadline=None, derandomize=True, database=None)
TestBlockManager = BlockManagerMachine.TestCase
