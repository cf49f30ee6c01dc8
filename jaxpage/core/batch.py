"""BatchMetadata, the one host-to-device contract, and the bucket ladders that pad it.

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

import bisect
from dataclasses import dataclass, fields

import numpy as np

from jaxpage.core.kv_cache_manager import KVCacheManager
from jaxpage.core.penalty_slots import PenaltyFill, PenaltySlots
from jaxpage.core.scheduler import SchedulerOutput
from jaxpage.sampling_params import MAX_LOGPROBS

# Width of the per-sequence list of stop token ids the device knows (EOS and stop_token_ids):
# masked until min_tokens are out, and checked on device by the multi-step decode loop.
MAX_STOP_TOKENS = 16
# Top log-probabilities the step returns per sequence when any sequence asks for them: as
# many as a request may ask for.
MAX_TOP_LOGPROBS = MAX_LOGPROBS


class BucketLadder:
    """Powers of ``growth`` from ``minimum`` up to ``maximum`` (always the top rung).

    The first rung is ``minimum`` itself when it is not a power of ``growth``.
    """

    def __init__(self, minimum: int, maximum: int, growth: int = 2) -> None:
        if minimum < 1 or maximum < 1:
            raise ValueError(f"bucket bounds must be >= 1, got {minimum}..{maximum}")
        if growth < 2:
            raise ValueError(f"bucket growth must be >= 2, got {growth}")
        rungs = []
        size = 1
        while size < minimum:
            size *= growth
        if size > minimum and minimum < maximum:
            rungs.append(minimum)
        while size < maximum:
            rungs.append(size)
            size *= growth
        rungs.append(maximum)
        self.rungs = tuple(rungs)

    def fit(self, size: int) -> int:
        """Smallest rung >= size."""
        i = bisect.bisect_left(self.rungs, size)
        if i == len(self.rungs):
            raise ValueError(f"size {size} exceeds the largest bucket {self.rungs[-1]}")
        return self.rungs[i]


@dataclass(frozen=True)
class BatchMetadata:
    """Numpy arrays for one model step (see the module docstring for padding rules)."""

    input_ids: np.ndarray        # int32 [T]
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

    @property
    def shape_key(self) -> tuple[int, int, int]:
        """Which compiled program runs this batch: (T, S, M)."""
        return (self.input_ids.shape[0], self.block_tables.shape[0], self.block_tables.shape[1])

    def as_dict(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class BatchBuilder:
    """Turns a SchedulerOutput into a padded BatchMetadata."""

    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, num_penalty_slots: int | None = None,
                 bucket_growth: int = 2) -> None:
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.token_ladder = BucketLadder(min(16, max_num_batched_tokens), max_num_batched_tokens,
                                         bucket_growth)
        self.seq_ladder = BucketLadder(1, max_num_seqs, bucket_growth)
        max_blocks = kv_cache_manager.num_blocks_for(max_model_len)
        self.block_ladder = BucketLadder(min(8, max_blocks), max_blocks, bucket_growth)
        self.penalty_slots = PenaltySlots(num_penalty_slots or max_num_seqs)

    def decode_tokens(self, num_seqs: int) -> int:
        """T of a batch of ``num_seqs`` decodes: the sequence rung, capped by the token rung."""
        return min(self.seq_ladder.fit(num_seqs), self.token_ladder.fit(num_seqs))

    def step_shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, S, M) that ``build`` can produce: n sequences carry n..max tokens
        (decodes only: ``decode_tokens(n)``)."""
        pairs = {(self.decode_tokens(n), self.seq_ladder.fit(n))
                 for n in range(1, self.seq_ladder.rungs[-1] + 1)}
        max_tokens = self.token_ladder.rungs[-1]
        for n in range(1, self.seq_ladder.rungs[-1] + 1):
            seats = self.seq_ladder.fit(n)
            for rung in self.token_ladder.rungs:
                if rung >= n:
                    pairs.add((rung, seats))
            if n > max_tokens:
                break
        return sorted((t, s, m) for t, s in pairs for m in self.block_ladder.rungs)

    def decode_shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, S, M) of an all-decode batch (n sequences, one token each)."""
        pairs = {(self.decode_tokens(n), self.seq_ladder.fit(n))
                 for n in range(1, self.seq_ladder.rungs[-1] + 1)}
        return sorted((t, s, m) for t, s in pairs for m in self.block_ladder.rungs)

    def empty(self, T: int, S: int, M: int) -> BatchMetadata:
        """A batch of the given shape holding no sequence (for compiling ahead of time)."""
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        return BatchMetadata(
            input_ids=zeros(T), positions=zeros(T), slot_mapping=np.full(T, -1, np.int32),
            block_tables=zeros(S, M), kv_lens=zeros(S), cu_q_lens=zeros(S + 1),
            num_seqs=zeros(1), logits_indices=zeros(S), temperature=np.zeros(S, np.float32),
            top_k=zeros(S), top_p=np.ones(S, np.float32), min_p=np.zeros(S, np.float32),
            sample_seeds=np.zeros(S, np.uint32), sample_index=zeros(S),
            stop_token_ids=np.full((S, MAX_STOP_TOKENS), -1, np.int32), min_tokens=zeros(S),
            max_output=zeros(S), want_logprobs=zeros(S), **_no_penalties(S))

    def build(self, out: SchedulerOutput, ahead: int = 0) -> BatchMetadata:
        """Pad ``out`` into a batch.

        ``ahead > 0`` builds decodes that continue a device call not yet seen by the host
        (``Scheduler.chain_multi_step``): every request is ``ahead`` tokens further than
        its state says, and ``input_ids`` are left 0 (the device supplies them).
        """
        items = out.scheduled
        if ahead and any(item.num_new_tokens != 1 for item in items):
            raise ValueError("only decodes can be built ahead of the host")
        num_tokens = out.num_batched_tokens
        if all(item.num_new_tokens == 1 for item in items):
            T = self.decode_tokens(len(items))
        else:
            T = self.token_ladder.fit(num_tokens)
        S = self.seq_ladder.fit(len(items))
        tables = [self.kv.block_ids(it.request.request_id) for it in items]
        M = self.block_ladder.fit(max(len(t) for t in tables))
        bs = self.block_size

        input_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slot_mapping = np.full(T, -1, np.int32)
        block_tables = np.zeros((S, M), np.int32)
        kv_lens = np.zeros(S, np.int32)
        cu_q_lens = np.full(S + 1, num_tokens, np.int32)
        logits_indices = np.zeros(S, np.int32)
        temperature = np.zeros(S, np.float32)
        top_k = np.zeros(S, np.int32)
        top_p = np.ones(S, np.float32)
        min_p = np.zeros(S, np.float32)
        seeds = np.zeros(S, np.uint32)
        sample_index = np.zeros(S, np.int32)
        stop_ids = np.full((S, MAX_STOP_TOKENS), -1, np.int32)
        min_tokens = np.zeros(S, np.int32)
        max_output = np.zeros(S, np.int32)
        want_logprobs = np.zeros(S, np.int32)

        start = 0
        for i, (item, table) in enumerate(zip(items, tables)):
            req, n = item.request, item.num_new_tokens
            first = req.num_computed_tokens + ahead
            end = start + n
            pos = np.arange(first, first + n, dtype=np.int32)
            table_arr = np.asarray(table, np.int32)
            if not ahead:
                input_ids[start:end] = req.all_token_ids[first:first + n]
                slot_mapping[start:end] = table_arr[pos // bs] * bs + pos % bs
            # ahead: the decode loop derives its slots from positions, and a row that ends
            # in the previous call may have no block reserved at ``first``.
            positions[start:end] = pos
            block_tables[i, :len(table)] = table_arr
            kv_lens[i] = first + n
            cu_q_lens[i] = start
            logits_indices[i] = end - 1
            params = req.sampling_params
            temperature[i] = params.temperature
            top_k[i] = params.top_k
            top_p[i] = params.top_p
            min_p[i] = params.min_p
            seeds[i] = req.sample_seed
            sample_index[i] = req.num_output_tokens + ahead
            ids = req.stop_token_ids_to_suppress[:MAX_STOP_TOKENS]
            stop_ids[i, :len(ids)] = ids
            min_tokens[i] = params.min_tokens
            max_output[i] = req.max_tokens
            want_logprobs[i] = req.external_sampling or params.logprobs is not None
            start = end
        cu_q_lens[len(items)] = num_tokens
        return BatchMetadata(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
            block_tables=block_tables, kv_lens=kv_lens, cu_q_lens=cu_q_lens,
            num_seqs=np.array([len(items)], np.int32), logits_indices=logits_indices,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            sample_seeds=seeds, sample_index=sample_index, stop_token_ids=stop_ids,
            min_tokens=min_tokens, max_output=max_output,
            want_logprobs=want_logprobs, **self._penalties(items, S, ahead))

    def _penalties(self, items, S: int, ahead: int) -> dict[str, np.ndarray]:
        """The penalty fields of a batch. A row gets a penalty slot when its request has
        penalties and this step's sampled token is kept (the last prefill chunk, a decode)."""
        fields_ = _no_penalties(S)
        penalized = []
        for i, item in enumerate(items):
            req = item.request
            params = req.sampling_params
            emits = ahead or (req.num_computed_tokens + item.num_new_tokens
                              >= len(req.all_token_ids))
            if not (params.has_penalties and emits and not req.external_sampling):
                penalized.append(None)
                continue
            penalized.append(req)
            fields_["presence_penalty"][i] = params.presence_penalty
            fields_["frequency_penalty"][i] = params.frequency_penalty
            fields_["repetition_penalty"][i] = params.repetition_penalty
        if any(r is not None for r in penalized):
            fields_["penalty_slot"][:len(items)] = self.penalty_slots.assign(
                penalized, ahead=bool(ahead))
        return fields_

    def take_penalty_fills(self) -> list[PenaltyFill]:
        """Rows of the device's penalty table to fill before the batch just built runs."""
        return self.penalty_slots.take_fills()


def _no_penalties(S: int) -> dict[str, np.ndarray]:
    return {"presence_penalty": np.zeros(S, np.float32),
            "frequency_penalty": np.zeros(S, np.float32),
            "repetition_penalty": np.ones(S, np.float32),
            "penalty_slot": np.full(S, -1, np.int32)}
