"""PenaltySlots: which row of the device's penalty table each penalized request owns."""

import numpy as np
import pytest

from jaxpage.core.batch.builder import BatchBuilder
from jaxpage.core.batch.penalty_slots import SEEN, PenaltySlots, penalty_fill
from jaxpage.core.request import RequestStatus
from jaxpage.core.sched.step_result import StepResult
from tests.core.helpers import make_request, make_scheduler


def test_fill_marks_prompt_and_output_tokens_and_counts_the_output():
    r = make_request("a", 0, prompt=[5, 9, 5, 7])
    r.all_token_ids += [9, 9, 3]
    fill = penalty_fill(4, r)
    assert fill.slot == 4
    assert fill.token_ids.tolist() == [3, 5, 7, 9]
    assert fill.values.tolist() == [SEEN | 1, SEEN, SEEN, SEEN | 2]  # prompt tokens: count 0


def test_slots_are_kept_reused_after_finish_and_evicted_least_recently_used():
    slots = PenaltySlots(3)
    a, b, c, d = (make_request(x, 3) for x in "abcd")
    assert slots.assign([a, None, b]).tolist() == [0, -1, 1]
    assert [f.slot for f in slots.take_fills()] == [0, 1]
    assert slots.assign([b, a]).tolist() == [1, 0]           # kept: no new fill
    assert slots.take_fills() == []
    assert slots.assign([c]).tolist() == [2]
    slots.take_fills()
    a.status = RequestStatus.FINISHED_STOPPED
    assert slots.assign([d, c]).tolist() == [0, 2]          # a finished: its slot is free
    fills = slots.take_fills()
    assert [f.slot for f in fills] == [0] and slots.slot_of(a) is None
    # Full: the least recently used owner outside the batch (b, last used two batches ago)
    # loses its slot, and is filled again from the host when it returns.
    e = make_request("e", 2)
    assert slots.assign([e, d]).tolist() == [1, 0]
    assert slots.slot_of(b) is None
    assert slots.assign([b, e, d]).tolist() == [2, 1, 0]    # c, unused longest, is evicted
    assert [f.slot for f in slots.take_fills()] == [1, 2]


def test_chained_calls_never_fill_and_batches_cannot_outgrow_the_table():
    slots = PenaltySlots(2)
    a, b, c = (make_request(x, 3) for x in "abc")
    with pytest.raises(RuntimeError, match="chained call"):
        slots.assign([a], ahead=True)
    slots.assign([a, b])
    assert slots.assign([b, a], ahead=True).tolist() == [1, 0]
    with pytest.raises(RuntimeError, match="more than 2 penalty slots"):
        slots.assign([a, b, c])
    with pytest.raises(ValueError, match="num_slots=0"):
        PenaltySlots(0)


def test_forget_drops_the_slot_and_its_queued_fill():
    slots = PenaltySlots(2)
    a, b = make_request("a", 3), make_request("b", 3)
    slots.assign([a, b])
    slots.forget([a])
    assert slots.slot_of(a) is None and [f.slot for f in slots.take_fills()] == [1]
    assert slots.assign([a]).tolist() == [0]


def test_batch_gives_slots_only_to_penalized_rows_whose_token_is_kept():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    s.add_request(make_request("plain", 3, max_tokens=8))
    s.add_request(make_request("pen", 10, max_tokens=8, presence_penalty=0.5,
                               repetition_penalty=1.2))
    builder = BatchBuilder(s.kv, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)
    out = s.schedule()                     # plain: whole prompt; pen: first 5 of 10 tokens
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [
        ("plain", 3), ("pen", 5)]
    batch = builder.build(out).metadata
    assert batch.penalty_slot.tolist() == [-1, -1]         # pen's chunk samples nothing kept
    assert batch.repetition_penalty.tolist() == [1.0, 1.0]
    assert builder.take_penalty_fills() == []
    s.apply(out, StepResult(np.array([50, 51], np.int32)))
    out = s.schedule()                     # plain decodes; pen's last chunk emits a token
    batch = builder.build(out).metadata
    assert batch.penalty_slot.tolist() == [-1, 0]
    np.testing.assert_allclose(batch.repetition_penalty, [1.0, 1.2])
    np.testing.assert_allclose(batch.presence_penalty, [0.0, 0.5])
    fills = builder.take_penalty_fills()
    assert len(fills) == 1 and fills[0].slot == 0
    pen = out.scheduled[1].request
    assert fills[0].token_ids.tolist() == sorted(set(pen.prompt_token_ids))
    assert batch.shape_key == (8, 2, 8)    # the same program as an unpenalized batch
