"""Maps requests to the physical blocks that hold their keys and values.

Invariants:

* A request's block list is append-only while it holds it, except that blocks past its
  known tokens, which only rejected speculative proposals reached, are given back
  (``free_tail``); block ``j`` holds the K/V of token positions
  ``[j * block_size, (j + 1) * block_size)``.
* A block's ``ref_cnt`` equals the number of block lists (over all requests) that hold it.
* Only positions ``>= num_computed_tokens`` are ever written, so blocks taken from the
  prefix cache (full, below that mark) are never written. A block shared by a fork may
  be partly filled: before a request writes into such a block it gets a private copy
  (copy-on-write); the copy is queued in ``pending_copies`` and must run on the device
  before the next step.
* Swapped-out requests hold host blocks only; ``pending_swap_out`` / ``pending_swap_in``
  list the (device, host) block copies the device must run, swap-outs first. A swap-in
  shares the leading full blocks the prefix cache holds instead of copying them.
* With ``sliding_window`` (a model whose every layer attends only to the last
  ``sliding_window`` positions), a block no future query can see (every position
  ``<= num_computed_tokens - sliding_window``) is given back and its place in the list
  taken by the pool's null block (id 0, never counted, never freed), so lists stay
  aligned with positions and a long sequence holds about window / block_size + 2 blocks.
  Queries never look there: the kernels mask those positions.
"""

from __future__ import annotations

