"""Block swaps move exact blocks, also when one swap needs several program calls, in
both cache layouts (split K and V, and the TPU's fused rows: ``kv_layout``)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.runtime import block_ops

LAYOUTS = pytest.mark.parametrize("layout", ["split", "fused"])


def _cache(layout="split", num_blocks=12, layers=2, block_size=4, heads=2, dim=8):
    """A cache whose every element differs: (k, -k) split, or one fused array."""
    shape = (layers, num_blocks, block_size, heads, dim)
    if layout == "fused":
        shape = (layers, num_blocks, block_size, heads * 2 * 64)
    k = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    kv = (jnp.asarray(k), jnp.asarray(-k)) if layout == "split" else (jnp.asarray(k),)
    return kv, shape


def _host(num_blocks, kv):
    return block_ops.HostKVPool(num_blocks, [(a.shape[0], *a.shape[2:]) for a in kv],
                                np.float32)


def test_swap_chunk_is_a_power_of_two_within_the_byte_bound():
    assert block_ops.swap_chunk(block_ops.SWAP_CHUNK_BYTES) == 1
    assert block_ops.swap_chunk(10 * block_ops.SWAP_CHUNK_BYTES) == 1
    assert block_ops.swap_chunk(block_ops.SWAP_CHUNK_BYTES // 5) == 4
    assert block_ops.swap_chunk(3) * 3 <= block_ops.SWAP_CHUNK_BYTES


@LAYOUTS
def test_swap_out_and_in_in_chunks_moves_exactly_the_named_blocks(layout):
    kv, shape = _cache(layout)
    original = [np.asarray(a) for a in kv]
    host = _host(8, kv)
    host.chunk = 2  # 5 blocks: three calls of at most 2
    out_pairs = [(3, 0), (7, 1), (1, 2), (10, 3), (5, 4)]
    mover = block_ops.BlockMover(host)
    kv = mover.swap_out(kv, out_pairs)
    for device, slot in out_pairs:
        for host_array, array in zip(host.arrays, original):
            np.testing.assert_array_equal(host_array[slot], array[:, device])
    in_pairs = [(0, 11), (1, 2), (2, 4), (3, 6), (4, 8)]  # host slot -> device block
    kv = mover.swap_in(kv, in_pairs)
    moved = {device: out_pairs[slot][0] for slot, device in in_pairs}
    for array, before in zip((np.asarray(a) for a in kv), original):
        np.testing.assert_array_equal(array[:, 0], 0)  # the null block: padding writes zeros
        for block in range(1, shape[1]):
            np.testing.assert_array_equal(array[:, block], before[:, moved.get(block, block)])


def test_move_sizes_grow_by_four_up_to_the_chunk():
    assert block_ops.move_sizes(1) == [1]
    assert block_ops.move_sizes(64) == [1, 4, 16, 64]
    assert block_ops.move_sizes(32) == [1, 4, 16, 32]


@LAYOUTS
def test_copies_in_chunks_and_a_move_runs_in_the_smallest_built_size_that_holds_it(layout):
    kv, shape = _cache(layout)
    original = [np.asarray(a) for a in kv]
    host = _host(0, kv)
    host.chunk = 4
    mover = block_ops.BlockMover(host)
    assert mover.sizes == [1, 4]
    pairs = [(1, 6), (2, 7), (3, 8), (4, 9), (5, 10)]  # two calls: 4 copies, then 1
    kv = mover.copy(kv, pairs)
    for array, before in zip((np.asarray(a) for a in kv), original):
        for block in range(1, shape[1]):
            source = dict((dst, src) for src, dst in pairs).get(block, block)
            np.testing.assert_array_equal(array[:, block], before[:, source])
    assert mover.size_for(1) == 1
    mover.built = lambda size: size == 4  # only the largest built: one copy runs padded
    assert mover.size_for(1) == 4
    kv = mover.copy(kv, [(11, 1)])
    np.testing.assert_array_equal(np.asarray(kv[0])[:, 1], original[0][:, 11])


@pytest.mark.parametrize("one_by_one", [False, True])
def test_both_forms_of_reading_blocks_read_the_same(one_by_one):
    """The gather (CPUs, GPUs) and the TPU's one-block-at-a-time loop."""
    kv, _ = _cache("fused")
    ids = jnp.asarray([3, 0, 11, 3], jnp.int32)
    got = np.asarray(block_ops.read_blocks(kv[0], ids, one_by_one=one_by_one))
    np.testing.assert_array_equal(got, np.asarray(kv[0])[:, [3, 0, 11, 3]])
