"""BatchBuilder: a SchedulerOutput padded into a ``BatchMetadata``
(``jaxpage.core.batch.batch_metadata``, padding rules there) of the rungs of the bucket
ladders (``jaxpage.core.batch.bucket_ladder``).

Every array has a fixed, bucketed shape so the jitted step compiles a small set of
programs: ``T`` (tokens), ``S`` (sequences) and ``M`` (blocks per sequence) are each
rounded up to a rung of their ladder. A batch of decodes only (one token per sequence)
pads its tokens like its sequences (``T = S``, capped by the token ladder's rung): the
token ladder starts at 16, and on the CPU a decode of one sequence padded to 16 tokens
costs much more than at 1 (16x the matmul work for the same weights read), while the
long tail of a workload decodes a few sequences at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from jaxpage.core.batch.batch_metadata import ROW_INT_FIELDS, BatchMetadata
from jaxpage.core.batch.batch_rows import BatchRows
from jaxpage.core.batch.batch_shapes import BatchShapes
from jaxpage.core.batch.bucket_ladder import BucketLadder  # noqa: F401 (re-exported)
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.core.batch.penalty_slots import PenaltyFill, PenaltySlots
from jaxpage.core.request import MAX_STOP_TOKENS
from jaxpage.core.sched.schedule_output import SchedulerOutput
from jaxpage.sampling_params import MAX_LOGIT_BIAS

# Columns of the packed per-row ints that a continuing build touches.
_KV_LENS = ROW_INT_FIELDS.index("kv_lens")
_SAMPLE_INDEX = ROW_INT_FIELDS.index("sample_index")
_TABLES = len(ROW_INT_FIELDS) + MAX_STOP_TOKENS


@dataclass(frozen=True, slots=True)
class BuiltBatch:
    """What ``BatchBuilder.build`` returns: the padded batch, and what building it found.

    ``all_decodes``: every row is one token completing its request's known tokens (so
    each row emits a token), none is beam search, and none was built ahead of a
    multi-step call. The steady path of applying tokens (``StepApplier``) and of
    scheduling ahead (``AheadOfHost``) read it."""

    metadata: BatchMetadata
    all_decodes: bool


class BatchBuilder(BatchShapes):
    """Turns a SchedulerOutput into a padded BatchMetadata, of a shape ``BatchShapes``
    allows."""

    # Tests set this: every continuing build is checked against a build from the requests.
    check_fast_paths = False

    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, num_penalty_slots: int | None = None,
                 bucket_growth: int = 2, one_block_rung: bool = False,
                 additive: bool = False,
                 sync_requests: Callable[[], None] | None = None) -> None:
        """Ladders and shape rules: ``BatchShapes`` (``one_block_rung`` and ``additive``
        there). ``sync_requests`` (the scheduler's ``sync_tokens``) runs before a build
        reads the requests' own progress: steady decoding's newest tokens may wait in the
        scheduler's ``SteadyBatch`` until then."""
        self.kv = kv_cache_manager
        self.sync_requests = sync_requests
        self.block_size = kv_cache_manager.block_size
        max_blocks = kv_cache_manager.num_blocks_for(max_model_len)
        super().__init__(max_num_batched_tokens=max_num_batched_tokens,
                         max_num_seqs=max_num_seqs, max_blocks=max_blocks,
                         bucket_growth=bucket_growth, one_block_rung=one_block_rung,
                         additive=additive)
        self.penalty_slots = PenaltySlots(num_penalty_slots or max_num_seqs)
        self.rows = BatchRows(max_num_seqs, max_blocks)
        self._last: tuple[SchedulerOutput, BatchMetadata] | None = None  # the latest build
        self._last_continued = False  # the latest build was a continuing one
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
            bias_ids=np.full((S, MAX_LOGIT_BIAS), -1, np.float32),
            bias_values=np.zeros((S, MAX_LOGIT_BIAS), np.float32), **_no_penalties(S))

    def build(self, out: SchedulerOutput, ahead: int = 0) -> BuiltBatch:
        """Pad ``out`` into a batch.

        A row scheduled ahead of the host (``ScheduledRequest.ahead`` / ``sampled_ahead``,
        ``AheadOfHost.schedule_ahead``) starts that many tokens further than its request's
        state says; when its first token is still on the device, ``input_src`` names the
        previous call's row that sampled it. ``ahead > 0`` builds decodes that continue a
        multi-step call (``AheadOfHost.chain_multi_step``): every request is ``ahead``
        tokens further, and ``input_ids`` and ``slot_mapping`` are left to the device.

        The work per step is vectorized over rows: what a request keeps for its whole run
        (sampling settings, stop ids, its block table) lives in ``self.rows``, carried
        from the previous build for requests that stay and rewritten only for those that
        join or whose blocks changed.
        """
        last = self._last
        if not ahead and last is not None and out.continues is last[0]:
            built = self._build_continuing(out, last[1])
            if self.check_fast_paths:
                expected = self._build_rows(out, 0)
                _assert_same_batch(built.metadata, expected.metadata)
                assert built.all_decodes == expected.all_decodes
        else:
            built = self._build_rows(out, ahead)
            self._last_continued = False
        self._last = (out, built.metadata)
        return built

    def _build_rows(self, out: SchedulerOutput, ahead: int) -> BuiltBatch:
        """``build`` from each request's state."""
        if self.sync_requests is not None:
            self.sync_requests()
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
        all_decodes = bool(decodes_only and not ahead and emits.all()
                           and not rows.external[:n].any())
        return BuiltBatch(BatchMetadata(
            input_ids=input_ids, input_src=input_src, positions=positions,
            slot_mapping=slot_mapping, block_tables=rows.tables[:S, :M].copy(),
            kv_lens=kv_lens, cu_q_lens=cu_q_lens, num_seqs=np.array([n], np.int32),
            logits_indices=logits_indices, sample_index=sample_index, **rows.fields(S),
            **self._penalties(requests, S, emits, bool(ahead), rows.has_penalties[:n])),
            all_decodes)

    def _build_continuing(self, out: SchedulerOutput, last: BatchMetadata) -> BuiltBatch:
        """``build`` for ``out.continues`` built just before (``last``): row i is row i of
        ``last`` one token further, its input token the one row i samples on the device
        (all decodes, as ``last``: the same requests, each one token further).

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
            self._last_continued = False
            return self._build_rows(out, 0)
        if self._last_continued and out.ahead.positions is not None:
            batch = self._advance(out, last, rows, M)
        else:
            batch = self._continue(out, last, rows, M)
        self._last_continued = True
        return BuiltBatch(batch, True)

    def _advance(self, out: SchedulerOutput, last: BatchMetadata, rows: BatchRows,
                 M: int) -> BatchMetadata:
        """``_build_continuing`` after a continuing build: one addition per array moves
        every row one token on (position, slot, ``kv_lens``, ``sample_index``); only the
        rows whose token starts a block (the scheduler's ``positions``) and the tables that
        changed are then written. Few numpy calls, whatever the row count: after a long
        device step each call's code and data are cold
        (``docs/benchmarks/design_measurements.md``)."""
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
        starting = out.ahead.positions.starting_block()
        if starting:  # the first slot of the row's next block
            block = tokens[1, starting] // self.block_size
            tokens[2, starting] = ints[starting, _TABLES + block] * self.block_size
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
