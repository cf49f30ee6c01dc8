"""The pure jitted model step: (params, kv_cache, batch) -> (kv_cache, sampled tokens).

The KV cache is donated: it goes in and comes back updated, with no hidden device state.
The model is rebuilt from its graph definition and state with ``nnx.merge`` inside the
traced function, so the step stays a pure function of arrays.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx

from jaxpage.core.batch import MAX_TOP_LOGPROBS
from jaxpage.runtime.sampler import penalty_tables, sample, sampled_logprobs

KVCache = tuple[jax.Array, jax.Array]


def make_step(graphdef: Any, jit: Callable = jax.jit) -> Callable:
    """Jitted ``step(state, kv_cache, batch) -> (kv_cache, (tokens, top_ids, top_logprobs,
    token_logprobs, token_ranks))``.

    tokens: int32 [S]; top_ids, top_logprobs: [S, MAX_TOP_LOGPROBS]; token_logprobs float32
    [S] and token_ranks int32 [S] of the sampled tokens (all zeros unless some row has
    ``want_logprobs``).
    """
    def step(state: Any, kv_cache: KVCache, batch: dict[str, jax.Array]):
        model = nnx.merge(graphdef, state)
        hidden, kv_cache = model(batch["input_ids"], batch["positions"], kv_cache, batch)
        logits = model.compute_logits(hidden[batch["logits_indices"]])  # [S, V]
        tokens = sample(logits, batch, penalty_tables(batch, logits.shape[-1]))
        chosen, rank, top_ids, top_values = sampled_logprobs(
            logits, tokens, batch["want_logprobs"], MAX_TOP_LOGPROBS)
        return kv_cache, (tokens, top_ids, top_values, chosen, rank)

    return jit(step, donate_argnums=(1,))  # jit: a Placement.jit under tensor parallelism


def make_forward_logits(graphdef: Any, jit: Callable = jax.jit) -> Callable:
    """Jitted ``forward(state, kv_cache, batch) -> (kv_cache, logits float32 [T, V])``.

    Logits of every scheduled token: for checks against a reference model and for
    prompt log-probabilities.
    """
    def forward(state: Any, kv_cache: KVCache, batch: dict[str, jax.Array]):
        model = nnx.merge(graphdef, state)
        hidden, kv_cache = model(batch["input_ids"], batch["positions"], kv_cache, batch)
        return kv_cache, model.compute_logits(hidden)

    return jit(forward, donate_argnums=(1,))
