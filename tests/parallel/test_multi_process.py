"""Two processes x 4 CPU devices, joined by jax.distributed over loopback, equal one x 8."""

import pytest

from tests.parallel.helpers import ENGINE, free_port, run_worker, run_workers


@pytest.mark.slow
def test_two_processes_match_one_process(tp_checkpoints, tp_prompts):
    common = dict(model=tp_checkpoints["llama"], tp=8, prompts=tp_prompts, max_tokens=8,
                  engine=ENGINE)
    single = run_worker("multi_process", dict(common, local_devices=8))
    address = f"127.0.0.1:{free_port()}"
    results = run_workers("multi_process", [
        dict(common, local_devices=4, num_processes=2, process_id=i, coordinator_address=address)
        for i in range(2)])
    leader, follower = results
    assert follower is None  # process 1 serves process 0's calls and exits
    assert leader["process_count"] == 2 and leader["device_count"] == 8
    assert single["process_count"] == 1 and single["device_count"] == 8
    assert leader["tokens"] == single["tokens"]
    assert leader["forked"] == single["forked"]
