"""Speculative decoding on the host: who gets proposals, how a verified row is applied,
and that rejected proposals leave no block behind and nothing in the prefix cache."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from jaxpage.core.kv.prefix_hash import extend_block_hashes
from jaxpage.core.request import RequestStatus
from jaxpage.core.sched.speculation import NgramProposer, SpecDecodeStats
from jaxpage.speculative_config import SpeculativeConfig
from jaxpage.core.sched.step_result import StepResult
from tests.core.helpers import make_request, make_scheduler, verify
from tests.core.test_block_manager_properties import BlockManagerMachine

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2, "disable_by_batch_size": 4}


class Fixed:
    """Proposes ``tokens`` (cut to the room the scheduler gives)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, request, max_tokens):
        return list(self.tokens[:max_tokens])


def decode_ready(scheduler, request):
    """Admit ``request`` and run its prefill on the host: it then decodes."""
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.apply(out, StepResult(np.full(len(out.scheduled), 50, np.int32)))
    return out


def test_ngram_proposer_reads_prompt_and_output():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                               prompt_lookup_max=2))
    request = make_request("a", 0, prompt=[10, 11, 12, 13, 11])
    assert proposer.propose(request, 5) == [12, 13, 11]
    assert proposer.propose(request, 2) == [12, 13]
    request.append_output_token(99)
    assert proposer.propose(request, 5) == []


def test_decodes_get_proposals_and_their_slots():
    s = make_scheduler(num_blocks=20, block_size=4, speculative_config=SPEC)
    s.speculation.proposer = Fixed([7, 8, 9])
    request = make_request("a", 6, max_tokens=10)
    decode_ready(s, request)
    assert request.num_computed_tokens == 6 and request.num_tokens == 7
    out = s.schedule()
    (item,) = out.scheduled
    assert item.draft_token_ids == [7, 8, 9] and item.num_new_tokens == 4
    assert out.num_draft_tokens == 3
    # positions 6..9 are written: blocks 1 and 2 (block size 4)
    assert len(s.kv.req_to_blocks["a"]) == 3
    assert s.ahead.reserve_multi_step(out, 8) == 1


def test_no_proposals_in_prefill_steps_big_batches_or_for_the_last_token():
    s = make_scheduler(num_blocks=60, block_size=4, speculative_config=SPEC)
    s.speculation.proposer = Fixed([7, 8, 9])
    penalized = make_request("p", 5, presence_penalty=0.5)  # penalties speculate too
    decode_ready(s, penalized)
    out = s.schedule()
    assert out.num_draft_tokens == 3
    verify(s, out, [[51]])
    s.add_request(make_request("q", 9))  # its prefill shares the next step
    out = s.schedule()
    assert [i.num_new_tokens for i in out.scheduled] == [1, 9] and out.num_draft_tokens == 0
    s.apply(out, StepResult(np.array([52, 53], np.int32)))
    out = s.schedule()
    assert out.num_draft_tokens == 6  # both decode now
    assert [len(i.draft_token_ids) for i in out.scheduled] == [3, 3]
    verify(s, out, [[60], [61]])
    last = make_request("l", 3, max_tokens=2)  # one token from prefill, then its last
    s.add_request(last)
    s.add_request(make_request("m", 3))
    s.add_request(make_request("n", 3))
    out = s.schedule()
    s.apply(out, StepResult(np.full(len(out.scheduled), 54, np.int32)))
    out = s.schedule()  # 5 running > disable_by_batch_size=4
    assert len(s.running) == 5 and out.num_draft_tokens == 0
    assert not s.speculating()


def test_a_verified_row_keeps_accepted_tokens_and_frees_rejected_blocks():
    s = make_scheduler(num_blocks=20, block_size=4, speculative_config=SPEC)
    s.speculation.proposer = Fixed([7, 8, 9])
    request = make_request("a", 7, max_tokens=10)  # positions 0..6; first output at 7
    decode_ready(s, request)
    out = s.schedule()
    item = out.scheduled[0]  # writes positions 7 (last token), 8, 9, 10 (proposals)
    blocks = list(s.kv.block_ids("a"))
    assert len(blocks) == 3
    # The target agreed with 7 only, then said 40: emitted [7, 40]
    assert verify(s, out, [[7, 40]]) == [request]
    assert request.output_token_ids == [50, 7, 40]
    assert request.num_computed_tokens == 9 and request.num_tokens == 10
    assert s.kv.block_ids("a") == blocks[:3]  # 10 tokens need 3 blocks: nothing to free
    out = s.schedule()
    item = out.scheduled[0]  # positions 9..12: a fourth block
    assert len(s.kv.block_ids("a")) == 4
    fourth = s.kv.block_ids("a")[3]
    verify(s, out, [[41]])  # every proposal rejected
    assert s.kv.block_ids("a") == blocks[:3]
    assert fourth in s.kv.block_pool.free_queue.block_ids()
    stats = s.speculation.stats.as_dict()
    assert stats["spec_num_draft_tokens"] == 6 and stats["spec_num_accepted_tokens"] == 1


