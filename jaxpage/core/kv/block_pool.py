"""Physical KV blocks, their reference counts, the free queue and the prefix cache.

Block 0 is the *null block*: it is never handed out, never freed and never written
(padding slots are -1 and are dropped by the cache update). Block tables are padded
with 0, so padded gathers read the null block and are masked out by ``kv_lens``.

A full block may carry a ``block_hash`` (see ``prefix_hash``) and then sits in the
prefix cache. Freed cached blocks stay in the free queue, still cached, until they reach
the head and are handed out again: only then is their hash evicted. Invariant: a block
is in the free queue if and only if its ``ref_cnt`` is 0 (the null block excepted).
"""

from __future__ import annotations


class KVBlock:
    """One physical block. ``prev_free``/``next_free`` link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks, in eviction (LRU) order.

    The head is the next block handed out; freed blocks join at the tail. Removal of a
    block from the middle is O(1), so a free block that is still useful (a cached
    prefix) can be taken back without a scan.
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: never handed out
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left in the free queue")
        self.remove(block)
        return block

    def popleft_many(self, count: int) -> list[KVBlock]:
        """The first ``count`` blocks, unlinked as one run (``popleft`` ``count`` times)."""
        if not 0 <= count <= self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks but {self.num_free_blocks} are free")
        taken = []
        block = self._head.next_free
        for _ in range(count):
            taken.append(block)
            block.prev_free, block.next_free, block = None, None, block.next_free
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= count
        return taken

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (next out) to tail. O(n): for tests and debugging."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """Owns every physical block. ``num_blocks`` counts the null block too."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.enable_caching = enable_caching
        self.cached_blocks: dict[bytes, KVBlock] = {}  # block hash -> block holding it

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Take ``count`` blocks from the head of the free queue, each with ref_cnt 1."""
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks but only {self.num_free_blocks} are free")
        taken = self.free_queue.popleft_many(count)
        for block in taken:
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return taken

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_blocks.get(block_hash) if self.enable_caching else None

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Record that ``block`` (full, referenced) holds the prefix ``block_hash``."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_blocks.setdefault(block_hash, block)  # an equal older copy stays the one found

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each block, reviving free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue's tail in order."""
        for block in blocks:
            if block is self.null_block:
                raise ValueError("the null block cannot be freed")
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks
