"""``warmup="ready"`` (the accelerator default): the engine takes requests once the ready set
is built; the rest is built on the background thread, and until then a batch runs padded
in the smallest built program that holds it. No request ever waits for a compile: with
the background thread held back, a workload of every kind (chunked prefill, decodes of
every batch size, sampling, penalties, min_tokens, logprobs, n=2 forks, swap
preemption, a grammar, beam search) compiles and traces nothing at all, counted through jax.monitoring, and its tokens
equal a lazily compiled engine's (every batch in its own program)."""

import threading

import jax
import pytest

from jaxpage import BeamSearchParams, LLM, SamplingParams
from jaxpage.sampling_params import StructuredOutputsParams
from jaxpage.runtime import background_compile
from jaxpage.runtime.executable_cache import clear_shared_programs
from tests.engine.prompts import BASE

OPTIONS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
               num_kv_blocks=16, swap_space=0.001, preemption_mode="swap",
               compilation_cache=False)
PARAMS = [SamplingParams(temperature=0, max_tokens=12),
          SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=20),
          SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=9, stop=[" the"]),
          SamplingParams(temperature=0, max_tokens=30, min_tokens=5, ignore_eos=True),
          SamplingParams(temperature=0.7, seed=3, max_tokens=16, repetition_penalty=1.3,
                         presence_penalty=0.5, frequency_penalty=-0.2, logprobs=2)]
PROMPTS = [{"prompt_token_ids": [100 + 7 * i + j for j in range(3 + 5 * i)]} for i in range(8)]


def _workload(llm):
    outputs = llm.generate(PROMPTS, [PARAMS[i % 5] for i in range(8)], use_tqdm=False)
    tokens = [[list(c.token_ids) for c in o.outputs] for o in outputs]
    logprobs = [[c.logprobs is not None for c in o.outputs] for o in outputs]
    one = llm.generate([BASE[0]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    choice = llm.generate([BASE[1]], SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no", "maybe later"])), use_tqdm=False)
    assert choice[0].outputs[0].text in ("yes", "no", "maybe later")
    beams = llm.beam_search([BASE[0]], BeamSearchParams(beam_width=2, max_tokens=4))
    return tokens, logprobs, list(one[0].outputs[0].token_ids), \
        [b.tokens for b in beams[0].sequences]


@pytest.fixture
def compile_events():
    events = []

    def listener(name, *args, **kwargs):
        if "compile" in name or "trace" in name:
            events.append((name, threading.current_thread().name))

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(listener)
    yield events
    jax.monitoring.clear_event_listeners()


def test_ready_engine_compiles_nothing_on_the_request_path(tiny_checkpoints, compile_events):
    reference = _workload(LLM(tiny_checkpoints["llama"], warmup=False, **OPTIONS))

    gate = threading.Event()
    background_compile.submit(gate.wait)  # hold the background thread: nothing more is built
    try:
        llm = LLM(tiny_checkpoints["llama"], warmup="ready", **OPTIONS)
        engine = llm.llm_engine
        runner = engine.runner
        held = set(runner.executables.programs())
        # on the CPU the grammar-masked step is a program of its own (on accelerators the
        # device-decided step takes the mask: 4 programs there)
        assert {key.name.split("+")[0] for key in held} == {
            "step", "step-masked", "decode8", "move_blocks", "penalty_fill"}
        assert len(held) == 5
        compile_events.clear()
        got = _workload(llm)
        assert compile_events == []  # nothing compiled or traced for any request
        assert runner.fallback is not None and runner.fallback.num_padded > 0
        assert runner.fallback.requested  # the programs the padded batches wanted: asked for
        assert engine.get_stats()["num_swap_preemptions"] > 0
        assert set(runner.executables.programs()) == held  # still only the ready set
    finally:
        gate.set()
    assert got == reference

    # Once the background thread has built the rest, the fallback turns itself off and
    # every batch runs its own program, with the same tokens.
    done = threading.Event()
    background_compile.submit(done.set)
    assert done.wait(600)
    assert runner.fallback is None and runner.block_mover.built is None
    assert len(runner.executables.programs()) > len(held)
    assert _workload(llm) == reference
    main = [event for event in compile_events if event[1] != "jaxpage-compile"]
    assert main == []


def test_a_grammar_rides_in_the_device_decided_step_on_accelerators(tiny_checkpoints):
    """On accelerators (``StepPrograms.mask_in_device_step``) the device-decided step takes
    every batch's grammar mask (all tokens allowed without one), so structured outputs
    need no program outside the set; forced on here, the tokens equal the CPU's own
    ``step-masked`` programs'."""
    params = [SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
                  choice=["yes", "no", "maybe later"])),
              SamplingParams(temperature=0.8, top_k=5, seed=4, max_tokens=8),
              SamplingParams(temperature=0, max_tokens=8)]
    prompts = [BASE[0], BASE[1], BASE[2]]

    def run(in_step: bool):
        # the two variants share program names: nothing shared between them
        clear_shared_programs()
        llm = LLM(tiny_checkpoints["llama"], warmup=False, **OPTIONS)
        llm.llm_engine.runner.programs.mask_in_device_step = in_step
        outputs = llm.generate(prompts, params, use_tqdm=False)
        names = {key.name for key in llm.llm_engine.runner.executables.programs()}
        return [list(o.outputs[0].token_ids) for o in outputs], names

    cpu, cpu_names = run(False)
    folded, folded_names = run(True)
    assert folded == cpu
    assert any(name.startswith("step-masked") for name in cpu_names)
    assert not any(name.startswith("step-masked") for name in folded_names)
    clear_shared_programs()
