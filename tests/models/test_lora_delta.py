"""The LoRA delta of mixed slots, by mask (many tokens) and by gather (fewer tokens than
slots), against numpy per token."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.models.lora import lora_delta, token_slots


@pytest.mark.parametrize("num_tokens", [2, 3, 11])  # 2 < 4 slots: gathered; else masked
def test_lora_delta_equals_each_tokens_own_adapter(num_tokens):
    slots, rank, size_in, size_out = 4, 3, 10, 7
    rng = np.random.default_rng(num_tokens)
    a = rng.standard_normal((size_in, slots * rank)).astype(np.float32)
    b = rng.standard_normal((slots * rank, size_out)).astype(np.float32)
    x = rng.standard_normal((num_tokens, size_in)).astype(np.float32)
    # rows of 1, 2, ... tokens; the last row is padding (slot 0, no tokens)
    counts = [1 + i % 3 for i in range(num_tokens)]
    counts = counts[:np.searchsorted(np.cumsum(counts), num_tokens, side="right") + 1]
    counts[-1] = num_tokens - sum(counts[:-1])
    row_slot = np.array([(i * 3) % (slots + 1) for i in range(len(counts))] + [0], np.int32)
    cu = np.concatenate([[0], np.cumsum(counts), [num_tokens]]).astype(np.int32)
    tokens = token_slots((slots, rank), jnp.asarray(row_slot), jnp.asarray(cu), num_tokens,
                         jnp.float32)
    assert (tokens.mask is None) == (num_tokens < slots)
    want_slot = np.repeat(row_slot[:len(counts)], counts)
    np.testing.assert_array_equal(np.asarray(tokens.slot), want_slot)
    got = np.asarray(lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), tokens))
    for t, s in enumerate(want_slot):
        cols = slice((s - 1) * rank, s * rank)
        want = np.zeros(size_out) if s == 0 else x[t] @ a[:, cols] @ b[cols]
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5)
