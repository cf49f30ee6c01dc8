"""Sampling on device: penalties, greedy, temperature, top-k, top-p, min-p, per-request
random streams, and log-probabilities of the sampled token and the top ones.

Each row's randomness is a function of its ``sample_seeds[i]``, ``sample_index[i]`` and
the token id only (``gumbel_noise``), so a request draws the same numbers whether it runs
alone or in a batch, and after preemption.

Order, as in vLLM: a structured-output row's grammar mask (``token_mask``: tokens the
grammar forbids get -inf), then ``min_tokens`` masking, then penalties (repetition over prompt and
output tokens, presence and frequency over output tokens), then greedy or temperature and
the top-k / top-p / min-p filters. Log-probabilities are those of the raw model
distribution (before penalties and temperature), over the whole vocabulary.

Optional work (the top-k / top-p cut, ``cut_threshold``; penalties, log-probabilities, the noise of
sampled rows) is skipped by a conditional on the device when no row needs it, or, given
``features`` (``jaxpage.core.batch.step_features``: the host decided), left out of the
program or done for every row, with no conditional.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpage.core.batch.penalty_slots import SEEN
from jaxpage.core.batch.step_features import StepFeatures
from jaxpage.runtime.cut_threshold import cut_threshold, rows_cut
from jaxpage.runtime.step_batch import StepBatch
from pallas_kernels.sampling import first_argmax, gumbel_noise, sample_rows
from pallas_kernels.sampling.reference import kept_scaled


def suppress_tokens(logits: jax.Array, suppressed_ids: jax.Array) -> jax.Array:
    """Set logits of ``suppressed_ids`` (int32 [S, K], -1 = none) to -inf. logits: [S, V]."""
    vocab = logits.shape[-1]
    ids = jnp.where(suppressed_ids < 0, vocab, suppressed_ids)  # out of range: dropped
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def unpack_token_mask(mask: jax.Array, vocab: int) -> jax.Array:
    """bool [S, V] from a packed mask int32 [S, ceil(V / 32)]: token ``v`` is allowed
    when bit ``v % 32`` of word ``v // 32`` is set (llguidance's layout; -1 allows all)."""
    bits = jnp.arange(32, dtype=jnp.uint32)
    words = mask.astype(jnp.uint32)[:, :, None] >> bits                         # [S, W, 32]
    allowed = (words & jnp.uint32(1)).astype(bool).reshape(mask.shape[0], -1)   # [S, W * 32]
    return allowed[:, :vocab]


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits float32 [S, V] with every token ``mask`` (packed int32 [S, ceil(V / 32)])
    forbids at -inf."""
    return jnp.where(unpack_token_mask(mask, logits.shape[-1]), logits, -jnp.inf)


def _cut_threshold(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                   top_p: jax.Array, features: StepFeatures | None = None) -> jax.Array:
    """float32 [S]: each sampled row's smallest logit (unscaled) that top-k and top-p keep,
    -inf where neither cuts anything (``cut_threshold``). A token is kept when its logit is
    at least this.

    Unscaled, so the cut never depends on how a backend rounds logits / temperature
    (dividing by a positive temperature keeps the order): a kernel that scaled a row one
    ulp differently from XLA would otherwise drop the very top token at top_k=1.
    Finding the cut takes passes over the whole vocabulary (a sort, or a bisection), far
    more than the rest of sampling (``docs/benchmarks/design_measurements.md``), so it only
    runs when some sampled row asks for top-k or top-p (``features.sort``, when given).
    """
    def find() -> jax.Array:
        return cut_threshold(logits, temperature, top_k, top_p)

    def no_threshold() -> jax.Array:
        return jnp.full((logits.shape[0],), -jnp.inf, logits.dtype)

    if features is not None:
        return find() if features.sort else no_threshold()
    cuts = rows_cut(temperature, top_k, top_p, logits.shape[-1])            # [S]
    return jax.lax.cond(jnp.any(cuts), find, no_threshold)


def _filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                     top_p: jax.Array, min_p: jax.Array,
                     features: StepFeatures | None = None) -> jax.Array:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p at -inf
    (``_cut_threshold``; min-p alone needs only each row's maximum)."""
    threshold = _cut_threshold(logits, temperature, top_k, top_p, features)
    return kept_scaled(logits, temperature, threshold, min_p)


