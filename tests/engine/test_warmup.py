"""After warm-up, no workload compiles anything (counted through jax.monitoring)."""

import jax
import pytest

from jaxpage import BeamSearchParams, LLM, SamplingParams
from tests.engine.prompts import BASE


@pytest.fixture
def compile_events():
    events = []

    def listener(name, *args, **kwargs):
        if "compile" in name or "trace" in name or "cache_hit" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(listener)
    yield events
    jax.monitoring.clear_event_listeners()


def test_nothing_compiles_after_warmup(tiny_checkpoints, compile_events):
    llm = LLM(tiny_checkpoints["llama"], max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32, block_size=8, num_kv_blocks=16, swap_space=0.001,
              preemption_mode="swap", warmup=True)
    compiled = len(compile_events)
    assert compiled > 0  # the listener sees compilations at all
    compile_events.clear()
    params = [SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=20),
              SamplingParams(n=2, temperature=1.0, max_tokens=9, stop=[" the"]),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=16, repetition_penalty=1.3,
                             presence_penalty=0.5, frequency_penalty=-0.2)]
    prompts = [{"prompt_token_ids": [100 + 7 * i + j for j in range(3 + 5 * i)]} for i in range(8)]
    llm.generate(prompts, [params[i % 5] for i in range(8)], use_tqdm=False)
    llm.generate([BASE[0]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    llm.beam_search([BASE[0]], BeamSearchParams(beam_width=2, max_tokens=4))
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["num_swap_preemptions"] > 0
    assert compile_events == []


@pytest.mark.slow  # ~27 s; a draft model's warmup is test_draft_model.py's default case
def test_nothing_compiles_after_warmup_with_speculation(tiny_checkpoints, compile_events):
    llm = LLM(tiny_checkpoints["llama"], max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32, block_size=8, num_kv_blocks=32, warmup=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "disable_by_batch_size": 4})

    class Always:  # proposals of every length on every row
        count = 0

        def propose(self, request, max_tokens):
            self.count += 1
            return [5] * min(1 + self.count % 3, max_tokens)

    llm.llm_engine.scheduler.speculation.proposer = Always()
    compile_events.clear()
    prompts = [{"prompt_token_ids": [100 + 7 * i + j for j in range(3 + 5 * i)]} for i in range(6)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10 + 3 * i,
                             logprobs=1 if i == 3 else None) for i in range(6)]
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats()["spec_num_draft_tokens"] > 0
    assert compile_events == []
