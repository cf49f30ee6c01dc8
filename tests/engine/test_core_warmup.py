"""The CPU's default warm-up ("core"): exactly the full prefill step and the decode
programs of every seat rung are compiled at construction and run once on a throwaway
batch (no block held, no token changed), never compiled twice."""

import pytest

from jaxpage import LLM, SamplingParams
from jaxpage.engine.startup import warmup
from jaxpage.engine.startup.warmup import WARMUP_ENV, resolve_warmup

# An engine shape no other test builds (num_kv_blocks is part of the programs' fingerprint),
# so the process's shared programs hold none of these before the first engine.
ENGINE = dict(max_model_len=96, max_num_seqs=16, max_num_batched_tokens=64, block_size=8,
              num_kv_blocks=53, num_scheduler_steps=4)


def test_resolve_warmup(monkeypatch):
    monkeypatch.delenv(WARMUP_ENV, raising=False)
    assert resolve_warmup(True, "cpu") == "all"
    assert resolve_warmup(False, "tpu") == "none"
    assert resolve_warmup("core", "gpu") == "core"
    assert resolve_warmup(None, "cpu") == "core"
    assert resolve_warmup(None, "tpu") == "ready"
    assert resolve_warmup("ready", "cpu") == "ready"
    monkeypatch.setenv(WARMUP_ENV, "none")
    assert resolve_warmup(None, "cpu") == "none"
    assert resolve_warmup(True, "cpu") == "all"  # an explicit choice wins over the variable
    monkeypatch.setenv(WARMUP_ENV, "fast")
    with pytest.raises(ValueError, match="'fast'"):
        resolve_warmup(None, "cpu")


def test_a_bad_warmup_option_is_a_value_error(tiny_checkpoints):
    with pytest.raises(ValueError, match="warmup='fast'"):
        LLM(tiny_checkpoints["llama"], warmup="fast")


def test_core_warmup_compiles_exactly_the_core_programs(tiny_checkpoints, monkeypatch):
    ran = []
    first_run = warmup.first_run
    monkeypatch.setattr(warmup, "first_run", lambda engine, shape, steps: (
        ran.append((*shape, steps)), first_run(engine, shape, steps)))
    llm = LLM(tiny_checkpoints["llama"], warmup="core", **ENGINE)
    engine = llm.llm_engine
    executables = engine.runner.executables
    (width,) = engine.batch_builder.block_ladder.rungs  # the CPU kernel's single width
    # Token rungs 16..64: the full step seats 64 / 8 = 8; a full batch (16 seats) at the
    # rungs of at least 16 tokens. Decode seats: 1 alone, 8 for 2-8 sequences, 16 for
    # 9-16; each a 4-iteration decode loop. All are the programs of greedy and plain
    # sampling that the host picks on the CPU (``core.batch.step_features``: "+sampled").
    step, decode = "step+sampled", "decode4+sampled"
    held = lambda: {(key.name, key.bucket) for key in executables.programs()}  # noqa: E731
    assert held() == {
        (step, (64, 8, width)), (step, (64, 16, width)), (step, (32, 16, width)),
        (step, (16, 16, width)), (decode, (16, 16, width)), (decode, (8, 8, width)),
        (decode, (1, 1, width))}
    assert executables.num_compiled == 7
    # Each ran once (``first_run``), on a batch holding no request: no block is held.
    assert sorted(ran) == sorted([
        (64, 8, width, 1), (64, 16, width, 1), (32, 16, width, 1), (16, 16, width, 1),
        (16, 16, width, 4), (8, 8, width, 4), (1, 1, width, 4)])
    assert engine.num_used_blocks() == 0

    # A second engine of the same shape finds them all (here shared in memory; on disk
    # across processes) and compiles nothing.
    again = LLM(tiny_checkpoints["llama"], warmup="core", **ENGINE)
    assert again.llm_engine.runner.executables.num_compiled == 0

    # Running a workload uses the core programs as built: every program is compiled once,
    # and the tokens equal an engine that warmed nothing up.
    prompts = [{"prompt_token_ids": [100 + 7 * i + j for j in range(5 + 5 * i)]} for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(12)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert {(decode, (8, 8, width)), (decode, (1, 1, width))} <= held()
    assert executables.num_compiled == len(held())
    cold = LLM(tiny_checkpoints["llama"], warmup=False, **dict(ENGINE, num_kv_blocks=54))
    assert cold.llm_engine.runner.executables.programs() == {}
    expected = cold.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert engine.num_used_blocks() == 0
