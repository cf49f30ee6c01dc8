"""The batch inside a compiled program: ``StepBatch``, one field per array of
``core.batch.batch_metadata.BatchMetadata``, made from its packed arrays by ``unpack`` (free
slicing), and ``ForwardBatch``, the few arrays the model's forward pass reads.

Both are frozen dataclasses registered as JAX pytrees: they cross ``jit``, ``cond`` and
loop boundaries like any tuple of arrays, and ``dataclasses.replace`` makes the variants a
program needs (a decode iteration's positions, a verify step's per-token view).

Invariants:

* Shapes are the bucket's: T tokens, S rows, M block-table columns (padding as
  ``BatchMetadata`` describes it). In a verify step's per-token view (``per_token``)
  the sampling fields (``SAMPLING_FIELDS``) are gathered per token, [T] where the
  comment says [S], and ``row_start`` / ``proposal_ids`` are set; every other field is
  the batch's own.
* An optional field (default None) is a feature the program has, decided when it is
  traced: code asks ``is not None``, never whether a key exists. ``token_mask``: a
  grammar-masked step; ``live_tokens``: projections may skip the tokens from it on;
  ``row_start`` and ``proposal_ids``: a verify step's per-token view.
* ``sample_seeds`` is uint32 (``unpack`` restores it from the packed int32 bits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxpage.core.batch.batch_metadata import unpack_batch

Packed = tuple[jax.Array, jax.Array, jax.Array]  # BatchMetadata.packed() on the device


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepBatch:
    """One step's batch inside a program (see the module docstring)."""

    input_ids: jax.Array          # int32 [T]
    input_src: jax.Array          # int32 [T]  -1, or the previous call's row that sampled it
    positions: jax.Array          # int32 [T]
    slot_mapping: jax.Array       # int32 [T]  flat cache slot, -1 = not written
    block_tables: jax.Array       # int32 [S, M]
    kv_lens: jax.Array            # int32 [S]  tokens in the cache, new ones included
    cu_q_lens: jax.Array          # int32 [S + 1]  prefix sums of new-token counts
    num_seqs: jax.Array           # int32 [1]  real rows
    logits_indices: jax.Array     # int32 [S]  the token whose logits sample row i
    temperature: jax.Array        # float32 [S]  0 = greedy
    top_k: jax.Array              # int32 [S]  <= 0 = off
    top_p: jax.Array              # float32 [S]
    min_p: jax.Array              # float32 [S]
    sample_seeds: jax.Array       # uint32 [S]
    sample_index: jax.Array       # int32 [S]  output tokens so far (keys the random stream)
    stop_token_ids: jax.Array     # int32 [S, MAX_STOP_TOKENS]  -1 = none
    min_tokens: jax.Array         # int32 [S]
    max_output: jax.Array         # int32 [S]
    want_logprobs: jax.Array      # int32 [S]  1 = the row wants log-probabilities
    presence_penalty: jax.Array   # float32 [S]
    frequency_penalty: jax.Array  # float32 [S]
    repetition_penalty: jax.Array  # float32 [S]
    penalty_slot: jax.Array       # int32 [S]  row of the penalty table, -1 = none
    lora_slot: jax.Array          # int32 [S]  LoRA slot, 0 = the base model
    bias_ids: jax.Array           # float32 [S, MAX_LOGIT_BIAS]  token ids, -1 = none
    bias_values: jax.Array        # float32 [S, MAX_LOGIT_BIAS]
    token_mask: jax.Array | None = None    # int32 [S, ceil(V / 32)]  packed grammar masks
    live_tokens: jax.Array | None = None   # int32 []  tokens from here on are padding
    row_start: jax.Array | None = None     # int32 [T]  verify: the token's row's first token
    proposal_ids: jax.Array | None = None  # int32 [T]  verify: the token if a proposal, else -1

    @classmethod
    def of_rows(cls, **fields: Any) -> "StepBatch":
        """A batch of ``S`` rows (the length of the first field given) asking nothing of
        any row (greedy, no filter, stop id, penalty, bias or log-probabilities; one
        token per row, no cache), with ``fields`` (arrays) in place of those values: for
        checking the sampler on its own."""
        S = len(next(iter(fields.values())))
        zeros = jnp.zeros(S, jnp.int32)
        values = dict(
            input_ids=zeros, input_src=jnp.full(S, -1, jnp.int32), positions=zeros,
            slot_mapping=jnp.full(S, -1, jnp.int32), block_tables=jnp.zeros((S, 1), jnp.int32),
            kv_lens=zeros, cu_q_lens=jnp.zeros(S + 1, jnp.int32),
            num_seqs=jnp.asarray([S], jnp.int32), logits_indices=jnp.arange(S, dtype=jnp.int32),
            temperature=jnp.zeros(S, jnp.float32), top_k=zeros,
            top_p=jnp.ones(S, jnp.float32), min_p=jnp.zeros(S, jnp.float32),
            sample_seeds=jnp.zeros(S, jnp.uint32), sample_index=zeros,
            stop_token_ids=jnp.full((S, 1), -1, jnp.int32), min_tokens=zeros,
            max_output=zeros, want_logprobs=zeros, presence_penalty=jnp.zeros(S, jnp.float32),
            frequency_penalty=jnp.zeros(S, jnp.float32),
            repetition_penalty=jnp.ones(S, jnp.float32), penalty_slot=jnp.full(S, -1, jnp.int32),
            lora_slot=zeros, bias_ids=jnp.full((S, 1), -1, jnp.float32),
            bias_values=jnp.zeros((S, 1), jnp.float32))
        values.update({name: jnp.asarray(value) for name, value in fields.items()})
        return cls(**values)


# The per-row fields the sampler and ``step.may_stop`` read: a verify step gathers them
# per token (``per_token``).
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "sample_seeds", "sample_index",
                   "min_tokens", "stop_token_ids", "max_output", "want_logprobs",
                   "penalty_slot", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "bias_ids", "bias_values")


def unpack(packed: Packed) -> StepBatch:
    """The batch inside a program, from ``BatchMetadata.packed`` (free slicing); the
    seeds get their uint32 type back."""
    fields = unpack_batch(*packed)
    fields["sample_seeds"] = jax.lax.bitcast_convert_type(fields["sample_seeds"], jnp.uint32)
    return StepBatch(**fields)


def per_token(batch: StepBatch, token_row: jax.Array, row_start: jax.Array,
              proposal_ids: jax.Array) -> StepBatch:
    """A verify step's per-token view: each sampling field gathered at its token's row
    (``token_row`` int32 [T]), with the verify fields ``row_start`` and ``proposal_ids``
    (int32 [T]) set."""
    gathered = {name: getattr(batch, name)[token_row] for name in SAMPLING_FIELDS}
    return dataclasses.replace(batch, **gathered, row_start=row_start,
                               proposal_ids=proposal_ids)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ForwardBatch:
    """What the model's forward pass reads of a batch (``models.llama``), for programs
    that run the model without sampling (a draft model's): a ``StepBatch`` has the same
    fields."""

    slot_mapping: jax.Array        # int32 [T]  flat cache slot, -1 = not written
    kv_lens: jax.Array             # int32 [S]
    block_tables: jax.Array        # int32 [S, M]
    cu_q_lens: jax.Array           # int32 [S + 1]
    num_seqs: jax.Array            # int32 [1]
    lora_slot: jax.Array | None = None    # int32 [S]  read only by a model with LoRA slots
    live_tokens: jax.Array | None = None  # int32 []  tokens from here on are padding
