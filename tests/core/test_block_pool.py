import pytest

from jaxpage.core.block_pool import BlockPool
from jaxpage.core.kv_cache_manager import KVCacheManager
from tests.core.helpers import make_request


def test_null_block_is_reserved_and_queue_starts_in_id_order():
    pool = BlockPool(6)
    assert pool.num_usable_blocks == 5
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5]
    assert pool.null_block.block_id == 0
    with pytest.raises(ValueError, match="null block"):
        pool.free_blocks([pool.null_block])


def test_blocks_come_from_the_head_and_return_to_the_tail_in_free_order():
    pool = BlockPool(6)
    taken = pool.get_new_blocks(3)
    assert [b.block_id for b in taken] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in taken)
    assert pool.free_queue.block_ids() == [4, 5]
    pool.free_blocks([taken[2], taken[0]])
    assert pool.free_queue.block_ids() == [4, 5, 3, 1]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [4, 5, 3]


def test_remove_from_the_middle_is_constant_time_and_keeps_order():
    pool = BlockPool(6)
    middle = pool.blocks[3]
    pool.free_queue.remove(middle)
    assert pool.free_queue.block_ids() == [1, 2, 4, 5]
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="not in the free queue"):
        pool.free_queue.remove(middle)


def test_shared_block_returns_to_queue_only_when_last_reference_drops():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # a second holder
    pool.free_blocks([block])
    assert pool.free_queue.block_ids() == [2, 3]
    pool.free_blocks([block])
    assert pool.free_queue.block_ids() == [2, 3, 1]
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([block])


def test_over_allocation_raises():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)


def test_manager_allocates_append_only_and_frees_tail_first():
    manager = KVCacheManager(BlockPool(10), block_size=4)
    a, b = make_request("a", 9), make_request("b", 4)
    assert manager.allocate_slots(a, 9)
    assert manager.block_ids("a") == [1, 2, 3]
    assert manager.allocate_slots(b, 4)
    assert manager.block_ids("b") == [4]
    a.num_computed_tokens = 9
    assert manager.allocate_slots(a, 3)  # tokens 9..11 fit in block 3
    assert manager.block_ids("a") == [1, 2, 3]
    a.num_computed_tokens = 12
    assert manager.allocate_slots(a, 1)
    assert manager.block_ids("a") == [1, 2, 3, 5]
    manager.free(a)
    assert manager.block_pool.free_queue.block_ids() == [6, 7, 8, 9, 5, 3, 2, 1]
    assert manager.block_ids("a") == []


def test_manager_refuses_without_taking_anything():
    manager = KVCacheManager(BlockPool(4), block_size=4)
    assert not manager.allocate_slots(make_request("a", 13), 13)
    assert manager.block_pool.num_free_blocks == 3
    assert "a" not in manager.req_to_blocks
