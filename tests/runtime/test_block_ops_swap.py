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
    block_ops.swap_out(kv, host, out_pairs)
    for device, slot in out_pairs:
        np.testing.assert_array_equal(host.k[slot], original[0][:, device])
        np.testing.assert_array_equal(host.v[slot], original[1][:, device])
    in_pairs = [(0, 11), (1, 2), (2, 4), (3, 6), (4, 8)]  # host slot -> device block
    kv = block_ops.swap_in(kv, host, in_pairs)
    k, v = (np.asarray(a) for a in kv)
    moved = {device: out_pairs[slot][0] for slot, device in in_pairs}
    for block in range(shape[1]):
        source = moved.get(block, block)
        np.testing.assert_array_equal(k[:, block], original[0][:, source])
        np.testing.assert_array_equal(v[:, block], original[1][:, source])
