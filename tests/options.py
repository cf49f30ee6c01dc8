"""Engine options shared by tests, so that engines of the same shapes share their programs.

``FEW_BUCKETS``: each bucket ladder keeps only its smallest and largest rung, for tests
that do not test the ladders themselves: a handful of programs to compile per engine
instead of dozens (more padding, which the outputs must not notice).
``TINY``: the tiny Llama engine most engine tests use. Engines with equal options and
model run the same compiled programs: the runner's executable cache shares them across
the process (``jaxpage.runtime.executable_cache``).
"""

FEW_BUCKETS = {"bucket_growth": 4096}
TINY = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
        "block_size": 8, "num_kv_blocks": 128, **FEW_BUCKETS}
