"""The host core: requests, KV blocks, scheduling and batches, in plain Python and numpy
(never JAX, not even through an object handed in: ``tests/test_layering.py``).

``request`` is the one shared type. ``kv`` keeps which device blocks hold which
request's K/V (the block pool, the prefix cache, copy-on-write and swap bookkeeping).
``sched`` decides what runs in each step and applies its sampled tokens to the requests.
``batch`` turns a schedule into the padded arrays of one device call
(``BatchMetadata``, the host/device contract) and names the programs that run them.
"""
