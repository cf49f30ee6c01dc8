"""Speculative proposals from a draft model, run on the device.

The draft is any model the loader reads whose vocabulary is the target's. It keeps its
own paged KV cache with the target's geometry (the same number of blocks of the same
size), addressed by the target's block tables: a request's draft KV for position ``p``
lives in the same block and offset as its target KV, so the draft needs no block
manager of its own, and a block the target frees frees the draft's entry with it.

Per request the proposer remembers how far the draft's KV is valid (``_DraftState``):
positions ``[0, valid)`` hold KV of the request's real tokens, and the proposals it fed
itself last time (``tail``) are valid for as long as the request's tokens still equal
them. Everything else is recomputed:

* ``fill`` (one request at a time, in chunks of the token ladder) writes the draft KV of
  the real tokens at ``[valid, L - 1)`` (``L`` tokens known): a new request's whole prompt,
  or the tokens the target emitted while speculation was off;
* ``propose`` (all rows together) feeds each row's last real token at ``L - 1`` and then
  its own choices, ``k`` times, inside one ``fori_loop``: ``k`` proposals per row for one
  dispatch, written and read through the paged cache like any decode. A greedy request's
  proposals are the draft's argmax; a sampled request's are drawn from the draft's
  distribution at the request's temperature (its own seeded stream, apart from the
  target's), and those distributions (q) stay on the device for the verify step's
  rejection sampler (``sampler.rejection_sample``: accept with min(1, p/q), else draw
  from the normalised (p - q)+).

The draft's state is dropped when the request was preempted since (its blocks were
freed or swapped, so another request may have written the draft's entries) or when the
blocks under its valid positions changed. Greedy requests' outputs equal plain
decoding's token for token; sampled requests' are distributed as plain decoding's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpage.speculative_config import SpeculativeConfig
from jaxpage.core.batch.bucket_ladder import BucketLadder
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.core.request import Request
from jaxpage.models.loader import LoadedModel
from jaxpage.runtime.kv_cache import allocate_kv_cache
from pallas_kernels import kv_layout
from jaxpage.runtime.sampler import first_argmax, gumbel_noise
from jaxpage.runtime.step_batch import ForwardBatch

# Keys the draft's random stream apart from the target's for the same request seed.
DRAFT_STREAM = 0x0D4AF7ED


@dataclass
class _DraftState:
    """How much of a request's draft KV is valid (see the module docstring)."""

    valid: int                 # positions [0, valid) hold KV of the request's real tokens
    tail: list[int]            # proposals fed at positions valid, valid + 1, ...
    blocks: list[int] = field(default_factory=list)  # block ids under those positions
    num_preemptions: int = 0   # the request's count when this was written


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel, target_tokenizer: Any,
                          draft_tokenizer: Any) -> None:
    """A ValueError unless the draft proposes in the target's token ids."""
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(f"speculative_config draft model {draft.path!r} has vocab_size="
                         f"{draft.arch.vocab_size}, the target {target.path!r} has "
                         f"{target.arch.vocab_size}: a draft model must share the target's "
                         "vocabulary")
    if target_tokenizer is None or draft_tokenizer is None:
        return  # token-id models (presets): the vocabulary sizes are all there is
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"speculative_config draft model {draft.path!r} has a different "
                         f"tokenizer from the target {target.path!r}: a draft model must "
                         "share the target's tokenizer")