def penalize(logits: jax.Array, penalty_table: jax.Array, batch: StepBatch,
             features: StepFeatures | None = None) -> jax.Array:
    """vLLM's repetition, frequency and presence penalties for rows with a penalty slot.

    logits float32 [S, V]; penalty_table int32 [R, V] (``jaxpage.core.batch.penalty_slots``: a
    value is count_in_output | SEEN). Rows with ``penalty_slot == -1`` are unchanged, and
    when no row has a slot (``features.penalties`` False, when given) the table is not
    read at all.
    """
    slots = batch.penalty_slot                                               # [S]

    def apply(logits: jax.Array) -> jax.Array:
        values = penalty_table[jnp.maximum(slots, 0)]                        # [S, V]
        if batch.proposal_ids is not None:  # a verify step: count the proposals before each
            extra = proposals_before(batch.proposal_ids, batch.row_start,
                                     logits.shape[-1])
            values = jnp.where(extra > 0, (values | SEEN) + extra, values)
        values = jnp.where((slots >= 0)[:, None], values, 0)
        seen = values != 0
        counts = (values & (SEEN - 1)).astype(logits.dtype)
        rep = batch.repetition_penalty[:, None]                              # [S, 1]
        penalized = jnp.where(logits > 0, logits / rep, logits * rep)
        logits = jnp.where(seen, penalized, logits)
        logits = logits - batch.frequency_penalty[:, None] * counts
        return logits - batch.presence_penalty[:, None] * (counts > 0).astype(logits.dtype)

    if features is not None:
        return apply(logits) if features.penalties else logits
    return jax.lax.cond(jnp.any(slots >= 0), apply, lambda x: x, logits)


def proposals_before(proposal_ids: jax.Array, row_start: jax.Array, vocab: int) -> jax.Array:
    """int32 [T, V]: for each token of a verify step, how often each id occurs among its
    row's proposals up to and including it: the output tokens that plain decoding would
    have counted by the time it sampled after this token. ``proposal_ids`` int32 [T]: the
    token if it is a proposal (not a row's first token, not padding), else -1;
    ``row_start`` int32 [T]: the index of the token's row's first token."""
    onehot = jax.nn.one_hot(proposal_ids, vocab, dtype=jnp.int32)            # -1: all zeros
    running = jnp.cumsum(onehot, axis=0)                                     # [T, V]
    before_row = jnp.where((row_start > 0)[:, None],
                           running[jnp.maximum(row_start - 1, 0)], 0)
    return running - before_row


def record_token_runs(penalty_table: jax.Array, slots: jax.Array, tokens: jax.Array) -> jax.Array:
    """Count new output tokens (int32 [T]) in their rows' slots (int32 [T], -1: none);
    several tokens may share a slot, and a token id may repeat (a verify step's emitted
    run)."""
    rows, vocab = penalty_table.shape
    keep = (slots >= 0) & (tokens >= 0) & (tokens < vocab)
    slot = jnp.where(keep, slots, rows)                                      # rows: dropped
    token = jnp.clip(tokens, 0, vocab - 1)
    counted = penalty_table.at[slot, token].add(1, mode="drop")
    seen = counted[jnp.minimum(slot, rows - 1), token] | SEEN
    return counted.at[slot, token].set(seen, mode="drop")


def record_tokens(penalty_table: jax.Array, slots: jax.Array, tokens: jax.Array) -> jax.Array:
    """Count one new output token per row (int32 [S]) in the row's slot (int32 [S], -1:
    none). Slots of one call are distinct, so no two rows write the same entry."""
    rows, vocab = penalty_table.shape
    keep = (slots >= 0) & (tokens >= 0) & (tokens < vocab)
    slot = jnp.where(keep, slots, rows)                                      # rows: dropped
    token = jnp.clip(tokens, 0, vocab - 1)
    old = penalty_table[jnp.minimum(slot, rows - 1), token]
    return penalty_table.at[slot, token].set((old | SEEN) + 1, mode="drop")


def fill_penalty_row(penalty_table: jax.Array, slot: jax.Array, token_ids: jax.Array,
                     values: jax.Array, reset: jax.Array) -> jax.Array:
    """Write ``values`` at ``token_ids`` (int32 [W], -1 = padding) into row ``slot``,
    zeroing the row first when ``reset``. One chunk of a ``PenaltyFill``."""
    vocab = penalty_table.shape[1]
    row = jnp.where(reset, 0, penalty_table[slot])                           # [V]
    row = row.at[jnp.where(token_ids < 0, vocab, token_ids)].set(values, mode="drop")
    return penalty_table.at[slot].set(row)


def add_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """logits float32 [S, V] with ``values[i, j]`` added at token ``ids[i, j]`` (ids float32
    [S, K], -1 for none; values float32 [S, K]). A scatter of S x K entries, no [S, V] pass:
    the empty slots add 0 to token 0."""
    token = ids.astype(jnp.int32)                                            # [S, K]
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], token.shape)
    return logits.at[rows, jnp.maximum(token, 0)].add(jnp.where(token >= 0, values, 0.0))


