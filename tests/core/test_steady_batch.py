"""SteadyBatch: the persistent batch owns a run's tokens; a request takes them, in order,
exactly at the sync points (``current``, ``detach``, ``sync``, ``release``, a full array),
and never after it left."""

import numpy as np

from jaxpage.core.request import Request, RequestStatus
from jaxpage.core.sched.steady_batch import SteadyBatch
from jaxpage.sampling_params import SamplingParams


def make(request_id, prompt, **params):
    request = Request(request_id, prompt, SamplingParams(max_tokens=100, **params),
                      max_model_len=256)
    request.num_computed_tokens = len(prompt) - 1  # a decode: its last token not computed
    request.all_token_ids.append(len(prompt) * 100)  # its first output token
    request.first_token_time = 1.0
    request.status = RequestStatus.RUNNING
    return request


def rows(*values):
    return np.array(values, np.int32)


def test_tokens_wait_in_the_batch_until_a_sync_point():
    a, b = make("a", [1, 2, 3]), make("b", [4, 5])
    batch = SteadyBatch([a, b])
    batch.append(rows(10, 20, -7))  # a padding row past n is ignored
    batch.append(rows(11, 21))
    assert b.all_token_ids == [4, 5, 200] and b.num_computed_tokens == 1  # owned by the batch
    assert batch.current(1) is b
    assert b.all_token_ids == [4, 5, 200, 20, 21] and b.num_computed_tokens == 1 + 2
    batch.append(rows(12, 22))
    batch.sync()
    assert a.num_computed_tokens == 2 + 3 and a.all_token_ids == [1, 2, 3, 300, 10, 11, 12]
    assert b.output_token_ids == [200, 20, 21, 22]
    batch.append(rows(13, 23))  # still attached after sync
    batch.release()
    assert a.all_token_ids[-1] == 13 and b.all_token_ids[-1] == 23
    assert batch.current(0) is None  # released: nothing attached


def test_a_request_that_leaves_takes_nothing_after():
    a, b = make("a", [1, 2, 3]), make("b", [4, 5])
    batch = SteadyBatch([a, b])
    batch.append(rows(10, 20))
    batch.detach(a)
    assert a.all_token_ids == [1, 2, 3, 300, 10] and batch.current(0) is None
    batch.append(rows(11, 21))  # a finished while this step ran: its row is dropped
    batch.release()
    assert a.all_token_ids == [1, 2, 3, 300, 10] and a.num_computed_tokens == 3
    assert b.all_token_ids == [4, 5, 200, 20, 21] and b.num_computed_tokens == 3
    batch.detach(a)  # leaving twice is harmless


def test_a_full_batch_hands_its_tokens_over_and_goes_on():
    a, b = make("a", [1]), make("b", [2])
    batch = SteadyBatch([a, b], capacity=3)
    computed = batch.track_computed()
    assert computed.tolist() == [0, 0]
    for step in range(7):
        if step == 2:
            assert batch.current(1).num_computed_tokens == 2  # b alone took two, mid-way
        batch.append(rows(step, 50 + step))
    assert batch.steps == 7 - 6 and a.num_computed_tokens == 6  # 2 x 3 handed over
    assert batch.track_computed().tolist() == [7, 7]
    batch.release()
    assert a.all_token_ids == [1, 100, *range(7)]
    assert b.all_token_ids == [2, 100, *range(50, 57)] and b.num_computed_tokens == 7


def test_a_row_whose_request_already_finished_is_dropped():
    a, b = make("a", [1, 2, 3]), make("b", [4, 5])
    a.status = RequestStatus.FINISHED_STOPPED  # stopped while this step was on the device
    batch = SteadyBatch([a, b])
    batch.append(rows(10, 20))
    batch.release()
    assert batch.current(0) is None and a.all_token_ids == [1, 2, 3, 300]
    assert b.all_token_ids == [4, 5, 200, 20]


def test_eligible_requests_need_no_host_work_per_token():
    assert SteadyBatch.eligible(make("a", [1], stop_token_ids=[7], seed=3, temperature=1.0))
    assert not SteadyBatch.eligible(make("b", [1], stop=["x"]))
    assert not SteadyBatch.eligible(make("p", [1], presence_penalty=0.5))
    many = make("c", [1], stop_token_ids=list(range(40)))
    assert many.has_many_stop_ids and not SteadyBatch.eligible(many)
    fresh = make("d", [1])
    fresh.first_token_time = None
    assert not SteadyBatch.eligible(fresh)