class DraftModelProposer:
    """A draft model's proposals (``propose_batch``, called by ``DeviceCalls`` for the rows
    ``Speculation.reserve_draft_rows`` picked): its argmax for greedy rows, a draw from
    its distribution for sampled ones.

    Shapes come from the target's ladders: ``fill`` takes (T tokens, M blocks) for one
    request, ``propose`` (S rows, M blocks); ``warmup`` compiles them all.
    """

    def __init__(self, draft: LoadedModel, config: SpeculativeConfig, kv: KVCacheManager, *,
                 num_blocks: int, token_ladder: BucketLadder, seq_ladder: BucketLadder,
                 block_ladder: BucketLadder, layout: str = kv_layout.SPLIT) -> None:
        """``layout``: the target's cache layout (``pallas_kernels.kv_layout``), which the
        draft's own cache shares."""
        if draft.mesh is not None:
            raise ValueError("a draft model under tensor parallelism is not supported")
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.token_ladder, self.seq_ladder, self.block_ladder = (token_ladder, seq_ladder,
                                                                 block_ladder)
        graphdef, state = nnx.split(draft.model)
        self.params = nnx.to_pure_dict(state)
        dtype = draft.model.final_norm[...].dtype
        self.kv_cache = allocate_kv_cache(draft.arch, num_blocks, self.block_size, dtype,
                                          layout=layout)
        self._fill = jax.jit(_fill_program(graphdef), donate_argnums=(1,))
        self._propose = jax.jit(_propose_program(graphdef, config.num_speculative_tokens),
                                donate_argnums=(1,), static_argnums=(6,))
        # q of the last propose call, padded to the most rows a speculating step has:
        # float32 [q_rows, V], row i * k + j for proposal j + 1 of the call's i-th row.
        self.q_rows = seq_ladder.fit(min(config.disable_by_batch_size, seq_ladder.rungs[-1])) \
            * config.num_speculative_tokens
        self.last_q: jax.Array | None = None
        self.compiled_shapes: set[tuple[str, int, int]] = set()
        self._states: "weakref.WeakKeyDictionary[Request, _DraftState]" = (
            weakref.WeakKeyDictionary())

    # -- the scheduler's side ----------------------------------------------------------

    def propose_batch(self, rows: list[tuple[Request, int]]) -> list[list[int]]:
        """Proposals for each ``(request, k)``: ``k`` tokens (1 <= k <=
        ``num_speculative_tokens``) after the request's last one. Slots for the last token
        and ``k`` proposals must already be allocated (``KVCacheManager.allocate_slots``)."""
        tables = []
        for request, _ in rows:
            blocks = self.kv.block_ids(request.request_id)
            tokens = request.all_token_ids
            valid = self._valid_prefix(request, blocks, tokens)
            if valid < len(tokens) - 1:
                self._fill_tokens(blocks, tokens, valid, len(tokens) - 1)
            tables.append(blocks)
        proposals = self._run_propose(rows, tables)
        for (request, k), blocks, row in zip(rows, tables, proposals):
            self._states[request] = _DraftState(
                valid=len(request.all_token_ids), tail=list(row[:k - 1]),
                blocks=list(blocks), num_preemptions=request.num_preemptions)
        return [list(row[:k]) for (_, k), row in zip(rows, proposals)]

    def _valid_prefix(self, request: Request, blocks: list[int], tokens: list[int]) -> int:
        """Positions whose draft KV holds the request's real tokens (see the docstring)."""
        state = self._states.get(request)
        if state is None or state.num_preemptions != request.num_preemptions:
            return 0
        valid = state.valid
        for fed in state.tail:
            if valid >= len(tokens) - 1 or tokens[valid] != fed:
                break
            valid += 1
        # Blocks under the valid positions must be the ones the draft wrote into.
        size = self.block_size
        for index in range(-(-valid // size)):
            if index >= len(blocks) or index >= len(state.blocks) \
                    or blocks[index] != state.blocks[index]:
                valid = min(valid, index * size)
                break
        return min(valid, len(tokens) - 1)

    # -- device calls ------------------------------------------------------------------

    def _table(self, blocks: list[int], width: int) -> np.ndarray:
        table = np.zeros(width, np.int32)
        table[:len(blocks)] = blocks[:width]
        return table

    def _fill_tokens(self, blocks: list[int], tokens: list[int], start: int, stop: int) -> None:
        """Write the draft KV of ``tokens[start:stop]`` (positions start..stop-1), in
        chunks of at most the token ladder's top rung."""
        size, chunk = self.block_size, self.token_ladder.rungs[-1]
        M = self.block_ladder.fit(max(1, len(blocks)))
        table = self._table(blocks, M)[None, :]                              # [1, M]
        for begin in range(start, stop, chunk):
            end = min(stop, begin + chunk)
            n = end - begin
            T = self.token_ladder.fit(n)
            positions = np.zeros(T, np.int32)
            positions[:n] = np.arange(begin, end, dtype=np.int32)
            ids = np.zeros(T, np.int32)
            ids[:n] = tokens[begin:end]
            slots = np.full(T, -1, np.int32)
            slots[:n] = table[0, positions[:n] // size] * size + positions[:n] % size
            self.compiled_shapes.add(("fill", T, M))
            self.kv_cache = self._fill(self.params, self.kv_cache, np.stack([ids, positions, slots]),
                                       table, np.array([end], np.int32),
                                       np.array([0, n], np.int32), np.array([1], np.int32))

    def _run_propose(self, rows: list[tuple[Request, int]],
                     tables: list[list[int]]) -> np.ndarray:
        """int32 [n, k]: ``k = num_speculative_tokens`` greedy proposals per row."""
        n = len(rows)
        S = self.seq_ladder.fit(n)
        M = self.block_ladder.fit(max(1, max(len(t) for t in tables)))
        ints = np.zeros((5, S), np.int32)  # last token, its position, wanted, seed, index
        ints[2] = 1
        temperature = np.zeros(S, np.float32)
        block_tables = np.zeros((S, M), np.int32)
        for i, ((request, k), blocks) in enumerate(zip(rows, tables)):
            tokens = request.all_token_ids
            ints[:, i] = (tokens[-1], len(tokens) - 1, k,
                          np.uint32(request.sample_seed).view(np.int32),
                          request.num_output_tokens)
            temperature[i] = request.sampling_params.temperature
            block_tables[i] = self._table(blocks, M)
        self.compiled_shapes.add(("propose", S, M))
        self.kv_cache, proposals, self.last_q = self._propose(
            self.params, self.kv_cache, ints, temperature, block_tables,
            np.array([n], np.int32), self.q_rows)
        return np.asarray(proposals)[:n]

    def warmup(self) -> int:
        """Compile ``fill`` and ``propose`` for every shape they can take; returns the count."""
        count = 0
        max_rows = min(self.config.disable_by_batch_size, self.seq_ladder.rungs[-1])
        seats = sorted({self.seq_ladder.fit(n) for n in range(1, max_rows + 1)})
        for M in self.block_ladder.rungs:
            table = np.zeros((1, M), np.int32)
            for T in self.token_ladder.rungs:
                tokens = np.stack([np.zeros(T, np.int32), np.zeros(T, np.int32),
                                   np.full(T, -1, np.int32)])
                self.kv_cache = self._fill(self.params, self.kv_cache, tokens, table,
                                           np.array([0], np.int32), np.array([0, 0], np.int32),
                                           np.array([0], np.int32))
                self.compiled_shapes.add(("fill", T, M))
                count += 1
            for S in seats:
                ints = np.zeros((5, S), np.int32)
                ints[2] = 1
                self.kv_cache, proposals, _ = self._propose(
                    self.params, self.kv_cache, ints, np.zeros(S, np.float32),
                    np.zeros((S, M), np.int32), np.array([0], np.int32), self.q_rows)
                self.compiled_shapes.add(("propose", S, M))
                count += 1
        jax.block_until_ready(self.kv_cache)
        return count


def _fill_program(graphdef: Any):
    """``fill(params, kv_cache, tokens [3, T] (ids, positions, slots), block_tables [1, M],
    kv_lens [1], cu_q_lens [2], num_seqs [1]) -> kv_cache``: the draft's forward over one
    request's tokens, for their KV only."""
    def fill(params, kv_cache, tokens, block_tables, kv_lens, cu_q_lens, num_seqs):
        model = nnx.merge(graphdef, params)
        batch = ForwardBatch(slot_mapping=tokens[2], kv_lens=kv_lens, block_tables=block_tables,
                             cu_q_lens=cu_q_lens, num_seqs=num_seqs)
        _, kv_cache = model(tokens[0], tokens[1], kv_cache, batch)
        return kv_cache

    return fill


def _propose_program(graphdef: Any, k: int):
    """``propose(params, kv_cache, rows int32 [5, S] (last token, its position, proposals
    wanted, seed bits, output tokens so far), temperature float32 [S], block_tables
    [S, M], num_seqs [1], q_rows (static)) -> (kv_cache, proposals int32 [S, k], q float32
    [q_rows, V])``.

    Iteration ``j`` feeds each row the token at position ``last + j`` (its last real token,
    then its own proposals) and takes proposal ``j + 1``: the argmax for a greedy row, a
    draw from softmax(logits / temperature) for a sampled one, whose distribution is
    ``q[row * k + j]``. A row writes KV only for the tokens later proposals depend on
    (``j < wanted``: inside the slots the scheduler allocated); past that it re-reads its
    last real position, and its extra proposals are dropped by the host.
    """
    def propose(params, kv_cache, rows, temperature, block_tables, num_seqs, q_rows):
        model = nnx.merge(graphdef, params)
        S, M = block_tables.shape
        block_size = kv_cache[0].shape[2]
        seat = jnp.arange(S, dtype=jnp.int32)
        real = seat < num_seqs[0]                                            # [S]
        cu_q_lens = jnp.minimum(jnp.arange(S + 1, dtype=jnp.int32), num_seqs[0])

        def body(j, carry):
            kv_cache, ids, out, q = carry
            writes = real & (j < rows[2])                                    # [S]
            pos = jnp.where(writes, rows[1] + j, rows[1])                    # [S]
            block = block_tables[seat, jnp.clip(pos // block_size, 0, M - 1)]
            slots = jnp.where(writes, block * block_size + pos % block_size, -1)
            batch = ForwardBatch(slot_mapping=slots, kv_lens=jnp.where(real, pos + 1, 0),
                                 block_tables=block_tables, cu_q_lens=cu_q_lens,
                                 num_seqs=num_seqs)
            hidden, kv_cache = model(ids, jnp.where(real, pos, 0), kv_cache, batch)
            logits = model.compute_logits(hidden)                            # [S, V]
            sampled = temperature > 0
            scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
            noise = gumbel_noise(seeds, rows[4] + j, logits.shape[-1])
            choice = jnp.where(sampled, first_argmax(scaled + noise), first_argmax(logits))
            ids = jnp.where(writes, choice, ids)
            q = q.at[:, j].set(jax.nn.softmax(scaled, axis=-1))
            return kv_cache, ids, out.at[:, j].set(choice), q

        seeds = jax.lax.bitcast_convert_type(rows[3], jnp.uint32) ^ jnp.uint32(DRAFT_STREAM)
        vocab = model.cfg.vocab_size
        out = jnp.zeros((S, k), jnp.int32)
        q = jnp.zeros((S, k, vocab), jnp.float32)
        kv_cache, _, out, q = jax.lax.fori_loop(0, k, body, (kv_cache, rows[0], out, q))
        q = jnp.zeros((q_rows, vocab), jnp.float32).at[:S * k].set(q.reshape(S * k, vocab))
        return kv_cache, out, q

    return propose