def adjusted_logits(logits: jax.Array, batch: StepBatch,
                    penalty_table: jax.Array | None = None,
                    features: StepFeatures | None = None) -> jax.Array:
    """logits float32 [S, V] with the grammar mask (when ``batch.token_mask`` is set), the
    logit biases (unless ``features`` leave them out), ``min_tokens``' suppressed stop ids
    and the penalties applied: what temperature and top-k/p / min-p filtering start from."""
    if batch.token_mask is not None:
        logits = apply_token_mask(logits, batch.token_mask)
    if features is None or features.bias:
        logits = add_logit_bias(logits, batch.bias_ids, batch.bias_values)
    if features is None or features.min_tokens:
        too_early = (batch.sample_index < batch.min_tokens)[:, None]
        logits = suppress_tokens(logits, jnp.where(too_early, batch.stop_token_ids, -1))
    if penalty_table is not None:
        logits = penalize(logits, penalty_table, batch, features)
    return logits


def sampling_probs(adjusted: jax.Array, batch: StepBatch,
                   features: StepFeatures | None = None) -> jax.Array:
    """float32 [S, V]: the distribution a sampled row (temperature > 0) draws from, after
    temperature and top-k / top-p / min-p (``adjusted`` from ``adjusted_logits``)."""
    filtered = _filtered_logits(adjusted, batch.temperature, batch.top_k,
                                batch.top_p, batch.min_p, features)
    return jax.nn.softmax(filtered, axis=-1)


def uniform_noise(seeds: jax.Array, index: jax.Array) -> jax.Array:
    """float32 [S] in (0, 1), a function of ``seeds[i]`` (uint32) and ``index[i]`` only,
    independent of ``gumbel_noise``'s draws for the same seed and index."""
    gumbel = gumbel_noise(seeds.astype(jnp.uint32) ^ jnp.uint32(0x5EC0A11D), index, 1)[:, 0]
    return jnp.exp(-jnp.exp(-gumbel))


def rejection_sample(target_probs: jax.Array, draft_probs: jax.Array, proposal: jax.Array,
                     seeds: jax.Array, index: jax.Array) -> jax.Array:
    """int32 [T]: the standard speculative rejection sampler, per token. ``proposal`` [T]
    was drawn from ``draft_probs`` [T, V]; it is kept with probability min(1, p/q), else
    replaced by a draw from the normalised (p - q)+ (``target_probs`` [T, V] = p). Either
    way the result is distributed as p. A kept proposal is the proposal itself; a
    replacement never is (the residual is zero there)."""
    p = jnp.take_along_axis(target_probs, proposal[:, None], axis=-1)[:, 0]      # [T]
    q = jnp.take_along_axis(draft_probs, proposal[:, None], axis=-1)[:, 0]
    keep = uniform_noise(seeds, index) * q < p
    residual = jnp.maximum(target_probs - draft_probs, 0.0)
    noise = gumbel_noise(seeds, index, target_probs.shape[-1])
    replacement = first_argmax(jnp.where(residual > 0, jnp.log(residual) + noise, -jnp.inf))
    return jnp.where(keep, proposal, replacement).astype(jnp.int32)


def sample(logits: jax.Array, batch: StepBatch,
           penalty_table: jax.Array | None = None,
           features: StepFeatures | None = None) -> jax.Array:
    """logits float32 [S, V] -> token ids int32 [S]. ``penalty_table``: see ``penalize``
    (None: no penalties). In a verify step (``jaxpage.runtime.step``) the rows are tokens
    (``step_batch.per_token``: ``proposal_ids`` and ``row_start`` set, see
    ``proposals_before``).

    The last step (greedy, or Gumbel-max after temperature, top-k / top-p and min-p) is
    ``pallas_kernels.sampling.sample_rows``: on the CPU a C++ kernel, one pass per row."""
    logits = adjusted_logits(logits, batch, penalty_table, features)
    temperature = batch.temperature
    threshold = _cut_threshold(logits, temperature, batch.top_k, batch.top_p, features)
    return sample_rows(logits, temperature, threshold, batch.min_p,
                       batch.sample_seeds, batch.sample_index,
                       stochastic=None if features is None else features.sampled)


def sampled_logprobs(logits: jax.Array, tokens: jax.Array, want: jax.Array, k: int,
                     features: StepFeatures | None = None
                     ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of the raw distribution (logits float32 [S, V]) for rows that want
    them (int32 [S]; all zeros when none does), in ``StepOutputs``' field order
    (``step_outputs.LOGPROB_FIELDS``):

    (top-``k`` ids int32 [S, k], top-``k`` logprobs float32 [S, k], logprob of ``tokens``
     float32 [S], its 1-based rank int32 [S]).
    """
    rows = logits.shape[0]

    def compute():
        logp = jax.nn.log_softmax(logits, axis=-1)                           # [S, V]
        chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
        rank = jnp.sum(logp > chosen[:, None], axis=-1).astype(jnp.int32) + 1
        values, ids = jax.lax.top_k(logp, k)
        return ids.astype(jnp.int32), values, chosen, rank

    def skip():
        return (jnp.zeros((rows, k), jnp.int32), jnp.zeros((rows, k), jnp.float32),
                jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.int32))

    if features is not None:
        return compute() if features.logprobs else skip()
    return jax.lax.cond(jnp.any(want > 0), compute, skip)
