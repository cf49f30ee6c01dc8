"""A model whose every layer slides: blocks behind the window are given back, exactly."""

import pytest

from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from tests.core.helpers import make_request


def _manager(num_blocks=20, window=8, block_size=4, **kwargs):
    return KVCacheManager(BlockPool(num_blocks, enable_caching=False), block_size,
                          sliding_window=window, **kwargs)


def _decode(kv, request, count):
    """``count`` decode steps: allocate a slot, then count the token as computed."""
    for _ in range(count):
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        request.all_token_ids.append(5)
        kv.cache_full_blocks(request)


def test_blocks_behind_the_window_become_the_null_block_and_return_to_the_pool():
    kv = _manager()
    r = make_request("a", 10)
    assert kv.allocate_slots(r, 10)
    assert kv.block_ids("a") == [1, 2, 3]
    r.num_computed_tokens = 10
    kv.cache_full_blocks(r)
    # positions <= 10 - 8 = 2 are dead: block 0 holds 0..3, still visible to position 10
    assert kv.block_ids("a") == [1, 2, 3]
    _decode(kv, r, 1)  # 11 computed: positions <= 3 dead -> block 0 given back
    assert kv.block_ids("a") == [0, 2, 3]
    assert kv.num_live_blocks("a") == 2
    free_before = kv.block_pool.num_free_blocks
    _decode(kv, r, 4)  # 15 computed: positions <= 7 dead -> block 1 too; block 3 allocated
    assert kv.block_ids("a") == [0, 0, 3, 4]
    assert kv.block_pool.num_free_blocks == free_before  # one given back, one taken
    assert kv.take_changed()["a"] == 0  # the batch builder rewrites the row from block 0


def test_a_long_sequence_holds_window_over_block_size_plus_two_blocks():
    kv = _manager(num_blocks=12, window=8, block_size=4)
    r = make_request("a", 3, max_tokens=500, max_model_len=1024)
    assert kv.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    most = 0
    for _ in range(300):
        _decode(kv, r, 1)
        most = max(most, kv.num_live_blocks("a"))
    assert len(kv.block_ids("a")) == kv.num_blocks_for(r.num_computed_tokens + 1)
    assert most <= 8 // 4 + 2
    kv.free(r)
    assert kv.block_pool.num_free_blocks == 11  # every block back, the null block untouched
    assert kv.block_pool.null_block.ref_cnt == 1


def test_swap_out_moves_only_live_blocks_and_swap_in_restores_alignment():
    kv = _manager(num_host_blocks=8)
    r = make_request("a", 10)
    assert kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    _decode(kv, r, 5)  # 15 computed: blocks 0 and 1 dropped
    assert kv.block_ids("a") == [0, 0, 3, 4]
    kv.swap_out(r)
    swap_out, _, _ = kv.take_pending_block_ops()
    assert swap_out == [(3, 0), (4, 1)]
    kv.swap_in(r)
    _, swap_in, _ = kv.take_pending_block_ops()
    assert [b for b in kv.block_ids("a")[:2]] == [0, 0]
    assert [dst for _, dst in swap_in] == kv.block_ids("a")[2:]
    kv.free(r)
    assert kv.block_pool.num_free_blocks == kv.block_pool.num_usable_blocks


def test_forks_share_what_is_left_and_free_cleanly():
    kv = _manager()
    parent, child = make_request("p", 10), make_request("c", 10)
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    _decode(kv, parent, 3)  # block 0 dropped
    kv.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    assert kv.block_ids("c") == kv.block_ids("p") == [0, 2, 3, 4]
    kv.free(parent)
    kv.free(child)
    assert kv.block_pool.num_free_blocks == kv.block_pool.num_usable_blocks


def test_most_blocks_held_bounds_admission_by_the_window():
    kv = _manager(window=8, block_size=4)
    assert kv.most_blocks_held(1000, max_step_tokens=16) == 7  # (8 + 16) / 4 + 1
    assert kv.most_blocks_held(10, max_step_tokens=16) == 3
    full = KVCacheManager(BlockPool(4), 4)
    assert full.most_blocks_held(1000, max_step_tokens=16) == 250


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding_window=0"):
        _manager(window=0)
