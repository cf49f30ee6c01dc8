"""Request: slots in the hot loop's order, and a fork that copies every one of them."""

import pickle
import weakref

import pytest

from jaxpage.core.request import Request
from jaxpage.sampling_params import SamplingParams


def make(**params):
    return Request("r", [5, 6, 7], SamplingParams(max_tokens=4, **params), max_model_len=32)


def test_no_per_object_dict_and_no_stray_attributes():
    request = make()
    assert not hasattr(request, "__dict__")
    with pytest.raises(AttributeError):
        request.not_an_attribute = 1  # a typo fails loudly instead of adding an attribute
    assert Request.__slots__[:4] == ("status", "num_computed_tokens", "all_token_ids",
                                     "num_prompt_tokens")  # the decode hot loop's, first
    for name in Request.__slots__[:-1]:
        getattr(request, name)  # every slot is set by __init__
    assert weakref.ref(request)() is request  # (the draft model's WeakKeyDictionary)


def test_fork_copies_every_slot_and_owns_its_lists():
    leader = make(output_kind="delta", stop=["x"])
    leader.append_output_token(9)
    leader.num_computed_tokens = 3
    child = leader.fork("r-1", sample_seed=11)
    for name in Request.__slots__[:-1]:
        if name not in ("request_id", "sample_seed", "fork_children", "fork_leader",
                        "num_preemptions", "extra_seats"):
            assert getattr(child, name) == getattr(leader, name), name
    assert (child.request_id, child.sample_seed, child.fork_leader) == ("r-1", 11, leader)
    assert child.streams_deltas and child.has_stop_strings and child.num_computed_tokens == 3
    child.append_output_token(10)
    assert leader.output_token_ids == [9] and leader.all_token_ids == [5, 6, 7, 9]
    assert child.all_token_ids == [5, 6, 7, 9, 10]


def test_output_tokens_are_the_tail_of_all_tokens():
    request = make()
    assert request.output_token_ids == [] and request.num_output_tokens == 0
    request.append_output_token(9)
    request.append_output_token(4)
    assert request.output_token_ids == [9, 4] and request.num_output_tokens == 2
    assert request.last_token_id == 4 and request.num_prompt_tokens == 3
    request.output_token_ids.append(1)  # a copy: the request is unchanged
    assert request.all_token_ids == [5, 6, 7, 9, 4] and request.num_tokens == 5


def test_pickles():
    copy = pickle.loads(pickle.dumps(make()))
    assert (copy.request_id, copy.prompt_token_ids, copy.max_tokens) == ("r", [5, 6, 7], 4)
