"""TokenLog: a request's logged tokens reach its ``all_token_ids`` and
``num_computed_tokens`` exactly when read, in order, and never after it leaves the log."""

import numpy as np
import pytest

from jaxpage.core.request import Request, RequestStatus
from jaxpage.core.token_log import LoggedRequest, TokenLog
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


def test_tokens_and_progress_appear_when_read():
    a, b = make("a", [1, 2, 3]), make("b", [4, 5])
    log = TokenLog([a, b])
    log.append(rows(10, 20, -7))  # a padding row past n is ignored
    log.append(rows(11, 21))
    assert type(b) is LoggedRequest
    assert Request.all_token_ids.__get__(b) == [4, 5, 200]  # the slot: nothing moved yet
    assert b.all_token_ids == [4, 5, 200, 20, 21] and b.num_computed_tokens == 1 + 2
    log.append(rows(12, 22))
    assert a.num_computed_tokens == 2 + 3 and a.all_token_ids == [1, 2, 3, 300, 10, 11, 12]
    assert b.output_token_ids == [200, 20, 21, 22]
    assert (a.num_output_tokens, a.last_token_id) == (4, 12)


def test_writes_take_the_logged_tokens_first():
    a = make("a", [1, 2, 3])
    log = TokenLog([a])
    log.append(rows(10))
    a.all_token_ids.append(99)  # the getter took 10 first
    log.append(rows(11))
    a.num_computed_tokens = 0  # a preemption's reset after taking 11
    assert a.all_token_ids == [1, 2, 3, 300, 10, 99, 11] and a.num_computed_tokens == 0


def test_a_request_that_leaves_takes_nothing_logged_after():
    a, b = make("a", [1, 2, 3]), make("b", [4, 5])
    log = TokenLog([a, b])
    log.append(rows(10, 20))
    a.leave_token_log()
    assert a._token_log is None and not log.is_attached(0) and log.is_attached(1)
    assert type(a) is Request  # plain slots again
    log.append(rows(11, 21))  # a finished while this step ran: its row is dropped
    log.close()
    assert a.all_token_ids == [1, 2, 3, 300, 10] and a.num_computed_tokens == 3
    assert b.all_token_ids == [4, 5, 200, 20, 21] and b.num_computed_tokens == 3
    assert b._token_log is None and type(b) is Request
    a.leave_token_log()  # leaving twice is harmless


def test_a_full_log_hands_its_tokens_over_and_goes_on():
    a, b = make("a", [1]), make("b", [2])
    log = TokenLog([a, b], capacity=3)
    computed = log.track_computed()
    assert computed.tolist() == [0, 0]
    for step in range(7):
        if step == 2:
            assert b.num_computed_tokens == 2  # b alone took two, mid-way
        log.append(rows(step, 50 + step))
    assert log.steps == 7 - 6 and Request.num_computed_tokens.__get__(a) == 6  # 2 x 3
    assert log.track_computed().tolist() == [7, 7]
    assert a.all_token_ids == [1, 100, *range(7)]
    assert b.all_token_ids == [2, 100, *range(50, 57)] and b.num_computed_tokens == 7


def test_a_fork_copies_the_logged_tokens_and_stays_off_the_log():
    a = make("a", [1, 2, 3])
    log = TokenLog([a])
    log.append(rows(10))
    child = a.fork("a-1", sample_seed=3)
    log.append(rows(11))
    assert child._token_log is None and child.all_token_ids == [1, 2, 3, 300, 10]
    assert a.all_token_ids == [1, 2, 3, 300, 10, 11]


def test_a_row_whose_request_already_finished_is_dropped():
    a, b = make("a", [1, 2, 3]), make("b", [4, 5])
    a.status = RequestStatus.FINISHED_STOPPED  # stopped while this step was on the device
    log = TokenLog([a, b])
    log.append(rows(10, 20))
    log.close()
    assert not log.is_attached(0) and a.all_token_ids == [1, 2, 3, 300]
    assert b.all_token_ids == [4, 5, 200, 20]


def test_one_log_per_request():
    a = make("a", [1, 2, 3])
    TokenLog([a])
    with pytest.raises(ValueError, match="already in a token log"):
        TokenLog([a])


def test_eligible_requests_need_no_host_work_per_token():
    assert TokenLog.eligible(make("a", [1], stop_token_ids=[7], seed=3, temperature=1.0))
    assert not TokenLog.eligible(make("b", [1], stop=["x"]))
    assert not TokenLog.eligible(make("p", [1], presence_penalty=0.5))
    many = make("c", [1], stop_token_ids=list(range(40)))
    assert many.has_many_stop_ids and not TokenLog.eligible(many)
    fresh = make("d", [1])
    fresh.first_token_time = None
    assert not TokenLog.eligible(fresh)
