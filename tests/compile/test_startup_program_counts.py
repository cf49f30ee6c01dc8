"""How many programs an engine builds on a TPU or a GPU before it takes requests, and in all
(issue [16]: an 8B model compiled 315-382 bucket programs before its first token).

Counted, not compiled: ``AbstractEngine.program_set()`` is what ``jaxpage plan --buckets
warmup|all`` compiles and what ``LLM(warmup="ready")`` (the accelerator default) builds,
from the same ``core.batch.program_set``. The targets are tpu-inference's CI settings for
Llama-3.1-8B.
"""

from __future__ import annotations

import pytest

from jaxpage.config import EngineConfig
from jaxpage.parallel.targets import target_devices
from jaxpage.planning.abstract_engine import AbstractEngine

TARGET_SETTINGS = dict(model="preset:llama3-8b", dtype="bfloat16", max_num_seqs=256,
                       max_model_len=8192, max_num_batched_tokens=1024)


def _program_set(target: str, **overrides):
    config = EngineConfig.from_kwargs(**{**TARGET_SETTINGS, **overrides})
    return AbstractEngine(config, target_devices(target), num_kv_blocks=16_000).program_set()


@pytest.mark.parametrize("target", ["h100", "v6e:1x1", "v5e:1x1"])
def test_llama3_8b_ready_after_four_programs_forty_at_most_in_all(target):
    programs = _program_set(target)
    kinds = [key.kind for key in programs.ready]
    assert kinds == ["step", "decode", "move_blocks", "penalty_fill"]
    assert len(programs.all) <= 40, [k.label for k in programs.all]
    # the ready set is the largest of each kind: every other program's batches fit it
    for key in programs.background:
        assert any(ready.holds(key) for ready in programs.ready), key.label
    # one block-table width (the kernels read a sequence's blocks up to its length):
    # 8192 / 16 = 512 blocks
    assert {key.bucket[2] for key in programs.all if key.kind in ("step", "decode")} == {512}
    # the sum of the ladders, not their product: 7 token rungs (16 .. 1024) and 5 decode
    # rungs (16 .. 256), whose decode steps are steps of the token ladder
    steps = {key.bucket for key in programs.all if key.kind == "step"}
    decodes = {key.bucket for key in programs.all if key.kind == "decode"}
    assert sorted(t for t, _, _ in steps) == [16, 32, 64, 128, 256, 512, 1024]
    assert all(s == min(t, 256) for t, s, _ in steps)
    assert sorted(t for t, _, _ in decodes) == [16, 32, 64, 128, 256]
    assert {b[:2] for b in decodes} <= {b[:2] for b in steps}


def test_a_gpu_builds_both_sampling_variants_and_readies_the_device_decided_one():
    gpu, tpu = _program_set("h100"), _program_set("v6e:1x1")
    assert all(key.device_decided for key in gpu.ready if key.kind in ("step", "decode"))
    assert len(gpu.all) == 29 and len(tpu.all) == 17  # 12 model programs, twice on a GPU
    assert not any(key.device_decided for key in tpu.all)


def test_one_step_iteration_needs_no_decode_loop_and_speculation_readies_a_verify_step():
    plain = _program_set("v6e:1x1", num_scheduler_steps=1)
    assert [key.kind for key in plain.ready] == ["step", "move_blocks", "penalty_fill"]
    speculative = _program_set("v6e:1x1", num_scheduler_steps=1, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3})
    assert "verify" in [key.kind for key in speculative.ready]
