"""The batch's rows kept between steps, so that building a batch costs little per row.

A request that stays in the batch from one step to the next keeps what never changes
while it runs (its sampling settings, stop token ids, ``max_tokens``) and its block
table in numpy arrays, row by row. A build only gathers those arrays into the new row
order when the set or order of requests changed, writes the rows of requests that
joined, and rewrites the block tables of requests whose blocks changed
(``KVCacheManager.take_changed``): at 256 running decodes a step touches a few rows, not
256 (vLLM's persistent batch follows the same idea).

Invariants: row ``i < len(requests)`` describes ``requests[i]``; rows past it hold the
padding values (greedy, no stop ids, the null block); ``tables[i, :table_len[i]]`` are
the request's block ids as the KV manager last reported them.
"""

from __future__ import annotations

import numpy as np

from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.core.request import MAX_STOP_TOKENS, Request
from jaxpage.sampling_params import MAX_LOGIT_BIAS

# Per-row settings a request keeps while it runs: name -> (dtype, padding value).
SETTINGS: dict[str, tuple[type, float]] = {
    "temperature": (np.float32, 0.0), "top_k": (np.int32, 0), "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0), "sample_seeds": (np.uint32, 0), "min_tokens": (np.int32, 0),
    "max_output": (np.int32, 0), "want_logprobs": (np.int32, 0), "lora_slot": (np.int32, 0),
}


