"""BatchMetadata, the one host-to-device contract, and BatchBuilder, which pads it to
the rungs of the bucket ladders (``jaxpage.core.bucket_ladder``).

Every array has a fixed, bucketed shape so the jitted step compiles a small set of
programs: ``T`` (tokens), ``S`` (sequences) and ``M`` (blocks per sequence) are each
rounded up to a rung of their ladder. A batch of decodes only (one token per sequence)
pads its tokens like its sequences (``T = S``, capped by the token ladder's rung): the
token ladder starts at 16, and on the CPU a decode of one sequence padded to 16 tokens
costs much more than at 1 (16x the matmul work for the same weights read), while the
long tail of a workload decodes a few sequences at a time. Padding is explicit:

* padded tokens: ``input_ids = 0``, ``positions = 0``, ``slot_mapping = -1`` (not written);
* padded sequences: ``kv_lens = 0``, ``cu_q_lens`` repeats its last value, block table
  rows are 0 (the null block), ``logits_indices = 0``, greedy sampling;
* ``num_seqs[0]`` is the number of real sequences.

Penalties read the device's own table of seen tokens and output counts: a row names its
row of that table (``penalty_slot``, see ``jaxpage.core.penalty_slots``), or -1 when it
has no penalties or its sampled token is thrown away (a prefill chunk before the last).
A penalized batch therefore has the same shapes as any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from jaxpage.core.batch_rows import BatchRows
from jaxpage.core.batch_shapes import BatchShapes
from jaxpage.core.bucket_ladder import BucketLadder  # noqa: F401 (re-exported)
from jaxpage.core.kv_cache_manager import KVCacheManager
from jaxpage.core.penalty_slots import PenaltyFill, PenaltySlots
from jaxpage.core.request import MAX_STOP_TOKENS
from jaxpage.core.scheduler import SchedulerOutput
from jaxpage.sampling_params import MAX_LOGPROBS

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
    # ``packed()``'s arrays, once made (or given: ``from_packed``). Never modified.
    _packed: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(
        default=None, repr=False, compare=False)

    @classmethod
    def from_packed(cls, tokens: np.ndarray, rows: np.ndarray,
                    floats: np.ndarray) -> "BatchMetadata":
        """The batch whose ``packed()`` arrays these are; its fields are views of them."""
        values = unpack_batch(tokens, rows, floats)
        values["sample_seeds"] = values["sample_seeds"].view(np.uint32)
        return cls(**values, _packed=(tokens, rows, floats))

    def replaced(self, **changes) -> "BatchMetadata":
        """A copy with ``changes`` (fields, ``_packed``) and every other field shared.
        Skips ``__init__``: on the hot path ``dataclasses.replace`` costs ~20 us."""
        copy = object.__new__(BatchMetadata)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        return copy

    @property
    def shape_key(self) -> tuple[int, int, int]:
        """Which compiled program runs this batch: (T, S, M)."""
        return (self.input_ids.shape[0], self.block_tables.shape[0], self.block_tables.shape[1])

    def as_dict(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_packed"}

    def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The batch as three arrays, what actually crosses to the device (one transfer
        each instead of one per field; ``unpack_batch`` undoes it inside the program):

        tokens int32 [4, T] (input_ids, positions, slot_mapping, input_src), rows int32
        [S, len(ROW_INT_FIELDS) + MAX_STOP_TOKENS + M] (per-row ints, stop ids, block
        table; ``cu_q_lens[1:]`` and ``num_seqs`` ride as columns) and floats float32
        [S, len(ROW_FLOAT_FIELDS)].
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
        floats = np.stack([getattr(self, name) for name in ROW_FLOAT_FIELDS], axis=1)
        object.__setattr__(self, "_packed", (tokens, rows, floats))
        return self._packed


# Column order of ``BatchMetadata.packed``'s per-row arrays.
ROW_INT_FIELDS = ("kv_lens", "logits_indices", "top_k", "sample_index", "min_tokens",
                  "max_output", "want_logprobs", "penalty_slot", "lora_slot", "sample_seeds",
                  "cu_q_lens", "num_seqs")
ROW_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")


# Columns of the packed per-row ints that a continuing build touches.
_KV_LENS = ROW_INT_FIELDS.index("kv_lens")
_SAMPLE_INDEX = ROW_INT_FIELDS.index("sample_index")
_TABLES = len(ROW_INT_FIELDS) + MAX_STOP_TOKENS


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
    return batch


def _prepend_zero(values):
    """[0, *values] for a numpy or a jax array (their shared array-API namespace: no jax
    import on this floor)."""
    xp = values.__array_namespace__()
    return xp.concatenate([xp.zeros(1, dtype=values.dtype), values])


class BatchBuilder(BatchShapes):
    """Turns a SchedulerOutput into a padded BatchMetadata, of a shape ``BatchShapes``
    allows."""

    # Tests set this: every continuing build is checked against a build from the requests.
    check_fast_paths = False

    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, num_penalty_slots: int | None = None,
                 bucket_growth: int = 2, one_block_rung: bool = False) -> None:
        """Ladders and shape rules: ``BatchShapes`` (``one_block_rung`` there)."""
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        max_blocks = kv_cache_manager.num_blocks_for(max_model_len)
        super().__init__(max_num_batched_tokens=max_num_batched_tokens,
                         max_num_seqs=max_num_seqs, max_blocks=max_blocks,
                         bucket_growth=bucket_growth, one_block_rung=one_block_rung)
        self.penalty_slots = PenaltySlots(num_penalty_slots or max_num_seqs)
        self.rows = BatchRows(max_num_seqs, max_blocks)
        self._last: tuple[SchedulerOutput, BatchMetadata] | None = None  # the latest build
        self._continued: BatchMetadata | None = None  # the latest continuing build
        # ``_advance``'s increments: ((rows, tokens' shape, ints' shape), [4, T], [S, C])
        self._advance_steps: tuple | None = None


    def empty(self, T: int, S: int, M: int) -> BatchMetadata:
        """A batch of the given shape holding no sequence (for compiling ahead of time)."""
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        return BatchMetadata(
            input_ids=zeros(T), input_src=np.full(T, -1, np.int32), positions=zeros(T),
            slot_mapping=np.full(T, -1, np.int32),
            block_tables=zeros(S, M), kv_lens=zeros(S), cu_q_lens=zeros(S + 1),
            num_seqs=zeros(1), logits_indices=zeros(S), temperature=np.zeros(S, np.float32),
            top_k=zeros(S), top_p=np.ones(S, np.float32), min_p=np.zeros(S, np.float32),
            sample_seeds=np.zeros(S, np.uint32), sample_index=zeros(S),
            stop_token_ids=np.full((S, MAX_STOP_TOKENS), -1, np.int32), min_tokens=zeros(S),
            max_output=zeros(S), want_logprobs=zeros(S), lora_slot=zeros(S),
            **_no_penalties(S))

    def build(self, out: SchedulerOutput, ahead: int = 0) -> BatchMetadata:
        """Pad ``out`` into a batch.

        A row scheduled ahead of the host (``ScheduledRequest.ahead`` / ``sampled_ahead``,
        ``Scheduler.schedule_ahead``) starts that many tokens further than its request's
        state says; when its first token is still on the device, ``input_src`` names the
        previous call's row that sampled it. ``ahead > 0`` builds decodes that continue a
        multi-step call (``Scheduler.chain_multi_step``): every request is ``ahead``
        tokens further, and ``input_ids`` and ``slot_mapping`` are left to the device.

        The work per step is vectorized over rows: what a request keeps for its whole run
        (sampling settings, stop ids, its block table) lives in ``self.rows``, carried
        from the previous build for requests that stay and rewritten only for those that
        join or whose blocks changed.
        """
        last = self._last
        if not ahead and last is not None and out.continues is last[0]:
            batch = self._build_continuing(out, last[1])
            if self.check_fast_paths:
                _assert_same_batch(batch, self._build_rows(out, 0))
        else:
            batch = self._build_rows(out, ahead)
        self._last = (out, batch)
        return batch

    def _build_rows(self, out: SchedulerOutput, ahead: int) -> BatchMetadata:
        """``build`` from each request's state."""
        items = out.scheduled
        n = len(items)
        if ahead and out.num_batched_tokens != n:
            raise ValueError("only decodes can be built ahead of the host")
        requests = out.requests
        rows = self.rows.update(requests, self.kv)
        num_new = np.fromiter((item.num_new_tokens for item in items), np.int32, n)   # [n]
        computed = np.fromiter((r.num_computed_tokens for r in requests), np.int32, n)  # [n]
        known = np.fromiter((len(r.all_token_ids) for r in requests), np.int32, n)      # [n]
        sampled = np.fromiter((r.num_output_tokens for r in requests), np.int32, n)  # [n]
        source = None
        if ahead:
            computed += ahead
            sampled += ahead
            known += ahead
        elif any(item.ahead for item in items):
            source = np.fromiter((item.source_row for item in items), np.int32, n)     # [n]
            sampled_ahead = np.fromiter((item.sampled_ahead for item in items), np.int32, n)
            computed += np.fromiter((item.ahead for item in items), np.int32, n)
            sampled += sampled_ahead
            known += sampled_ahead
        num_tokens = int(num_new.sum())
        decodes_only = num_tokens == n
        if out.num_draft_tokens:
            T = self.verify_ladder.fit(num_tokens)
        else:
            T = self.decode_tokens(n) if decodes_only else self.token_ladder.fit(num_tokens)
        S = self.seq_ladder.fit(n) if out.num_draft_tokens else self.seats(T, n, decodes_only)
        M = self.block_ladder.fit(int(rows.table_len[:n].max()))
        bs = self.block_size

        cu_q_lens = np.full(S + 1, num_tokens, np.int32)
        cu_q_lens[0] = 0
        np.cumsum(num_new, out=cu_q_lens[1:n + 1])
        if decodes_only:
            token_pos = computed                                             # [n]
            token_row = np.arange(n)
        else:
            token_row = np.repeat(np.arange(n, dtype=np.int32), num_new)     # [tokens]
            token_pos = (np.arange(num_tokens, dtype=np.int32)
                         + np.repeat(computed - cu_q_lens[:n], num_new))
        positions = np.zeros(T, np.int32)
        positions[:num_tokens] = token_pos
        input_ids = np.zeros(T, np.int32)
        input_src = np.full(T, -1, np.int32)
        slot_mapping = np.full(T, -1, np.int32)
        if not ahead:
            # ahead: the decode loop derives its slots from positions, and a row that ends
            # in the previous call may have no block reserved at ``first``.
            slot_mapping[:num_tokens] = (rows.tables[token_row, token_pos // bs] * bs
                                         + token_pos % bs)
            if source is not None:
                input_src[cu_q_lens[:n]] = source  # a row's first token: -1 or on the device
            host = (np.arange(n) if source is None else np.flatnonzero(source < 0)).tolist()
            if decodes_only and source is None:
                input_ids[:n] = np.fromiter(
                    (r.all_token_ids[r.num_computed_tokens] for r in requests), np.int32, n)
            else:
                for i in host:
                    first, start = int(computed[i]), int(cu_q_lens[i])
                    drafts = items[i].draft_token_ids
                    count = int(num_new[i]) - len(drafts)
                    input_ids[start:start + count] = requests[i].all_token_ids[first:first + count]
                    if drafts:  # speculative proposals after the row's last token
                        input_ids[start + count:start + count + len(drafts)] = drafts
        kv_lens = np.zeros(S, np.int32)
        kv_lens[:n] = computed + num_new
        logits_indices = np.zeros(S, np.int32)
        logits_indices[:n] = cu_q_lens[1:n + 1] - 1
        sample_index = np.zeros(S, np.int32)
        sample_index[:n] = sampled
        emits = computed + num_new >= known  # the row's sampled token is kept (not a chunk)
        out.all_decodes = bool(decodes_only and not ahead and emits.all()
                               and not rows.external[:n].any())
        return BatchMetadata(
            input_ids=input_ids, input_src=input_src, positions=positions,
            slot_mapping=slot_mapping, block_tables=rows.tables[:S, :M].copy(),
            kv_lens=kv_lens, cu_q_lens=cu_q_lens, num_seqs=np.array([n], np.int32),
            logits_indices=logits_indices, sample_index=sample_index, **rows.fields(S),
            **self._penalties(requests, S, emits, bool(ahead), rows.has_penalties[:n]))

    def _build_continuing(self, out: SchedulerOutput, last: BatchMetadata) -> BatchMetadata:
        """``build`` for ``out.continues`` built just before (``last``): row i is row i of
        ``last`` one token further, its input token the one row i samples on the device.

        Made from ``last``'s packed arrays: the per-row ints are copied and two columns
        advanced, block tables rewritten only where they changed, the floats shared
        (nothing in them changes). Nothing is read from the requests. A change of the
        block-table bucket or a penalized row takes the row by row build instead; a
        continuing build right after another takes ``_advance``.
        """
        requests = out.requests
        n = len(requests)
        rows = self.rows.update(requests, self.kv)
        tokens, ints, floats = last.packed()
        M = last.block_tables.shape[1]
        if rows.longest_table > M or rows.reordered or rows.any_penalties:
            return self._build_rows(out, 0)
        if last is self._continued and out.positions is not None:
            batch = self._advance(out, last, rows, M)
        else:
            batch = self._continue(out, last, rows, M)
        self._continued = batch
        return batch

    def _advance(self, out: SchedulerOutput, last: BatchMetadata, rows: BatchRows,
                 M: int) -> BatchMetadata:
        """``_build_continuing`` after a continuing build: one addition per array moves
        every row one token on (position, slot, ``kv_lens``, ``sample_index``); only the
        rows whose token starts a block (the scheduler's ``positions``) and the tables that
        changed are then written. Few numpy calls, whatever the row count: after a long
        device step each call's code and data are cold (~5-10 us a call at 1,024 rows)."""
        tokens, ints, floats = last.packed()
        n = len(out.scheduled)
        key = (n, tokens.shape, ints.shape)
        if self._advance_steps is None or self._advance_steps[0] != key:
            step_tokens = np.zeros(tokens.shape, np.int32)                    # [4, T]
            step_tokens[1:3, :n] = 1  # positions, slot_mapping
            step_ints = np.zeros(ints.shape, np.int32)                        # [S, C]
            step_ints[:n, _KV_LENS] = 1
            step_ints[:n, _SAMPLE_INDEX] = 1
            self._advance_steps = (key, step_tokens, step_ints)
        tokens = tokens + self._advance_steps[1]
        ints = ints + self._advance_steps[2]
        if rows.rewritten:
            ints[rows.rewritten, _TABLES:] = rows.tables[rows.rewritten, :M]
        starting = out.positions.starting_block()
        if starting:  # the first slot of the row's next block
            block = tokens[1, starting] // self.block_size
            tokens[2, starting] = ints[starting, _TABLES + block] * self.block_size
        out.all_decodes = True
        return last.replaced(
            _packed=(tokens, ints, floats), input_ids=tokens[0], positions=tokens[1],
            slot_mapping=tokens[2], input_src=tokens[3], kv_lens=ints[:, _KV_LENS],
            sample_index=ints[:, _SAMPLE_INDEX], block_tables=ints[:, _TABLES:])

    def _continue(self, out: SchedulerOutput, last: BatchMetadata, rows: BatchRows,
                  M: int) -> BatchMetadata:
        """``_build_continuing`` from a batch built row by row."""
        tokens, ints, floats = last.packed()
        n = len(out.scheduled)
        first = np.arange(n, dtype=np.int32)                                  # [n]
        ints = ints.copy()                                                    # [S, C]
        position = ints[:n, _KV_LENS].copy()  # the new token: right after the last  [n]
        ints[:n, _KV_LENS] += 1
        ints[:n, _SAMPLE_INDEX] += 1
        if rows.rewritten:
            ints[rows.rewritten, _TABLES:] = rows.tables[rows.rewritten, :M]
        tokens = tokens.copy()  # [4, T]: padding as in ``last``; input ids from the device
        tokens[0, :n] = 0
        tokens[1, :n] = position
        tokens[2, :n] = (ints[first, _TABLES + position // self.block_size] * self.block_size
                         + position % self.block_size)
        tokens[3, :n] = first
        out.all_decodes = True  # as ``last``: the same requests, each one token further
        # The fields that changed are views of the new arrays; the others are ``last``'s.
        return last.replaced(
            _packed=(tokens, ints, floats), input_ids=tokens[0], positions=tokens[1],
            slot_mapping=tokens[2], input_src=tokens[3], kv_lens=ints[:, _KV_LENS],
            sample_index=ints[:, _SAMPLE_INDEX], block_tables=ints[:, _TABLES:])

    def _penalties(self, requests: list, S: int, emits: np.ndarray, chained: bool,
                   penalized: np.ndarray) -> dict[str, np.ndarray]:
        """The penalty fields of a batch. A row gets a penalty slot when its request has
        penalties and this step's sampled token is kept (``emits``: the last prefill
        chunk, a decode). ``chained``: a multi-step call behind another, which may not
        fill slots (see ``penalty_slots``)."""
        fields_ = _no_penalties(S)
        rows = np.flatnonzero(penalized & emits).tolist()
        if not rows:
            return fields_
        owners = [None] * len(requests)
        for i in rows:
            params = requests[i].sampling_params
            owners[i] = requests[i]
            fields_["presence_penalty"][i] = params.presence_penalty
            fields_["frequency_penalty"][i] = params.frequency_penalty
            fields_["repetition_penalty"][i] = params.repetition_penalty
        fields_["penalty_slot"][:len(requests)] = self.penalty_slots.assign(owners, ahead=chained)
        return fields_

    def take_penalty_fills(self) -> list[PenaltyFill]:
        """Rows of the device's penalty table to fill before the batch just built runs."""
        return self.penalty_slots.take_fills()


def _assert_same_batch(got: BatchMetadata, expected: BatchMetadata) -> None:
    for name, value in expected.as_dict().items():
        if name == "input_ids":  # rows reading their token on the device: any value
            value = np.where(expected.input_src >= 0, 0, value)
        if not np.array_equal(getattr(got, name), value):
            raise AssertionError(f"continuing build differs in {name}: "
                                 f"{getattr(got, name)} != {value}")


def _no_penalties(S: int) -> dict[str, np.ndarray]:
    return {"presence_penalty": np.zeros(S, np.float32),
            "frequency_penalty": np.zeros(S, np.float32),
            "repetition_penalty": np.ones(S, np.float32),
            "penalty_slot": np.full(S, -1, np.int32)}
