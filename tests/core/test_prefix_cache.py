"""Prefix caching: exact blocks reused, missed and evicted."""

import numpy as np

from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.kv.prefix_hash import ROOT_HASH, extend_block_hashes, hash_block
from jaxpage.core.sched.step_result import StepResult
from tests.core.helpers import make_request, make_scheduler

SHARED = list(range(100, 112))  # 3 full blocks of 4 tokens


def finish_prefill(s, token=50):
    out = s.schedule()
    s.apply(out, StepResult(np.full(len(out.scheduled), token, np.int32)))
    return out


def test_hashes_chain_through_parents_and_extra_keys():
    hashes = []
    extend_block_hashes(hashes, list(range(10)), 4)
    assert len(hashes) == 2  # the partial third block is not hashed
    assert hashes[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    assert hashes[1] != hash_block(ROOT_HASH, [4, 5, 6, 7])  # same tokens, other prefix
    assert hash_block(ROOT_HASH, [0, 1, 2, 3], ("lora-a",)) != hashes[0]


def test_second_request_takes_the_cached_prefix_blocks():
    s = make_scheduler(num_blocks=16)
    a = make_request("a", 0, prompt=SHARED + [1, 2])
    s.add_request(a)
    finish_prefill(s)
    assert s.kv.block_ids("a") == [1, 2, 3, 4]
    b = make_request("b", 0, prompt=SHARED + [7])
    s.add_request(b)
    out = finish_prefill(s)
    assert ("b", 1) in [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]
    assert s.kv.block_ids("b") == [1, 2, 3, 5]
    assert b.num_cached_tokens == 12
    assert [blk.ref_cnt for blk in s.kv.block_pool.blocks[1:4]] == [2, 2, 2]
    assert s.stats()["prefix_cache_hit_rate"] == 12 / (14 + 13)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request("a", 0, prompt=SHARED, max_tokens=1))
    finish_prefill(s)
    b = make_request("b", 0, prompt=SHARED)
    s.add_request(b)
    out = finish_prefill(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 4)]
    assert b.num_cached_tokens == 8 and s.kv.block_ids("b")[:2] == [1, 2]


def test_divergent_prompts_miss_after_the_first_different_block():
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request("a", 0, prompt=SHARED + [1]))
    finish_prefill(s)
    other = SHARED[:4] + [0] + SHARED[5:] + [1]
    c = make_request("c", 0, prompt=other)
    s.add_request(c)
    finish_prefill(s)
    assert c.num_cached_tokens == 4 and s.kv.block_ids("c")[0] == 1
    assert s.kv.block_ids("c")[1:] == [5, 6, 7]


def test_freed_cached_blocks_are_revived_until_evicted_in_lru_order():
    s = make_scheduler(num_blocks=6)  # 5 usable blocks
    a = make_request("a", 0, prompt=SHARED + [1], max_tokens=1)
    s.add_request(a)
    finish_prefill(s)  # a finishes: blocks [1, 2, 3, 4] freed tail first
    pool = s.kv.block_pool
    assert pool.free_queue.block_ids() == [5, 4, 3, 2, 1]
    assert len(pool.cached_blocks) == 3
    # A 9-token unrelated prompt takes 3 blocks from the head: 5, then 4, then 3 (evicted).
    s.add_request(make_request("x", 0, prompt=list(range(300, 309)), max_tokens=1))
    finish_prefill(s)
    # x finished too and freed its blocks [5, 4, 3] tail first.
    assert pool.free_queue.block_ids() == [2, 1, 3, 4, 5]
    b = make_request("b", 0, prompt=SHARED + [9])
    s.add_request(b)
    finish_prefill(s)
    # Blocks 1 and 2 (the first two prefix blocks) survived; block 3 was evicted.
    assert b.num_cached_tokens == 8
    assert s.kv.block_ids("b")[:2] == [1, 2]


def test_eviction_drops_the_hash_when_a_cached_block_is_reused():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"h" * 16)
    pool.free_blocks([block])
    assert pool.get_cached_block(b"h" * 16) is block  # free but still cached
    pool.get_new_blocks(2)  # takes block 2, then block 1 (evicting it)
    assert pool.get_cached_block(b"h" * 16) is None and block.block_hash is None


def test_caching_disabled_never_hits():
    s = make_scheduler(num_blocks=16, enable_caching=False)
    s.add_request(make_request("a", 0, prompt=SHARED + [1]))
    finish_prefill(s)
    b = make_request("b", 0, prompt=SHARED + [1])
    s.add_request(b)
    finish_prefill(s)
    assert b.num_cached_tokens == 0 and s.kv.block_ids("b") == [5, 6, 7, 8]
