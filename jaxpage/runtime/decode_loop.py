"""Up to K decode iterations on the device in one call (``lax.while_loop``; on a GPU exactly
K, see ``make_decode_loop``).

Every iteration runs the model on one token per sequence, samples the next one, writes
its K/V through the block table (the host reserved blocks for all K tokens), and checks
stops on device: a stop token (EOS unless ignored, ``stop_token_ids``) once ``min_tokens``
are out, or ``max_tokens``. A finished row stops writing (slot -1) and reports -1 for
the rest of the window; the loop ends early once every row has finished. Stop strings are
the host's job: it drops tokens past a stop. The penalty table (``caches[1]``) counts
each iteration's token for rows with a penalty slot, so chained calls see every token
even before the host does, and the log-probabilities of every sampled token come back
when some row asked for them.

The batch must hold only decodes: token ``t`` belongs to sequence ``t`` for ``t < num_seqs``.

Chaining: a call can start where a previous call (still running, its tokens not yet on
the host) ended. Every call returns its carry, ``(last_tokens, done)`` padded to
``carry_rows`` rows; the next call takes it with ``row_map[i]``, the row of the previous
call that its row ``i`` continues (-1: start from the batch's own ``input_ids``, not done).
The host builds such a batch with positions already advanced by the previous call's K.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpage.core.batch.batch_metadata import MAX_TOP_LOGPROBS
from jaxpage.core.batch.step_features import StepFeatures
from jaxpage.runtime.sampler import record_tokens, sample, sampled_logprobs
from jaxpage.runtime.step import Caches, branch_free
from jaxpage.runtime.step_batch import Packed, unpack
from jaxpage.runtime.step_outputs import StepOutputs
from pallas_kernels._backend import branches_wait_for_device


def make_decode_loop(graphdef: Any, num_steps: int, block_size: int,
                     jit: Callable = jax.jit, features: StepFeatures | None = None,
                     fixed_length: bool | None = None) -> Callable:
    """Jitted ``loop(state, caches, packed, prev_tokens, prev_done, row_map)``
    (``packed``: ``BatchMetadata.packed()``).

    prev_tokens int32 [R], prev_done bool [R] (R = carry rows), row_map int32 [S].
    ``caches``: ``(kv_cache, penalty_table)`` as in ``step.make_step``.
    Returns ``(caches, outputs, (last_tokens int32 [R], done bool [R]))``: ``outputs`` a
    ``StepOutputs`` whose arrays carry a leading [num_steps] axis: tokens int32
    [num_steps, S] (-1 once a row stopped), no ``may_stop`` or ``emitted``, top_* [num_steps,
    S, MAX_TOP_LOGPROBS], token_* [num_steps, S], all zeros unless some row wants logprobs.

    ``features`` (``jaxpage.core.batch.step_features``): the sampler's optional work, decided
    by the host (None: by conditionals on the device; on a GPU all of it, ``branch_free``).
    ``fixed_length``: run all
    ``num_steps`` iterations, a loop of known length, instead of stopping once every row
    finished (XLA:GPU checks a while loop's predicate on the host every iteration); the
    iterations after that write nothing and return -1, as if the loop had stopped. None:
    on the platform being built for when branches wait for the device (a GPU), where the
    loop is of known length whatever ``fixed_length`` says.
    """
    if fixed_length is None:
        fixed_length = branches_wait_for_device()

    def loop(state: Any, caches: Caches, packed: Packed,
             prev_tokens: jax.Array, prev_done: jax.Array, row_map: jax.Array):
        batch = unpack(packed)
        kv_cache, penalty_table = caches
        model = nnx.merge(graphdef, state)
        traced = branch_free(features)
        num_tokens = batch.input_ids.shape[0]
        num_rows = batch.kv_lens.shape[0]
        carry_rows = prev_tokens.shape[0]
        token_row = jnp.minimum(jnp.arange(num_tokens), num_rows - 1)      # [T]
        real = jnp.arange(num_tokens) < batch.num_seqs[0]                   # [T]
        stop_ids = batch.stop_token_ids                                      # [S, K_stop]
        chained = row_map >= 0                                               # [S]
        source = jnp.clip(row_map, 0, carry_rows - 1)                        # [S]
        ids = jnp.where(chained[token_row], prev_tokens[source][token_row],
                        batch.input_ids)                                     # [T]
        done = (jnp.arange(num_rows) >= batch.num_seqs[0]) | (chained & prev_done[source])

        def cond(carry):
            i, *_, done, _, _ = carry
            return (i < num_steps) & ~jnp.all(done)

        def body(carry):
            i, kv, ids, positions, kv_lens, done, penalties, out = carry
            live = real & ~done[token_row]
            table = batch.block_tables[token_row, positions // block_size]
            slots = jnp.where(live, table * block_size + positions % block_size, -1)
            # From the last live token (row) on, all are padding or finished: the
            # projections skip them (rows are packed, so this is the batch's live prefix)
            live_tokens = jnp.max(jnp.where(live, jnp.arange(num_tokens) + 1, 0))
            live_rows = jnp.max(jnp.where(done, 0, jnp.arange(num_rows) + 1))
            step_batch = replace(batch, input_ids=ids, positions=positions, slot_mapping=slots,
                                 kv_lens=kv_lens, live_tokens=live_tokens.astype(jnp.int32))
            hidden, kv = model(ids, positions, kv, step_batch)
            logits = model.compute_logits(hidden[batch.logits_indices],  # [S, V]
                                          live_rows.astype(jnp.int32))
            index = batch.sample_index + i
            new = sample(logits, replace(step_batch, sample_index=index), penalties,  # [S]
                         traced)
            penalties = record_tokens(penalties, jnp.where(done, -1, batch.penalty_slot), new)
            logprobs = sampled_logprobs(logits, new, batch.want_logprobs, MAX_TOP_LOGPROBS,
                                        traced)
            num_out = index + 1
            is_stop = jnp.any((new[:, None] == stop_ids) & (stop_ids >= 0), axis=-1)
            finishes = (is_stop & (num_out >= batch.min_tokens)) | (num_out >= batch.max_output)
            out = StepOutputs(out.sampled.at[0, i].set(jnp.where(done, -1, new)),
                              *(o.at[i].set(v) for o, v in zip(out.logprobs, logprobs)))
            ids = jnp.where(real & ~done[token_row], new[token_row], ids)
            done = done | finishes
            return i + 1, kv, ids, positions + 1, kv_lens + 1, done, penalties, out

        K, S, N = num_steps, num_rows, MAX_TOP_LOGPROBS
        out = StepOutputs(jnp.full((1, K, S), -1, jnp.int32),
                          jnp.zeros((K, S, N), jnp.int32), jnp.zeros((K, S, N), jnp.float32),
                          jnp.zeros((K, S), jnp.float32), jnp.zeros((K, S), jnp.int32))
        carry = (0, kv_cache, ids, batch.positions, batch.kv_lens, done, penalty_table, out)
        if fixed_length or branches_wait_for_device():  # never a loop the host waits on
            carry = jax.lax.fori_loop(0, num_steps, lambda _, c: body(c), carry)
        else:
            carry = jax.lax.while_loop(cond, body, carry)
        _, kv_cache, ids, _, _, done, penalty_table, out = carry
        rows = min(num_rows, carry_rows)
        row_token = jnp.minimum(jnp.arange(num_rows), num_tokens - 1)       # [S]
        last = jnp.zeros(carry_rows, jnp.int32).at[:rows].set(ids[row_token][:rows])
        done_out = jnp.ones(carry_rows, bool).at[:rows].set(done[:rows])
        return (kv_cache, penalty_table), out, (last, done_out)

    return jit(loop, donate_argnums=(1,))  # jit: a Placement.jit under tensor parallelism
