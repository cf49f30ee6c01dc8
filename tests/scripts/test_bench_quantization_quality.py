"""bench_quantization_quality's options: ``kv_int8:fused`` measures the TPU's fused KV
layout (its int8 codes in the value bytes) and leaves the process's layout as it was."""

import os

import numpy as np
import pytest

import bench_quantization_quality as quality


@pytest.mark.slow  # ~25 s: SmolLM2 built twice (the fused engine path itself is in the
# default suite: tests/engine/test_kv_cache_dtype.py)
def test_the_fused_option_runs_in_the_fused_layout_and_restores_the_environment(
        monkeypatch, smollm2_path):
    monkeypatch.delenv("JAXPAGE_KV_LAYOUT", raising=False)
    seen = []
    real = quality._measure

    def measure(option, llm, *rest):
        seen.append(llm.llm_engine.runner.kv_layout)
        return real(option, llm, *rest)

    monkeypatch.setattr(quality, "_measure", measure)
    ids = list(range(200, 260))
    engine = dict(model=smollm2_path, max_model_len=96, max_num_seqs=2,
                  max_num_batched_tokens=64, num_kv_blocks=16)
    reference = quality.evaluate(None, [ids], None, engine)["_logprobs"]
    row = quality.evaluate("kv_int8:fused", [ids], reference, engine)
    assert seen == ["split", "fused"]
    assert "JAXPAGE_KV_LAYOUT" not in os.environ
    assert row["option"] == "kv_int8:fused" and row["tokens"] == len(ids) - 1
    assert 0.9 <= row["top1_agree"] <= 1.0 and np.isfinite(row["kl"])
