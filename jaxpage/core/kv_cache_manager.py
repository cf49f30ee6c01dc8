"""Maps requests to the physical blocks that hold their keys and values."""

from __future__ import annotations

from jaxpage.core.block_pool import BlockPool, KVBlock
from jaxpage.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates slots for new tokens and frees requests' blocks.

    Invariant: a request's block list is append-only while it holds it, and block ``j``
    of the list holds the K/V of token positions ``[j * block_size, (j + 1) * block_size)``.
    """

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVBlock]] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Ensure blocks for ``num_computed_tokens + num_new_tokens`` tokens; False if short."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if needed > self.block_pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        if needed > 0:
            blocks.extend(self.block_pool.get_new_blocks(needed))
        return True

    def free(self, request: Request) -> None:
        """Release all blocks of a request, last block first (so its tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]
