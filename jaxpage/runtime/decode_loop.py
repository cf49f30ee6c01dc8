"""K decode iterations on the device in one call (``lax.fori_loop``).

Every iteration runs the model on one token per sequence, samples the next one, writes
its K/V through the block table (the host reserved blocks for all K tokens), and checks
stops on device: a stop token (EOS unless ignored, ``stop_token_ids``) once ``min_tokens``
are out, or ``max_tokens``. A finished row stops writing (slot -1) and reports -1 for
the rest of the window. Stop strings are the host's job: it drops tokens past a stop.

The batch must hold only decodes: token ``t`` belongs to sequence ``t`` for ``t < num_seqs``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpage.runtime.sampler import sample

KVCache = tuple[jax.Array, jax.Array]


def make_decode_loop(graphdef: Any, num_steps: int, block_size: int) -> Callable:
    """Jitted ``loop(state, kv_cache, batch) -> (kv_cache, tokens int32 [num_steps, S])``."""

    def loop(state: Any, kv_cache: KVCache, batch: dict[str, jax.Array]):
        model = nnx.merge(graphdef, state)
        num_tokens = batch["input_ids"].shape[0]
        num_rows = batch["kv_lens"].shape[0]
        token_row = jnp.minimum(jnp.arange(num_tokens), num_rows - 1)      # [T]
        real = jnp.arange(num_tokens) < batch["num_seqs"][0]                # [T]
        stop_ids = batch["stop_token_ids"]                                   # [S, K_stop]

        def body(i, carry):
            kv, ids, positions, kv_lens, done, tokens = carry
            live = real & ~done[token_row]
            table = batch["block_tables"][token_row, positions // block_size]
            slots = jnp.where(live, table * block_size + positions % block_size, -1)
            step_batch = dict(batch, input_ids=ids, positions=positions, slot_mapping=slots,
                              kv_lens=kv_lens)
            hidden, kv = model(ids, positions, kv, step_batch)
            logits = model.compute_logits(hidden[batch["logits_indices"]])  # [S, V]
            index = batch["sample_index"] + i
            new = sample(logits, dict(step_batch, sample_index=index))      # [S]
            num_out = index + 1
            is_stop = jnp.any((new[:, None] == stop_ids) & (stop_ids >= 0), axis=-1)
            finishes = (is_stop & (num_out >= batch["min_tokens"])) | (num_out >= batch["max_output"])
            tokens = tokens.at[i].set(jnp.where(done, -1, new))
            done = done | finishes
            ids = jnp.where(real, new[token_row], ids)
            return kv, ids, positions + 1, kv_lens + 1, done, tokens

        done = jnp.arange(num_rows) >= batch["num_seqs"][0]
        tokens = jnp.full((num_steps, num_rows), -1, jnp.int32)
        carry = (kv_cache, batch["input_ids"], batch["positions"], batch["kv_lens"], done, tokens)
        kv_cache, *_, tokens = jax.lax.fori_loop(0, num_steps, body, carry)
        return kv_cache, tokens

    return jax.jit(loop, donate_argnums=(1,))