from jaxpage.core.kv.block_pool import BlockPool, KVBlock
from jaxpage.core.kv.prefix_hash import extend_block_hashes
from jaxpage.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class HostBlockPool:
    """Free list of host-memory block slots for swapped-out requests (ids 0..n-1)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ValueError(f"asked for {count} host blocks but only {len(self._free)} are free")
        return [self._free.pop() for _ in range(count)]

    def give_back(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int, *, num_host_blocks: int = 0,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be positive")
        self.block_pool = block_pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.null_block = block_pool.null_block
        self.num_dropped: dict[str, int] = {}  # leading blocks given back (behind the window)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_hashed_blocks: dict[str, int] = {}  # leading blocks already put in the cache
        self.host_pool = HostBlockPool(num_host_blocks)
        self.req_to_host_blocks: dict[str, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []     # (src block, dst block) on device
        self.pending_swap_out: list[tuple[int, int]] = []   # (device block, host block)
        self.pending_swap_in: list[tuple[int, int]] = []    # (host block, device block)
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_swap_in_shared_blocks = 0  # swapped-in blocks taken from the prefix cache
        # Requests whose block list changed since the batch builder last looked, each with
        # the index of its first block that may differ: the builder keeps block tables row
        # by row and rewrites only from there (``take_changed``).
        self.changed: dict[str, int] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix cache -----------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Cached blocks holding the longest prefix of the request's tokens.

        At least one token is left to compute (its logits are needed), so a fully cached
        prompt still recomputes its last token. Only for a request holding no blocks.
        """
        if request.request_id in self.req_to_blocks:
            return []
        return self._cached_prefix(request, (request.num_tokens - 1) // self.block_size)

    def _cached_prefix(self, request: Request, max_blocks: int) -> list[KVBlock]:
        """Cached blocks holding the longest run of the request's first ``max_blocks``
        full blocks of tokens."""
        if not self.block_pool.enable_caching:
            return []
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.extra_keys)
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queried_tokens += num_queried_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    def needs_full_blocks(self) -> bool:
        """Whether ``cache_full_blocks`` does anything (the prefix cache or a sliding
        window): when not, a request completing a block need not be told."""
        return self.block_pool.enable_caching or self.sliding_window is not None

    def cache_full_blocks(self, request: Request) -> None:
        """Put every block fully covered by computed tokens into the prefix cache."""
        if self.sliding_window is not None:
            self._hash_full_blocks(request)  # before their blocks are given back
            self.drop_behind_window(request)
        else:
            self._hash_full_blocks(request)

    def _hash_full_blocks(self, request: Request) -> None:
        if not self.block_pool.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        done = self.num_hashed_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.extra_keys)
        null = self.null_block
        for i in range(done, num_full):
            if blocks[i] is not null:
                self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_hashed_blocks[request.request_id] = num_full

    def drop_behind_window(self, request: Request) -> None:
        """Give back the blocks no future query of ``request`` can see (``sliding_window``
        set): block j once ``(j + 1) * block_size <= num_computed_tokens - window + 1``.
        Every future query is at a position >= num_computed_tokens, so it reads only
        positions above ``num_computed_tokens - window``. Full blocks are hashed first
        (``cache_full_blocks``), so a later request can still find them in the cache."""
        request_id = request.request_id
        dead = (request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        done = self.num_dropped.get(request_id, 0)
        if dead <= done:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        dead = min(dead, len(blocks))
        null = self.null_block
        given = [b for b in blocks[done:dead] if b is not null]
        blocks[done:dead] = [null] * (dead - done)
        self.num_dropped[request_id] = dead
        self._changed_from(request_id, done)
        self.block_pool.free_blocks(given)

    def num_live_blocks(self, request_id: str) -> int:
        """Device blocks ``request_id`` holds (those behind its window not counted)."""
        return len(self.req_to_blocks.get(request_id, ())) - self.num_dropped.get(request_id, 0)

    def most_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most device blocks a sequence of ``num_tokens`` ever holds at once when no
        step computes more than ``max_step_tokens`` of it."""
        full = self.num_blocks_for(num_tokens)
        if self.sliding_window is None:
            return full
        return min(full, self.num_blocks_for(self.sliding_window + max_step_tokens) + 1)

    # -- allocation -------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` after the computed ones; False (no change) if short.

        ``computed_blocks`` (from ``get_computed_blocks``) are taken first; the caller
        then advances ``num_computed_tokens`` by ``len(computed_blocks) * block_size``.
        """
        if self.sliding_window is not None:
            self.drop_behind_window(request)
        blocks = self.req_to_blocks.get(request.request_id, [])
        if not computed_blocks:
            # Hot path (a decode whose slot is already there, unshared): nothing to do.
            index = request.num_computed_tokens // self.block_size
            last = (request.num_computed_tokens + num_new_tokens - 1) // self.block_size
            if num_new_tokens > 0 and last < len(blocks) and blocks[index].ref_cnt == 1:
                return True
        computed_blocks = computed_blocks or []
        first_new = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_have = len(blocks) + len(computed_blocks)
        num_new_blocks = self.num_blocks_for(first_new + num_new_tokens) - num_have
        cow_index = first_new // self.block_size
        needs_copy = (cow_index < len(blocks) and blocks[cow_index].ref_cnt > 1
                      and num_new_tokens > 0)
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + needs_copy + num_revived > self.block_pool.num_free_blocks:
            return False
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        if computed_blocks or num_new_blocks > 0:
            self._changed_from(request.request_id, len(blocks))
        if needs_copy:
            self._changed_from(request.request_id, cow_index)
        if computed_blocks:
            self.block_pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self.num_hashed_blocks[request.request_id] = len(blocks)
        if needs_copy:
            shared = blocks[cow_index]
            (private,) = self.block_pool.get_new_blocks(1)
            self.block_pool.free_blocks([shared])
            blocks[cow_index] = private
            self.pending_copies.append((shared.block_id, private.block_id))
        if num_new_blocks > 0:
            blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        return True

    def append_blocks(self, requests: list[Request], counts: list[int]) -> bool:
        """Bring request ``i`` to ``counts[i]`` blocks where it holds one fewer: decodes
        whose next token starts a block, all at once (the steady state of decoding, where
        many rows start a block in the same step); ``allocate_slots(request, 2)`` for
        each. Requests already holding ``counts[i]`` blocks are left alone.

        All or nothing: False, changing nothing, when a request holds fewer still, its
        last block is shared (it would need a copy), a sliding window applies, or fewer
        blocks are free than needed; the caller then takes ``allocate_slots`` one by one.
        """
        if self.sliding_window is not None:
            return False
        req_to_blocks = self.req_to_blocks
        growing = []  # (request id, its block list)
        for request, count in zip(requests, counts):
            blocks = req_to_blocks.get(request.request_id)
            if blocks is None:
                return False
            held = len(blocks)
            if held >= count:
                continue  # reserved earlier
            if held != count - 1 or blocks[-1].ref_cnt != 1:
                return False
            growing.append((request.request_id, blocks))
        if len(growing) > self.block_pool.num_free_blocks:
            return False
        changed = self.changed
        for (request_id, blocks), block in zip(growing,
                                               self.block_pool.get_new_blocks(len(growing))):
            first = changed.get(request_id)
            if first is None or len(blocks) < first:
                changed[request_id] = len(blocks)
            blocks.append(block)
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's blocks, shared by reference count."""
        if child.request_id in self.req_to_blocks:
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        blocks = list(self.req_to_blocks.get(parent.request_id, []))
        null = self.null_block
        self.block_pool.touch([b for b in blocks if b is not null])
        self.req_to_blocks[child.request_id] = blocks
        self._changed_from(child.request_id, 0)
        self.num_hashed_blocks[child.request_id] = self.num_hashed_blocks.get(parent.request_id, 0)
        if parent.request_id in self.num_dropped:
            self.num_dropped[child.request_id] = self.num_dropped[parent.request_id]

    def free(self, request: Request) -> None:
        """Release all blocks of a request, last block first (so its tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._changed_from(request.request_id, 0)
        self.num_hashed_blocks.pop(request.request_id, None)
        self.num_dropped.pop(request.request_id, None)
        null = self.null_block
        self.block_pool.free_blocks([b for b in reversed(blocks) if b is not null])
        self.host_pool.give_back(self.req_to_host_blocks.pop(request.request_id, []))

    def free_tail(self, request: Request) -> None:
        """Give back the blocks past those that hold the request's known tokens: after a
        verify step, blocks that only rejected proposals were written into. They were
        never full of accepted tokens, so none is in the prefix cache."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.num_blocks_for(len(request.all_token_ids))
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self._changed_from(request.request_id, keep)
        self.block_pool.free_blocks(list(reversed(tail)))

    # -- swapping ---------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        return self.num_live_blocks(request.request_id) <= self.host_pool.num_free_blocks

    def swap_out(self, request: Request) -> None:
        """Move a request's blocks to host memory; its device blocks are released. Blocks
        behind its window stay dropped: the swapped list starts after them."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._changed_from(request.request_id, 0)
        live = blocks[self.num_dropped.get(request.request_id, 0):]
        host = self.host_pool.take(len(live))
        self.pending_swap_out.extend((b.block_id, h) for b, h in zip(live, host))
        self.req_to_host_blocks[request.request_id] = host
        self.num_hashed_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(list(reversed(live)))

    def adopt_host_blocks(self, request: Request, count: int) -> list[int]:
        """Host blocks for ``count`` pages of a request prefilled elsewhere, which the
        caller fills; the request then swaps in like any swapped-out one. ValueError when
        the host pool lacks room."""
        if count > self.host_pool.num_free_blocks:
            raise ValueError(f"the host pool has {self.host_pool.num_free_blocks} free blocks, "
                             f"the request needs {count} (raise swap_space)")
        host = self.host_pool.take(count)
        self.req_to_host_blocks[request.request_id] = host
        return host

    def can_swap_in(self, request: Request) -> bool:
        return len(self.req_to_host_blocks.get(request.request_id, [])) <= self.block_pool.num_free_blocks

    def swap_in(self, request: Request) -> None:
        """Bring a swapped-out request's blocks back onto the device. Leading full blocks
        whose prefix the device's cache already holds are shared from it (no copy); the
        rest are copied into fresh device blocks. (A request prefilled elsewhere whose
        prefix this instance has served before thus costs only its new pages.)"""
        host = self.req_to_host_blocks.pop(request.request_id)
        dropped = self.num_dropped.get(request.request_id, 0)
        full = min(request.num_computed_tokens // self.block_size, len(host))
        hits = [] if dropped else self._cached_prefix(request, full)
        self.block_pool.touch(hits)  # before taking fresh blocks, which may evict free ones
        blocks = self.block_pool.get_new_blocks(len(host) - len(hits))
        self.pending_swap_in.extend((h, b.block_id) for h, b in zip(host[len(hits):], blocks))
        self.req_to_blocks[request.request_id] = [self.null_block] * dropped + hits + blocks
        if hits:
            self.num_hashed_blocks[request.request_id] = len(hits)
            self.num_swap_in_shared_blocks += len(hits)
        self._changed_from(request.request_id, 0)
        self.host_pool.give_back(host)

    def take_pending_block_ops(self) -> tuple[list, list, list]:
        """(swap_out, swap_in, copies) to run on the device, in that order; clears them."""
        ops = (self.pending_swap_out, self.pending_swap_in, self.pending_copies)
        self.pending_swap_out, self.pending_swap_in, self.pending_copies = [], [], []
        return ops

    def take_changed(self) -> dict[str, int]:
        """Request id -> index of the first block that may have changed, for the requests
        whose block list changed since the last call; clears them."""
        changed, self.changed = self.changed, {}
        return changed

    def _changed_from(self, request_id: str, index: int) -> None:
        first = self.changed.get(request_id)
        if first is None or index < first:
            self.changed[request_id] = index

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def host_block_ids(self, request_id: str) -> list[int]:
        return list(self.req_to_host_blocks.get(request_id, []))
