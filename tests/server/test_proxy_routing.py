"""The proxy's choice of instance: least loaded, unless one recently took the request's
prefix and is not too far ahead (``jaxpage.server.proxy.routing``)."""

from __future__ import annotations

import pytest

from jaxpage.server.proxy.routing import InstancePool, prefix_keys, prompt_keys

A, B, C = "http://a", "http://b", "http://c"


def test_prefix_keys_chain_whole_blocks():
    keys = prefix_keys(list(range(10)), 4)
    assert len(keys) == 2  # the partial third block has no key
    assert prefix_keys(list(range(8)) + [99, 98], 4) == keys  # equal first two blocks
    assert prefix_keys([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == keys[0]
    assert prefix_keys([0, 1, 2, 3, 9, 9, 9, 9], 4)[1] != keys[1]
    assert prefix_keys([4, 5, 6, 7], 4)[0] != keys[1]  # a key covers its whole prefix
    assert prefix_keys(list(range(10)), 4, "lora-a") != keys  # another model or adapter
    with pytest.raises(ValueError, match="block=0"):
        prefix_keys([1], 0)


def test_prompt_keys_of_completions_and_chat():
    system = "You are a careful assistant. " * 10  # 290 characters: 4 whole text blocks
    one = prompt_keys({"model": "m", "prompt": system + "What is 2+2?"})
    two = prompt_keys({"model": "m", "prompt": system + "Name a colour."})
    assert len(one) >= 4 and one[:4] == two[:4]
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    other = [{"role": "system", "content": system}, {"role": "user", "content": "bye"}]
    assert prompt_keys({"model": "m", "messages": chat})[:4] == \
        prompt_keys({"model": "m", "messages": other})[:4]
    assert prompt_keys({"model": "m", "prompt": list(range(40))})[:2] == \
        prompt_keys({"model": "m", "prompt": list(range(32)) + [7]})[:2]
    assert prompt_keys({"model": "m", "prompt": ["a", "b"]}) == []  # a batch: no affinity
    assert prompt_keys({"model": "m", "prompt": [2**70] * 40}) == []  # not token ids
    assert len(prompt_keys({"model": "m", "prompt": "\ud800" * 64})) == 1  # a lone surrogate
    assert prompt_keys({"model": "m"}) == []


def test_least_loaded_without_a_known_prefix():
    pool = InstancePool([A, B + "/"])
    pool.in_flight[A] = 2
    assert pool.pick() == B
    assert pool.pick(prefix_keys(list(range(16)), 4)) == B  # nothing remembered yet
    assert pool.num_affinity_routed == 0


def test_a_remembered_prefix_keeps_its_instance_up_to_the_imbalance():
    pool = InstancePool([A, B, C], max_imbalance=2)
    shared = list(range(16))
    assert pool.pick(prefix_keys(shared + [1, 1, 1, 1], 4)) == A
    pool.in_flight.update({A: 2, B: 0, C: 1})
    # Same first four blocks: A keeps it though B is idle (2 ahead is within the limit).
    assert pool.pick(prefix_keys(shared + [2, 2, 2, 2], 4)) == A
    assert pool.num_affinity_routed == 1
    assert pool.remembered(prefix_keys(shared + [2, 2, 2, 2], 4)) == (A, 5)
    pool.in_flight[A] = 3  # now 3 ahead: the least loaded instance takes it, and the prefix
    assert pool.pick(prefix_keys(shared, 4)) == B
    assert pool.remembered(prefix_keys(shared, 4)) == (B, 4)
    # A different prefix goes by load alone.
    assert pool.pick(prefix_keys([9] * 16, 4)) == B
    assert pool.num_affinity_routed == 1


def test_the_run_of_remembered_keys_ends_where_another_instance_took_over():
    pool = InstancePool([A, B])
    first = prefix_keys(list(range(12)), 4)
    pool.remember(first, A)
    pool.remember(first[:1], B)  # a later request with only the first block went to B
    assert pool.remembered(first) == (B, 1)
    assert pool.remembered(prefix_keys([5] * 12, 4)) == (None, 0)


def test_oldest_keys_are_forgotten_past_the_capacity():
    pool = InstancePool([A, B], capacity=4)
    old, new = prefix_keys(list(range(16)), 4), prefix_keys(list(range(100, 116)), 4)
    pool.remember(old, A)
    pool.remember(new, B)
    assert pool.remembered(old) == (None, 0) and pool.remembered(new) == (B, 4)


def test_bad_pools_are_refused():
    with pytest.raises(ValueError, match="at least one instance"):
        InstancePool([])
    with pytest.raises(ValueError, match="max_imbalance=-1"):
        InstancePool([A], max_imbalance=-1)


def test_instances_that_refused_are_avoided_while_others_remain():
    pool = InstancePool([A, B])
    keys = prefix_keys(list(range(16)), 4)
    assert pool.pick(keys) == A
    assert pool.pick(keys, avoid={A}) == B  # A was full: its prefix does not hold it
    assert pool.pick(keys, avoid={A, B}) == B  # everyone refused: load and prefix again