class BatchRows:
    def __init__(self, capacity: int, max_blocks: int) -> None:
        self.capacity = capacity
        self.max_blocks = max_blocks
        self.requests: list[Request] = []
        self.reordered = False
        self.rewritten: list[int] = []
        self._row_of: dict[int, int] = {}       # id(request) -> row
        self._row_of_id: dict[str, int] = {}    # request_id -> row
        self._reset()

    def _reset(self) -> None:
        R = self.capacity
        self.settings = {name: np.full(R, pad, dtype) for name, (dtype, pad) in SETTINGS.items()}
        self.stop_token_ids = np.full((R, MAX_STOP_TOKENS), -1, np.int32)  # [R, MAX_STOP]
        self.bias_ids = np.full((R, MAX_LOGIT_BIAS), -1, np.float32)       # [R, MAX_BIAS]
        self.bias_values = np.zeros((R, MAX_LOGIT_BIAS), np.float32)       # [R, MAX_BIAS]
        self.has_penalties = np.zeros(R, bool)                             # [R]
        self.external = np.zeros(R, bool)                                  # [R] beam search
        self.tables = np.zeros((R, self.max_blocks), np.int32)             # [R, max_blocks]
        self.table_len = np.zeros(R, np.int32)                             # [R]
        self.longest_table = 0     # an upper bound of table_len[:len(requests)], >= 0
        self.any_penalties = False  # has_penalties[:len(requests)].any()

    def update(self, requests: list[Request], kv: KVCacheManager) -> "BatchRows":
        """Make the rows describe ``requests`` in this order; returns self. Afterwards
        ``reordered`` says whether the set or order of requests changed, and, when it did
        not, ``rewritten`` lists the rows whose block table was rewritten."""
        if len(requests) > self.capacity:
            raise ValueError(f"{len(requests)} sequences exceed the batch's "
                             f"{self.capacity} rows (max_num_seqs)")
        changed = kv.take_changed()
        self.reordered = requests != self.requests  # list equality compares identities first
        self.rewritten = []
        blocks = kv.req_to_blocks
        if self.reordered:
            for row in self._reorder(requests):
                self._write_table(row, blocks.get(requests[row].request_id, ()), 0)
        row_of_id = self._row_of_id
        tables, table_len, max_blocks = self.tables, self.table_len, self.max_blocks
        longest = 0
        for request_id, first in changed.items():
            row = row_of_id.get(request_id)
            if row is None:
                continue
            request_blocks = blocks.get(request_id, ())
            count = first + 1
            # One block appended (the usual change), inline: per-call numpy work is what
            # costs here, its code and data cold after a long device step.
            if len(request_blocks) == count <= max_blocks and table_len[row] <= count:
                tables[row, first] = request_blocks[first].block_id
                table_len[row] = count
                longest = max(longest, count)
            else:
                self._write_table(row, request_blocks, first)
            self.rewritten.append(row)
        self.longest_table = max(self.longest_table, longest)
        return self

    def _reorder(self, requests: list[Request]) -> list[int]:
        """Move kept rows into the new order and write joining ones; their rows."""
        old_requests, old_row_of = self.requests, self._row_of
        old_rows = np.full(len(requests), -1, np.int64)
        for i, request in enumerate(requests):
            row = old_row_of.get(id(request))
            if row is not None and old_requests[row] is request:
                old_rows[i] = row
        old = (self.settings, self.stop_token_ids, self.has_penalties, self.tables,
               self.table_len, self.external, self.bias_ids, self.bias_values)
        self._reset()
        kept = np.flatnonzero(old_rows >= 0)
        source = old_rows[kept]
        for name, values in old[0].items():
            self.settings[name][kept] = values[source]
        self.stop_token_ids[kept] = old[1][source]
        self.has_penalties[kept] = old[2][source]
        self.tables[kept] = old[3][source]
        self.table_len[kept] = old[4][source]
        self.external[kept] = old[5][source]
        self.bias_ids[kept] = old[6][source]
        self.bias_values[kept] = old[7][source]
        self.requests = list(requests)
        self.longest_table = int(self.table_len.max())
        self.any_penalties = bool(self.has_penalties.any())
        self._row_of = {id(r): i for i, r in enumerate(requests)}
        self._row_of_id = {r.request_id: i for i, r in enumerate(requests)}
        joined = np.flatnonzero(old_rows < 0).tolist()
        for i in joined:
            self._write_settings(i, requests[i])
        return joined

    def _write_settings(self, row: int, request: Request) -> None:
        params = request.sampling_params
        values = self.settings
        values["temperature"][row] = params.temperature
        values["top_k"][row] = params.top_k
        values["top_p"][row] = params.top_p
        values["min_p"][row] = params.min_p
        values["sample_seeds"][row] = request.sample_seed
        values["min_tokens"][row] = params.min_tokens
        values["max_output"][row] = request.max_tokens
        values["want_logprobs"][row] = request.external_sampling or params.logprobs is not None
        values["lora_slot"][row] = request.lora_slot
        ids = request.stop_token_ids_to_suppress[:MAX_STOP_TOKENS]
        self.stop_token_ids[row, :len(ids)] = ids
        if params.logit_bias:
            self.bias_ids[row, :len(params.logit_bias)] = list(params.logit_bias)
            self.bias_values[row, :len(params.logit_bias)] = list(params.logit_bias.values())
        self.has_penalties[row] = params.has_penalties and not request.external_sampling
        self.any_penalties = self.any_penalties or bool(self.has_penalties[row])
        self.external[row] = request.external_sampling

    def _write_table(self, row: int, blocks, first: int) -> None:
        """Make row ``row``'s table ``blocks`` (KVBlocks), of which those before ``first``
        are already there (usually one block was appended: one element is written)."""
        count = len(blocks)
        if count > self.max_blocks:
            raise ValueError(f"a request holds {count} blocks, more than the "
                             f"{self.max_blocks} of max_model_len")
        table = self.tables[row]
        if count - first == 1:
            table[first] = blocks[first].block_id
        elif count > first:
            table[first:count] = [b.block_id for b in blocks[first:]]
        old = self.table_len[row]
        if count < old:
            table[count:old] = 0
        self.table_len[row] = count
        self.longest_table = max(self.longest_table, count)

    def fields(self, S: int) -> dict[str, np.ndarray]:
        """The per-row settings of a batch of ``S`` rows (fresh arrays: the device may
        keep them while later builds change the rows)."""
        out = {name: values[:S].copy() for name, values in self.settings.items()}
        out["stop_token_ids"] = self.stop_token_ids[:S].copy()
        out["bias_ids"] = self.bias_ids[:S].copy()
        out["bias_values"] = self.bias_values[:S].copy()
        return out