def test_rejected_proposals_never_reach_the_prefix_cache():
    s = make_scheduler(num_blocks=30, block_size=4, speculative_config=SPEC)
    s.speculation.proposer = Fixed([90, 91, 92])
    request = make_request("a", 6, max_tokens=20)
    decode_ready(s, request)
    rng = np.random.default_rng(0)
    while not request.is_finished:
        out = s.schedule()
        item = out.scheduled[0]
        accepted = int(rng.integers(0, len(item.draft_token_ids) + 1))
        verify(s, out, [list(item.draft_token_ids[:accepted]) + [int(rng.integers(20, 30))]])
        hashes = []
        extend_block_hashes(hashes, request.all_token_ids, 4, ())
        cached = set(s.kv.block_pool.cached_blocks)
        assert cached <= set(hashes)  # only blocks of accepted tokens are cached
    assert s.kv.block_pool.num_free_blocks == s.kv.block_pool.num_usable_blocks


def test_stats_names():
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(0, 0)
    stats.record(4, 0)
    assert stats.as_dict() == {"spec_num_drafts": 2, "spec_num_draft_tokens": 7,
                               "spec_num_accepted_tokens": 2,
                               "spec_acceptance_rate": pytest.approx(2 / 7),
                               "spec_mean_accepted_length": 2.0}


class SpeculatingMachine(BlockManagerMachine):
    """The block manager machine with speculation: verify steps accept 0..k proposals,
    interleaved with preemption (both modes), aborts and finishes."""

    def __init__(self):
        super().__init__()
        s = make_scheduler(num_blocks=13, block_size=4, max_num_seqs=6,
                           max_num_batched_tokens=24, num_host_blocks=6,
                           preemption_mode="auto", speculative_config={**SPEC,
                                                                       "disable_by_batch_size": 6})
        s.cost_model.bytes_per_block = 1
        s.speculation.proposer = Fixed([7, 8, 9])
        self.s = s

    @rule(data=st.data())
    def step(self, data):
        out = self.s.schedule()
        self.s.kv.take_pending_block_ops()
        if not out.num_draft_tokens:
            tokens = data.draw(st.lists(st.sampled_from([2, 7, 8, 9]),
                                        min_size=len(out.scheduled), max_size=len(out.scheduled)))
            self.s.apply(out, StepResult(np.asarray(tokens, np.int32)))
            return
        rows = []
        for item in out.scheduled:
            drafts = list(item.draft_token_ids)
            accepted = data.draw(st.integers(0, len(drafts)))
            last = data.draw(st.sampled_from([2, 7, 8, 9, 10]))
            rows.append(drafts[:accepted] + [last])
        verify(self.s, out, rows)

    def apply_drain_step(self, out):
        """A verify step accepts the first proposal of each row, then says 10."""
        if not out.num_draft_tokens:
            return super().apply_drain_step(out)
        verify(self.s, out, [list(item.draft_token_ids[:1]) + [10] for item in out.scheduled])

    def teardown(self):
        counts = Counter()
        for request in self.s.requests.values():
            counts[request.status] += 1
        assert self.s.speculation.stats.num_accepted_tokens <= self.s.speculation.stats.num_draft_tokens


SpeculatingMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40,
                                                deadline=None, derandomize=True, database=None)
TestSpeculatingBlockManager = SpeculatingMachine.TestCase


def test_a_draft_model_s_rows_are_reserved_by_the_scheduler_and_filled_by_the_engine():
    """With ``method="draft_model"`` ``schedule`` gives no proposals (the draft model runs
    on the device, called by the engine): ``reserve_draft_rows`` picks the rows, their
    slots for the last token and k proposals allocated, and ``give`` hands them the
    draft's tokens, each row with its q row; a verify step then applies as any."""
    s = make_scheduler(num_blocks=40, block_size=4,
                       speculative_config={"method": "draft_model", "model": "preset:tiny-llama",
                                           "num_speculative_tokens": 3,
                                           "disable_by_batch_size": 4})
    assert s.speculation.proposer is None and s.speculation.engine_proposes
    a, b = make_request("a", 6, max_tokens=10), make_request("b", 5, max_tokens=2)
    decode_ready(s, a)
    decode_ready(s, b)
    out = s.schedule()
    assert out.num_draft_tokens == 0 and [i.num_new_tokens for i in out.scheduled] == [1, 1]
    wanted = s.speculation.reserve_draft_rows(out)
    # b is one token from max_tokens: no room for proposals
    assert [(item.request.request_id, k) for item, k in wanted] == [("a", 3)]
    assert len(s.kv.req_to_blocks["a"]) == 3  # positions 6..9: blocks 1 and 2
    s.speculation.give(out, wanted, [[7, 8, 9]])
    item = out.scheduled[0]
    assert item.draft_token_ids == [7, 8, 9] and item.num_new_tokens == 4
    assert item.draft_q_row == 0 and out.num_draft_tokens == 3
    verify(s, out, [[7, 8, 40], [11]])
    assert a.output_token_ids == [50, 50, 7, 8, 40] and b.is_finished  # a decoded in b's prefill
    assert s.speculation.stats.num_accepted_tokens == 2
