"""Which device blocks hold which request's K/V: ``block_pool`` (physical blocks,
reference counts, the LRU free queue and the prefix cache; block 0 is the null block),
``prefix_hash`` (chained block hashes) and ``kv_cache_manager`` (a request's block table:
prefix lookup, copy-on-write, forks, swaps, sliding windows, and the block copies and
swaps queued for the device). Invariant: every block is either free or held by the
requests that count it, and a block the prefix cache may share is never written."""
