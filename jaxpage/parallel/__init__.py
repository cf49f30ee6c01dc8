"""Sharded execution: tensor parallelism on a mesh, data-parallel replicas, several processes.

``sharding_rules`` (partition specs per parameter, GQA KV-head repetition),
``placement`` (meshes, loading into shards, sharded jit), ``distributed``
(``jax.distributed`` start-up, the leader/follower mirror of device calls), ``router``
(data-parallel front end), ``targets`` (TPU slices and GPUs described in software).
Below ``models`` and ``engine``: nothing here imports them (``engine.startup.replicas`` builds one
engine per replica; ``models.orbax_source`` saves and restores converted params).
"""
