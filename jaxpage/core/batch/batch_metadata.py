"""BatchMetadata, the one host-to-device contract: the numpy arrays of one model step,
and the three arrays they are packed into to cross to the device (``unpack_batch`` undoes
the packing, on the host or inside a compiled program).

Every array has a fixed, bucketed shape (``jaxpage.core.batch.builder.BatchBuilder`` pads it to
the rungs of the bucket ladders). Padding is explicit:

* padded tokens: ``input_ids = 0``, ``positions = 0``, ``slot_mapping = -1`` (not written);
* padded sequences: ``kv_lens = 0``, ``cu_q_lens`` repeats its last value, block table
  rows are 0 (the null block), ``logits_indices = 0``, greedy sampling;
* ``num_seqs[0]`` is the number of real sequences.

Penalties read the device's own table of seen tokens and output counts: a row names its
row of that table (``penalty_slot``, see ``jaxpage.core.batch.penalty_slots``), or -1 when it
has no penalties or its sampled token is thrown away (a prefill chunk before the last).
A penalized batch therefore has the same shapes as any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from jaxpage.core.request import MAX_STOP_TOKENS
from jaxpage.core.batch.step_features import StepFeatures
from jaxpage.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS

# Top log-probabilities the step returns per sequence when any sequence asks for them: as
# many as a request may ask for.
MAX_TOP_LOGPROBS = MAX_LOGPROBS


@dataclass(frozen=True)
class BatchMetadata:
    """Numpy arrays for one model step (see the module docstring for padding rules)."""

    input_ids: np.ndarray        # int32 [T]
    input_src: np.ndarray        # int32 [T]  -1, or the previous call's row that sampled it
    positions: np.ndarray        # int32 [T]
    slot_mapping: np.ndarray     # int32 [T]  flat slot block_id * block_size + offset, -1 = skip
    block_tables: np.ndarray     # int32 [S, M]
    kv_lens: np.ndarray          # int32 [S]  tokens in the cache per sequence, new ones included
    cu_q_lens: np.ndarray        # int32 [S + 1]  prefix sums of new-token counts
    num_seqs: np.ndarray         # int32 [1]
    logits_indices: np.ndarray   # int32 [S]  token whose logits sample sequence i
    temperature: np.ndarray      # float32 [S]  0 = greedy
    top_k: np.ndarray            # int32 [S]  <= 0 = disabled
    top_p: np.ndarray            # float32 [S]
    min_p: np.ndarray            # float32 [S]
    sample_seeds: np.ndarray     # uint32 [S]
    sample_index: np.ndarray     # int32 [S]  output tokens so far (keys the random stream)
    stop_token_ids: np.ndarray   # int32 [S, MAX_STOP_TOKENS]  EOS (unless ignored) + stop ids; -1 = none
    min_tokens: np.ndarray       # int32 [S]  stop tokens are masked while sample_index < this
    max_output: np.ndarray       # int32 [S]  the request's max_tokens (after context clipping)
    want_logprobs: np.ndarray    # int32 [S]  1 = return this row's top log-probabilities
    presence_penalty: np.ndarray   # float32 [S]  0 = off
    frequency_penalty: np.ndarray  # float32 [S]  0 = off
    repetition_penalty: np.ndarray  # float32 [S]  1 = off
    penalty_slot: np.ndarray     # int32 [S]  row of the device's penalty table, -1 = none
    lora_slot: np.ndarray        # int32 [S]  LoRA adapter slot 1..max_loras, 0 = base model
    # logit_bias: token ids as float32 (exact below 2**24) and the numbers added to their
    # logits; -1 / 0 where a row has fewer. Floats, so they ride in the packed floats,
    # which a continuing build shares instead of copying.
    bias_ids: np.ndarray         # float32 [S, MAX_LOGIT_BIAS]  -1 = none
    bias_values: np.ndarray      # float32 [S, MAX_LOGIT_BIAS]
    # ``packed()``'s arrays, once made (or given: ``from_packed``). Never modified.
    _packed: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(
        default=None, repr=False, compare=False)
    # ``step_features()``, once computed (kept by a continuing build, see ``replaced``).
    _features: StepFeatures | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_packed(cls, tokens: np.ndarray, rows: np.ndarray,
                    floats: np.ndarray) -> "BatchMetadata":
        """The batch whose ``packed()`` arrays these are; its fields are views of them."""
        values = unpack_batch(tokens, rows, floats)
        values["sample_seeds"] = values["sample_seeds"].view(np.uint32)
        return cls(**values, _packed=(tokens, rows, floats))

    def replaced(self, **changes) -> "BatchMetadata":
        """A copy with ``changes`` (fields, ``_packed``) and every other field shared.
        Skips ``__init__`` (``dataclasses.replace`` is slow on the hot path:
        ``docs/benchmarks/design_measurements.md``).

        Only for a batch that continues this one (the same rows, one token further): the
        copy keeps this batch's ``step_features()``, which the rows' sampling parameters
        decide. Their ``min_tokens`` feature may stay on after the rows passed it: the
        suppression is per row, so that changes nothing."""
        copy = object.__new__(BatchMetadata)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        return copy

    def step_features(self) -> StepFeatures:
        """``StepFeatures.of(self)``, computed once (a few reductions over [S] arrays that
        a steady decode would otherwise repeat every step; see ``replaced``)."""
        if self._features is None:
            object.__setattr__(self, "_features", StepFeatures.of(self))
        return self._features

    @property
    def shape_key(self) -> tuple[int, int, int]:
        """Which compiled program runs this batch: (T, S, M)."""
        return (self.input_ids.shape[0], self.block_tables.shape[0], self.block_tables.shape[1])

    def as_dict(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("_packed", "_features")}

    def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The batch as three arrays, what actually crosses to the device (one transfer
        each instead of one per field; ``unpack_batch`` undoes it inside the program):

        tokens int32 [4, T] (input_ids, positions, slot_mapping, input_src), rows int32
        [S, len(ROW_INT_FIELDS) + MAX_STOP_TOKENS + M] (per-row ints, stop ids, block
        table; ``cu_q_lens[1:]`` and ``num_seqs`` ride as columns) and floats float32
        [S, len(ROW_FLOAT_FIELDS) + 2 * MAX_LOGIT_BIAS] (per-row floats, logit-bias ids
        and values).
        """
        if self._packed is not None:
            return self._packed
        S = self.block_tables.shape[0]
        ints = [getattr(self, name) for name in ROW_INT_FIELDS[:-3]]
        ints += [self.sample_seeds.view(np.int32), self.cu_q_lens[1:],
                 np.broadcast_to(self.num_seqs, (S,))]
        rows = np.concatenate([np.stack(ints, axis=1), self.stop_token_ids, self.block_tables],
                              axis=1)
        tokens = np.stack([self.input_ids, self.positions, self.slot_mapping, self.input_src])
        floats = np.concatenate([np.stack([getattr(self, name) for name in ROW_FLOAT_FIELDS],
                                          axis=1), self.bias_ids, self.bias_values], axis=1)
        object.__setattr__(self, "_packed", (tokens, rows, floats))
        return self._packed


