"""Chained block hashes for prefix caching.

A full block's hash covers its tokens, its parent block's hash and any extra keys (an
adapter name, a multimodal input digest), so equal hashes mean equal whole prefixes.
BLAKE2b with 16-byte digests: collisions are not a practical concern, unlike Python's
tuple hash.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

BlockHash = bytes
ROOT_HASH: BlockHash = b"\0" * 16


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple = ()) -> None:
    """Append the hashes of every full block of ``token_ids`` not yet in ``hashes``."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[start:start + block_size], extra_keys))
