"""Orbax save / restore of converted, sharded params: same tokens, any dividing TP size."""

import pytest

from tests.parallel.helpers import ENGINE, run_worker


@pytest.mark.slow
def test_orbax_round_trip(tp_checkpoints, tp_prompts, tmp_path):
    result = run_worker("checkpoint", dict(
        model=tp_checkpoints["llama"], tp=4, prompts=tp_prompts[:4], max_tokens=8,
        engine=ENGINE, path=str(tmp_path / "ckpt"), restore_tp=[4, 2]))
    assert "jaxpage_checkpoint.json" in result["files"] and "params" in result["files"]
    assert "tokenizer.json" in result["files"]
    for tp, tokens in result["restored"].items():
        assert tokens == result["expected"], f"restored at tensor_parallel_size={tp}"
    print(f"load from safetensors {result['load_s']:.3f}s, orbax restore {result['restore_s']:.3f}s")