# Column order of ``BatchMetadata.packed``'s per-row arrays.
ROW_INT_FIELDS = ("kv_lens", "logits_indices", "top_k", "sample_index", "min_tokens",
                  "max_output", "want_logprobs", "penalty_slot", "lora_slot", "sample_seeds",
                  "cu_q_lens", "num_seqs")
ROW_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")


def unpack_batch(tokens, rows, floats) -> dict:
    """The fields of a batch from ``BatchMetadata.packed``'s arrays (numpy or traced jax
    arrays: only slicing, so it costs nothing inside a compiled program). ``sample_seeds``
    comes back as int32 bits (the sampler only uses them as a key)."""
    batch = {"input_ids": tokens[0], "positions": tokens[1], "slot_mapping": tokens[2],
             "input_src": tokens[3]}
    for column, name in enumerate(ROW_INT_FIELDS):
        batch[name] = rows[:, column]
    num_ints = len(ROW_INT_FIELDS)
    batch["cu_q_lens"] = _prepend_zero(batch["cu_q_lens"])
    batch["num_seqs"] = batch["num_seqs"][:1]
    batch["stop_token_ids"] = rows[:, num_ints:num_ints + MAX_STOP_TOKENS]
    batch["block_tables"] = rows[:, num_ints + MAX_STOP_TOKENS:]
    for column, name in enumerate(ROW_FLOAT_FIELDS):
        batch[name] = floats[:, column]
    num_floats = len(ROW_FLOAT_FIELDS)
    batch["bias_ids"] = floats[:, num_floats:num_floats + MAX_LOGIT_BIAS]
    batch["bias_values"] = floats[:, num_floats + MAX_LOGIT_BIAS:]
    return batch


def _prepend_zero(values):
    """[0, *values] for a numpy or a jax array (their shared array-API namespace: no jax
    import on this floor)."""
    xp = values.__array_namespace__()
    return xp.concatenate([xp.zeros(1, dtype=values.dtype), values])
