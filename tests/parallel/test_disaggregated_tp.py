"""Disaggregated prefill and decode under tensor parallelism (virtual CPU devices): the
pages move shard by shard between instances that split the KV heads the same way, the
outputs equal a colocated engine's (greedy and seeded), and an instance that splits them
differently refuses the ticket with a clear error."""

import pytest

from tests.parallel.helpers import ENGINE, run_worker


@pytest.mark.slow  # ~40 s on 2 cores (worker processes); the unsharded handoff is in the
# default suite (tests/server/test_disaggregated.py, tests/engine/test_kv_handoff.py)
def test_pages_move_shard_by_shard_and_outputs_equal_colocated(tiny_checkpoints, tp_prompts):
    result = run_worker("disaggregated_tp", dict(
        model=tiny_checkpoints["llama"], tp=2, prompts=tp_prompts[:6], engine=ENGINE))
    assert result["disaggregated"] == result["colocated"]
    assert result["kv_shards"] == [2]
    assert all(free == total for free, total in result["free"])
    assert "splits the KV heads over 2 device(s), this decode instance over 1" in \
        result["refused"]
