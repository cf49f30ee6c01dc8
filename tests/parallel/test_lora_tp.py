"""LoRA under tensor parallelism (virtual CPU devices): a batch mixing adapters gives the
same greedy tokens at 1, 2 and 4 devices. The tiny Llama has 2 KV heads, so at 4 devices
its K/V projections (and the adapters' K/V outputs) are repeated per device."""

import pytest

from tests.parallel.helpers import ENGINE, run_worker
from tests.reference import make_lora_adapter


@pytest.mark.slow  # ~35 s on 2 cores (three worker processes); LoRA alone and TP alone are
# in the default suite
def test_lora_tp_1_2_4_token_identical(tiny_checkpoints, tmp_path, tp_prompts):
    base = tiny_checkpoints["llama"]
    every = make_lora_adapter(base, str(tmp_path / "every"), rank=8, alpha=16, seed=21)
    attn = make_lora_adapter(base, str(tmp_path / "attn"), rank=4, alpha=8, seed=22,
                             target_modules=["k_proj", "v_proj", "o_proj"])
    result = run_worker("lora_tensor_parallel", dict(
        model=base, tp_sizes=[1, 2, 4], prompts=tp_prompts[:3] * 2, max_tokens=8,
        adapters=[every, attn, None, attn, every, None], engine=ENGINE))
    assert result["1"][0] != result["1"][2]  # the adapters change the outputs
    for tp in ("2", "4"):
        assert result[tp] == result["1"], f"tensor_parallel_size={tp}"
