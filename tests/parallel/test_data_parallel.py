"""data_parallel_size=2 x tensor_parallel_size=4 on 8 virtual devices: a mixed workload."""

import pytest

from tests.parallel.helpers import ENGINE, run_worker


@pytest.mark.slow
def test_dp2_tp4_mixed_workload(tp_checkpoints, tp_prompts):
    prompts = [{"prompt_token_ids": p} for p in tp_prompts] * 2
    shared = (tp_prompts[3] * 2)[:40]
    result = run_worker("data_parallel", dict(model=tp_checkpoints["llama"], prompts=prompts,
                                               engine=ENGINE, shared_prefix=shared,
                                               other_prompt=tp_prompts[1]))
    assert result["got"] == result["expected"]  # greedy and seeded sampling, n=1 and n=2
    assert all(count > 0 for count in result["routed"]), result["routed"]
    assert sum(result["routed"]) == len(prompts)
    assert sorted(d for group in result["devices"] for d in group) == list(range(8))
    # prompts sharing a prefix go to one replica although it is then the busier one;
    # an unrelated prompt goes to the least-loaded replica, the other one
    first, second, third, other = result["prefix_owners"]
    assert first == second == third and other != first
