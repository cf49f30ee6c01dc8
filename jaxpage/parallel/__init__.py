"""Sharded execution: tensor parallelism on a mesh, data-parallel replicas, several processes.

``sharding_rules`` (partition specs per parameter, GQA KV-head repetition),
``placement`` (meshes, loading into shards, sharded jit), ``distributed``
(``jax.distributed`` start-up, the leader/follower mirror of device calls), ``router``
(data-parallel front end), ``checkpoint`` (orbax save / restore of converted params).
Kept import-light: the model code imports ``sharding_rules``.
"""
