import pytest

from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
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


def test_popleft_many_unlinks_a_run_from_the_head():
    pool = BlockPool(8)
    pool.free_blocks([pool.get_new_blocks(1)[0]])  # block 1 goes to the tail
    taken = pool.free_queue.popleft_many(3)
    assert [b.block_id for b in taken] == [2, 3, 4]
    assert all(b.prev_free is None and b.next_free is None for b in taken)
    assert pool.free_queue.block_ids() == [5, 6, 7, 1]
    assert pool.num_free_blocks == 4
    assert pool.free_queue.popleft_many(0) == []
    assert [b.block_id for b in pool.free_queue.popleft_many(4)] == [5, 6, 7, 1]
    assert pool.free_queue.block_ids() == [] and pool.num_free_blocks == 0
    pool.free_queue.append(taken[1])  # the queue still links both ways
    assert pool.free_queue.block_ids() == [3]
    with pytest.raises(ValueError, match="asked for 2 blocks but 1 are free"):
        pool.free_queue.popleft_many(2)


def test_append_blocks_gives_each_request_the_block_allocate_slots_would():
    def run(batched: bool):
        manager = KVCacheManager(BlockPool(12), block_size=4)
        requests = [make_request(name, 8) for name in "abc"]
        for request in requests:
            assert manager.allocate_slots(request, 8)
            request.num_computed_tokens = 7  # token 7 ends block 1, token 8 starts block 2
        manager.take_changed()
        if batched:
            assert manager.append_blocks(requests, [3, 3, 3])
        else:
            assert all(manager.allocate_slots(request, 2) for request in requests)
        return ({r.request_id: manager.block_ids(r.request_id) for r in requests},
                manager.take_changed(), manager.block_pool.free_queue.block_ids())

    assert run(True) == run(False) == (
        {"a": [1, 2, 7], "b": [3, 4, 8], "c": [5, 6, 9]}, {"a": 2, "b": 2, "c": 2}, [10, 11])


def test_append_blocks_is_all_or_nothing():
    manager = KVCacheManager(BlockPool(8), block_size=4)
    a, b, c = (make_request(name, 4) for name in "abc")
    for request in (a, b, c):
        assert manager.allocate_slots(request, 4)
    manager.take_changed()
    assert manager.block_pool.num_free_blocks == 4
    assert manager.append_blocks([a, b], [2, 2])
    assert manager.block_ids("a") == [1, 4] and manager.block_ids("b") == [2, 5]
    # Too few free blocks: nothing taken.
    d, e, f = (make_request(name, 1) for name in "def")
    for request in (d, e):
        assert manager.allocate_slots(request, 1)
    assert manager.block_pool.num_free_blocks == 0
    assert not manager.append_blocks([c], [2])
    manager.free(d)
    manager.free(e)
    # A request whose last block is shared would need a copy: nothing taken.
    manager.fork(c, f)
    before = manager.block_pool.free_queue.block_ids()
    manager.take_changed()
    assert not manager.append_blocks([a, c], [3, 2])
    assert manager.block_ids("a") == [1, 4] and manager.block_ids("c") == [3]
    assert manager.block_pool.free_queue.block_ids() == before and manager.take_changed() == {}
    # A request holding no blocks, or two fewer than asked, is refused too.
    assert not manager.append_blocks([make_request("g", 4)], [1])
    assert not manager.append_blocks([a], [4])
    # One already holding its count is left alone; the others still grow.
    manager.free(f)
    manager.take_changed()
    assert manager.append_blocks([a, c], [2, 2]) and manager.block_ids("a") == [1, 4]
    assert manager.block_ids("c") == [3, before[0]] and manager.take_changed() == {"c": 1}
