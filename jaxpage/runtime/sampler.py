"""Sampling on device: greedy, temperature, top-k, top-p, min-p, per-request random streams.

Each row's randomness comes from ``fold_in(key(sample_seeds[i]), sample_index[i])``, so a
request draws the same numbers whether it runs alone or in a batch, and after preemption.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def suppress_tokens(logits: jax.Array, suppressed_ids: jax.Array) -> jax.Array:
    """Set logits of ``suppressed_ids`` (int32 [S, K], -1 = none) to -inf. logits: [S, V]."""
    vocab = logits.shape[-1]
    ids = jnp.where(suppressed_ids < 0, vocab, suppressed_ids)  # out of range: dropped
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def _filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                     top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p at -inf."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    ordered = -jnp.sort(-scaled, axis=-1)                                   # [S, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)              # [S]
    rank = jnp.arange(vocab)[None, :]
    ordered = jnp.where(rank < k[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs       # probability mass ranked above each token
    keep = (before < top_p[:, None]) & (rank < k[:, None])
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(ordered, (num_keep - 1)[:, None], axis=-1)  # [S, 1]
    min_p_floor = ordered[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    threshold = jnp.where(min_p[:, None] > 0, jnp.maximum(threshold, min_p_floor), threshold)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """logits float32 [S, V] -> token ids int32 [S]."""
    too_early = (batch["sample_index"] < batch["min_tokens"])[:, None]
    logits = suppress_tokens(logits, jnp.where(too_early, batch["stop_token_ids"], -1))
    temperature = batch["temperature"]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic() -> jax.Array:
        filtered = _filtered_logits(logits, temperature, batch["top_k"], batch["top_p"],
                                    batch["min_p"])
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
            batch["sample_seeds"], batch["sample_index"])
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:]))(keys)
        drawn = jnp.argmax(filtered + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda: greedy)


def top_logprobs(logits: jax.Array, want: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-``k`` (ids int32 [S, k], log-probabilities float32 [S, k]) of the raw model
    distribution, computed only when some row of ``want`` (int32 [S]) asks (else zeros)."""
    rows = logits.shape[0]

    def compute():
        values, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
        return ids.astype(jnp.int32), values

    def skip():
        return jnp.zeros((rows, k), jnp.int32), jnp.zeros((rows, k), jnp.float32)

    return jax.lax.cond(jnp.any(want > 0), compute, skip)
