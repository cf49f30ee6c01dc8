"""The pure jitted model step: (params, caches, batch) -> (caches, ``StepOutputs``).

``caches`` is ``(kv_cache, penalty_table)``: the paged KV cache and the penalty table of
seen tokens and output counts (``jaxpage.core.batch.penalty_slots``). Both are donated: they go
in and come back updated, with no hidden device state.
The model is rebuilt from its graph definition and state with ``nnx.merge`` inside the
traced function, so the step stays a pure function of arrays. Inside, the batch is a
``step_batch.StepBatch``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpage.core.batch.batch_metadata import MAX_TOP_LOGPROBS
from jaxpage.core.batch.step_features import ALL_FEATURES, StepFeatures
from jaxpage.runtime.sampler import (adjusted_logits, fill_penalty_row, record_token_runs,
                                     record_tokens, rejection_sample, sample, sampled_logprobs,
                                     sampling_probs)
from jaxpage.runtime.step_batch import Packed, StepBatch, per_token, unpack
from jaxpage.runtime.step_outputs import StepOutputs
from pallas_kernels._backend import branches_wait_for_device, searchsorted_right
from pallas_kernels.kv_layout import KVCache  # (k, v) split or (kv,) fused

Caches = tuple[KVCache, jax.Array]  # (kv_cache, penalty_table int32 [R, V])


def branch_free(features: StepFeatures | None) -> StepFeatures | None:
    """The features a program is traced with: ``features``, except that the program that
    decides on the device (None) does all the optional work for every row, with no
    conditional, where a branch makes the host wait for the device (a GPU,
    ``branches_wait_for_device``): XLA:GPU reads a conditional's predicate back to the
    host, so the launch of the next step would wait for this one. The tokens are the same
    (``core.batch.step_features``: work a row does not need leaves its tokens as they
    are). Called while tracing, so the platform is the one being built for."""
    if features is None and branches_wait_for_device():
        return ALL_FEATURES
    return features


def make_step(graphdef: Any, jit: Callable = jax.jit, verify: bool = False,
              features: StepFeatures | None = None) -> Callable:
    """Jitted ``step(params, caches, packed, prev_tokens) -> (caches, outputs,
    last_tokens)``, ``outputs`` a ``StepOutputs``.

    ``packed`` is ``BatchMetadata.packed()``. A token whose ``input_src`` is ``i >= 0``
    takes ``prev_tokens[i]`` (int32 [R]: the previous call's ``last_tokens``, still on the
    device) instead of its ``input_ids``: that is how a step scheduled ahead of the host
    continues the previous one. outputs: the tokens int32 [S] and their ``may_stop``
    flags, top_ids / top_logprobs [S, MAX_TOP_LOGPROBS], token_logprobs float32 [S] and
    token_ranks int32 [S] of the sampled tokens (all zeros unless some row has
    ``want_logprobs``); last_tokens int32 [R]: tokens padded to R rows, for the next call.

    ``verify``: the step checks speculative proposals (``verify_tokens``): every token
    of the batch is sampled, and the outputs are per token ([T]), with ``emitted`` flags.
    A verify step takes two more arguments, ``draft_probs`` float32 [Q, V] (a draft
    model's proposal distributions, on the device) and ``q_src`` int32 [T]: for a token
    whose next token is a proposal drawn
    from ``draft_probs[q_src]``, that row (-1: a point-mass proposal, checked by drawing
    from the target and comparing); see ``rejection_sample``.

    A single step may take one more argument, ``token_mask`` int32 [S, ceil(V / 32)]:
    structured outputs' packed grammar masks (all ones for a row without a grammar),
    applied before everything else the sampler does (``sampler.apply_token_mask``).

    ``features`` (``jaxpage.core.batch.step_features``): the optional sampling work this
    program does, decided by the host for every batch it runs (no conditional in the
    program); None: decided on the device, one program for every batch (on a GPU: all
    of it, with no conditional either, ``branch_free``).
    """
    if verify:
        return jit(_verify_step(graphdef, features), donate_argnums=(1,))
    decided = features

    def step(state: Any, caches: Caches, packed: Packed, prev_tokens: jax.Array,
             *token_mask: jax.Array):
        batch = unpack(packed)
        if token_mask:
            batch = replace(batch, token_mask=token_mask[0])
        features = branch_free(decided)
        kv_cache, penalty_table = caches
        model = nnx.merge(graphdef, state)
        rows = prev_tokens.shape[0]
        source = batch.input_src                                             # [T]
        input_ids = jax.numpy.where(source >= 0, prev_tokens[jax.numpy.clip(source, 0, rows - 1)],
                                    batch.input_ids)
        # the tokens past cu_q_lens[-1] and the rows past num_seqs are padding: the
        # projections skip them
        live = replace(batch, live_tokens=batch.cu_q_lens[-1])
        hidden, kv_cache = model(input_ids, batch.positions, kv_cache, live)
        logits = model.compute_logits(hidden[batch.logits_indices],  # [S, V]
                                      batch.num_seqs[0])
        tokens = sample(logits, batch, penalty_table, features)
        penalty_table = record_tokens(penalty_table, batch.penalty_slot, tokens)
        logprobs = sampled_logprobs(logits, tokens, batch.want_logprobs, MAX_TOP_LOGPROBS,
                                    features)
        kept = min(rows, tokens.shape[0])
        last_tokens = jax.numpy.zeros(rows, jax.numpy.int32).at[:kept].set(tokens[:kept])
        outputs = StepOutputs.of(tokens, may_stop(tokens, batch), None, *logprobs)
        return (kv_cache, penalty_table), outputs, last_tokens

    return jit(step, donate_argnums=(1,))  # jit: a Placement.jit under tensor parallelism


def may_stop(tokens: jax.Array, batch: StepBatch) -> jax.Array:
    """int32 [S]: 1 where a row's token could end its request (one of its stop ids, or
    its ``max_tokens``-th token), else 0. A superset of the rows that stop (``min_tokens``
    and stop ids past the batch's list are left to the host's exact check): the host
    checks only these rows."""
    hit = jax.numpy.any(tokens[:, None] == batch.stop_token_ids, axis=1)          # [S]
    last = batch.sample_index + 1 >= batch.max_output                             # [S]
    return (hit | last).astype(jax.numpy.int32)


def make_penalty_fill(jit: Callable = jax.jit) -> Callable:
    """Jitted ``fill(_, penalty_table, slot, token_ids, values, reset) -> (penalty_table,)``
    (the unused first argument keeps ``Placement.jit``'s (state, carry, *inputs) form):
    one chunk of a ``PenaltyFill``, see ``sampler.fill_penalty_row``."""
    def fill(_: Any, penalty_table: jax.Array, slot, token_ids, values, reset):
        return (fill_penalty_row(penalty_table, slot, token_ids, values, reset),)

    return jit(fill, donate_argnums=(1,))


def make_forward_logits(graphdef: Any, jit: Callable = jax.jit) -> Callable:
    """Jitted ``forward(state, kv_cache, packed) -> (kv_cache, logits float32 [T, V])``.

    Logits of every scheduled token: for checks against a reference model and for
    prompt log-probabilities.
    """
    def forward(state: Any, kv_cache: KVCache, packed: Packed):
        batch = unpack(packed)
        model = nnx.merge(graphdef, state)
        hidden, kv_cache = model(batch.input_ids, batch.positions, kv_cache, batch)
        return kv_cache, model.compute_logits(hidden)

    return jit(forward, donate_argnums=(1,))


def verify_tokens(tokens: jax.Array, input_ids: jax.Array, cu_q_lens: jax.Array,
                  token_row: jax.Array) -> jax.Array:
    """int32 [T]: 1 where a verify step's sampled token is emitted, else 0.

    A row's tokens are its last accepted token followed by its proposals; the token
    sampled at a row's ``j``-th position is the target's choice for the token after it,
    and the ``j``-th proposal is the row's input token ``j + 1``. The row emits its
    sampled tokens up to and including the first one that differs from the proposal it
    checks (the correction), or all of them when every proposal matched (the last is
    the bonus token). Sampling from the target's own distribution and keeping the draw
    while it equals the proposal is the rejection sampler for a proposal distribution
    that is a point mass (prompt lookup): accepted with probability p(proposal), else
    the draw is distributed as the normalised (p - q)+. tokens, input_ids int32 [T];
    cu_q_lens int32 [S + 1]; token_row int32 [T].
    """
    T = tokens.shape[0]
    index = jnp.arange(T, dtype=jnp.int32)
    end = cu_q_lens[token_row + 1]                                          # [T]
    proposal = jnp.concatenate([input_ids[1:], jnp.zeros(1, input_ids.dtype)])
    rejected = ((index + 1 < end) & (tokens != proposal)).astype(jnp.int32)  # [T]
    before = jnp.cumsum(rejected) - rejected       # rejections at earlier tokens, any row
    start = cu_q_lens[token_row]
    clean = before - before[jnp.clip(start, 0, T - 1)] == 0   # none earlier in this row
    return (clean & (index < cu_q_lens[-1])).astype(jnp.int32)


def _verify_step(graphdef: Any, decided: StepFeatures | None = None) -> Callable:
    """``make_step(..., verify=True)``'s function (see there)."""
    def step(state: Any, caches: Caches, packed: Packed, prev_tokens: jax.Array,
             draft_probs: jax.Array, q_src: jax.Array):
        features = branch_free(decided)
        batch = unpack(packed)
        kv_cache, penalty_table = caches
        model = nnx.merge(graphdef, state)
        input_ids = batch.input_ids                                          # [T]
        hidden, kv_cache = model(input_ids, batch.positions, kv_cache, batch)
        logits = model.compute_logits(hidden)                                # [T, V]
        T, S = input_ids.shape[0], batch.kv_lens.shape[0]
        cu_q_lens = batch.cu_q_lens                                          # [S + 1]
        index = jnp.arange(T, dtype=jnp.int32)
        token_row = jnp.clip(searchsorted_right(cu_q_lens[1:], index),
                             0, S - 1).astype(jnp.int32)                     # [T]
        real = index < cu_q_lens[-1]
        # Penalties at a row's j-th token count the row's proposals 1..j as output tokens.
        start = cu_q_lens[token_row]
        tokens_of = per_token(batch, token_row, start,
                              jnp.where(real & (index > start), input_ids, -1))
        # The j-th token of a row samples that row's output number sample_index + j.
        tokens_of = replace(tokens_of,
                            sample_index=tokens_of.sample_index + index - start,
                            penalty_slot=jnp.where(real, tokens_of.penalty_slot, -1))
        tokens = sample(logits, tokens_of, penalty_table, features)          # [T]
        if draft_probs.shape[0] > 1:  # a draft model's proposals: min(1, p/q) acceptance
            has_q = (q_src >= 0) & (tokens_of.temperature > 0) & real        # [T]
            proposal = jnp.concatenate([input_ids[1:], jnp.zeros(1, input_ids.dtype)])

            def rejection() -> jax.Array:
                p = sampling_probs(adjusted_logits(logits, tokens_of, penalty_table, features),
                                   tokens_of, features)
                drawn = rejection_sample(p, draft_probs[jnp.maximum(q_src, 0)], proposal,
                                         tokens_of.sample_seeds, tokens_of.sample_index)
                return jnp.where(has_q, drawn, tokens)

            if features is None:
                tokens = jax.lax.cond(jnp.any(has_q), rejection, lambda: tokens)
            elif features.sampled:  # no sampled row: no row has a draft distribution
                tokens = rejection()
        last = tokens[batch.logits_indices]                                  # [S]
        logprobs = sampled_logprobs(logits, tokens, tokens_of.want_logprobs, MAX_TOP_LOGPROBS,
                                    features)
        emitted = verify_tokens(tokens, input_ids, cu_q_lens, token_row)
        # The device keeps the penalty rows current: every emitted token is counted.
        penalty_table = record_token_runs(
            penalty_table, jnp.where(emitted > 0, tokens_of.penalty_slot, -1), tokens)
        outputs = StepOutputs.of(tokens, may_stop(tokens, tokens_of), emitted, *logprobs)
        rows = prev_tokens.shape[0]
        kept = min(rows, S)
        last_tokens = jnp.zeros(rows, jnp.int32).at[:kept].set(last[:kept])
        return (kv_cache, penalty_table), outputs, last_tokens

    return step
