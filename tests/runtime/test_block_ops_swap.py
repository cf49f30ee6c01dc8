"""Block swaps move exact blocks, also when one swap needs several program calls."""

import jax.numpy as jnp
import numpy as np

from jaxpage.runtime import block_ops


def _cache(num_blocks=12, layers=2, block_size=4, heads=2, dim=8):
    shape = (layers, num_blocks, block_size, heads, dim)
    k = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    return (jnp.asarray(k), jnp.asarray(-k)), shape


def test_swap_chunk_is_a_power_of_two_within_the_byte_bound():
    assert block_ops.swap_chunk(block_ops.SWAP_CHUNK_BYTES) == 1
    assert block_ops.swap_chunk(10 * block_ops.SWAP_CHUNK_BYTES) == 1
    assert block_ops.swap_chunk(block_ops.SWAP_CHUNK_BYTES // 5) == 4
    assert block_ops.swap_chunk(3) * 3 <= block_ops.SWAP_CHUNK_BYTES


def test_swap_out_and_in_in_chunks_moves_exactly_the_named_blocks():
    kv, shape = _cache()
    original = [np.asarray(a) for a in kv]
    host = block_ops.HostKVPool(8, (shape[0], *shape[2:]), np.float32)
    host.chunk = 2  # 5 blocks: three calls of at most 2
    out_pairs = [(3, 0), (7, 1), (1, 2), (10, 3), (5, 4)]
    mover = block_ops.BlockMover(host)
    kv = mover.swap_out(kv, out_pairs)
    for device, slot in out_pairs:
        np.testing.assert_array_equal(host.k[slot], original[0][:, device])
        np.testing.assert_array_equal(host.v[slot], original[1][:, device])
    in_pairs = [(0, 11), (1, 2), (2, 4), (3, 6), (4, 8)]  # host slot -> device block
    kv = mover.swap_in(kv, in_pairs)
    k, v = (np.asarray(a) for a in kv)
    moved = {device: out_pairs[slot][0] for slot, device in in_pairs}
    np.testing.assert_array_equal(k[:, 0], 0)  # the null block: padding writes zeros there
    for block in range(1, shape[1]):
        source = moved.get(block, block)
        np.testing.assert_array_equal(k[:, block], original[0][:, source])
        np.testing.assert_array_equal(v[:, block], original[1][:, source])


def test_move_sizes_grow_by_four_up_to_the_chunk():
    assert block_ops.move_sizes(1) == [1]
    assert block_ops.move_sizes(64) == [1, 4, 16, 64]
    assert block_ops.move_sizes(32) == [1, 4, 16, 32]


def test_copies_in_chunks_and_a_move_runs_in_the_smallest_built_size_that_holds_it():
    kv, shape = _cache()
    original = [np.asarray(a) for a in kv]
    host = block_ops.HostKVPool(0, (shape[0], *shape[2:]), np.float32)
    host.chunk = 4
    mover = block_ops.BlockMover(host)
    assert mover.sizes == [1, 4]
    pairs = [(1, 6), (2, 7), (3, 8), (4, 9), (5, 10)]  # two calls: 4 copies, then 1
    kv = mover.copy(kv, pairs)
    k, v = (np.asarray(a) for a in kv)
    for block in range(1, shape[1]):
        source = dict((dst, src) for src, dst in pairs).get(block, block)
        np.testing.assert_array_equal(k[:, block], original[0][:, source])
        np.testing.assert_array_equal(v[:, block], original[1][:, source])
    assert mover.size_for(1) == 1
    mover.built = lambda size: size == 4  # only the largest built: one copy runs padded
    assert mover.size_for(1) == 4
    kv = mover.copy(kv, [(11, 1)])
    np.testing.assert_array_equal(np.asarray(kv[0])[:, 1], original[0][:, 11])
