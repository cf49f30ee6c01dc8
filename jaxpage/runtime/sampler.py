"""Sampling on device: penalties, greedy, temperature, top-k, top-p, min-p, per-request
random streams, and log-probabilities of the sampled token and the top ones.

Each row's randomness comes from ``fold_in(key(sample_seeds[i]), sample_index[i])``, so a
request draws the same numbers whether it runs alone or in a batch, and after preemption.

Order, as in vLLM: ``min_tokens`` masking, then penalties (repetition over prompt and
output tokens, presence and frequency over output tokens), then greedy or temperature and
the top-k / top-p / min-p filters. Log-probabilities are those of the raw model
distribution (before penalties and temperature), over the whole vocabulary.
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


PenaltyTables = tuple[jax.Array, jax.Array]  # seen bool [S, V], output counts int32 [S, V]


def penalty_tables(batch: dict[str, jax.Array], vocab: int) -> PenaltyTables | None:
    """Dense tables from the batch's ``penalty_ids`` / ``penalty_counts`` (None when P == 0).

    seen[i, t]: token t is in sequence i's prompt or output; counts[i, t]: times in its output.
    """
    ids = batch["penalty_ids"]                                               # [S, P]
    if ids.shape[1] == 0:
        return None
    rows = jnp.arange(ids.shape[0])[:, None]
    safe = jnp.where(ids < 0, vocab, ids)                                    # -1: dropped
    seen = jnp.zeros((ids.shape[0], vocab), bool).at[rows, safe].set(True, mode="drop")
    counts = jnp.zeros((ids.shape[0], vocab), jnp.int32).at[rows, safe].add(
        batch["penalty_counts"], mode="drop")
    return seen, counts


def record_tokens(tables: PenaltyTables, tokens: jax.Array, live: jax.Array) -> PenaltyTables:
    """Add one new output token per row (int32 [S]) where ``live`` (bool [S]) to the tables."""
    seen, counts = tables
    rows = jnp.arange(tokens.shape[0])
    safe = jnp.where(live & (tokens >= 0), tokens, seen.shape[1])
    return (seen.at[rows, safe].set(True, mode="drop"),
            counts.at[rows, safe].add(1, mode="drop"))


def apply_penalties(logits: jax.Array, tables: PenaltyTables,
                    batch: dict[str, jax.Array]) -> jax.Array:
    """vLLM's repetition, frequency and presence penalties. logits float32 [S, V]."""
    seen, counts = tables
    rep = batch["repetition_penalty"][:, None]                               # [S, 1]
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalized, logits)
    logits = logits - batch["frequency_penalty"][:, None] * counts.astype(logits.dtype)
    return logits - batch["presence_penalty"][:, None] * (counts > 0).astype(logits.dtype)


def sample(logits: jax.Array, batch: dict[str, jax.Array],
           tables: PenaltyTables | None = None) -> jax.Array:
    """logits float32 [S, V] -> token ids int32 [S]. ``tables``: see ``penalty_tables``."""
    too_early = (batch["sample_index"] < batch["min_tokens"])[:, None]
    logits = suppress_tokens(logits, jnp.where(too_early, batch["stop_token_ids"], -1))
    if tables is not None:
        logits = apply_penalties(logits, tables, batch)
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


def sampled_logprobs(logits: jax.Array, tokens: jax.Array, want: jax.Array,
                     k: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of the raw distribution (logits float32 [S, V]) for rows that want
    them (int32 [S]; all zeros when none does):

    (logprob of ``tokens`` float32 [S], its 1-based rank int32 [S],
     top-``k`` ids int32 [S, k], top-``k`` logprobs float32 [S, k]).
    """
    rows = logits.shape[0]

    def compute():
        logp = jax.nn.log_softmax(logits, axis=-1)                           # [S, V]
        chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
        rank = jnp.sum(logp > chosen[:, None], axis=-1).astype(jnp.int32) + 1
        values, ids = jax.lax.top_k(logp, k)
        return chosen, rank, ids.astype(jnp.int32), values

    def skip():
        return (jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.int32),
                jnp.zeros((rows, k), jnp.int32), jnp.zeros((rows, k), jnp.float32))

    return jax.lax.cond(jnp.any(want > 0), compute, skip)
