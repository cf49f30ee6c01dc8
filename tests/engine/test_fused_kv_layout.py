"""The whole engine on the TPU's fused KV layout, run on the CPU (``JAXPAGE_KV_LAYOUT``).

Everything that touches the cache (the model's writes and reads, copy-on-write copies of
shared prefixes, swaps to the host and back, byte formats) runs in the fused layout
here, through the reference kernels that read both layouts: greedy tokens must equal
Hugging Face's under chunked prefill and preemption, exactly as in the split layout.
"""

from __future__ import annotations

import pytest

from jaxpage import LLM, SamplingParams
from tests.engine.test_greedy_matches_hf import check_against_hf
from tests.options import TINY


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv("JAXPAGE_KV_LAYOUT", "fused")


def test_fused_cache_greedy_matches_hf_under_preemption(fused, tiny_checkpoints,
                                                       smollm2_tokenizer):
    check_against_hf(tiny_checkpoints["llama"], smollm2_tokenizer, max_tokens=16,
                     num_kv_blocks=24)


def _generate(path, **options):
    llm = LLM(path, **{**TINY, "num_kv_blocks": 24, "swap_space": 0.01,
                       "preemption_mode": "swap", **options})
    shared = list(range(5, 37))  # four blocks of 8 shared by every prompt: prefix caching
    prompts = [{"prompt_token_ids": shared + list(range(40 + i, 50 + 2 * i))}
               for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


# fp8 with the slow cases (~20 s each on 2 cores). Not int8: its fused cache rounds the 16
# value bytes that carry the scale codes coarser (kv_token_scale), and a tiny random
# model's nearly tied logits then pick other tokens: test_kv_cache_dtype checks it
@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("fp8", marks=pytest.mark.slow)])
def test_fused_and_split_caches_give_the_same_tokens(kv_cache_dtype, tiny_checkpoints,
                                                     monkeypatch):
    path = tiny_checkpoints["qwen2"]
    monkeypatch.setenv("JAXPAGE_KV_LAYOUT", "split")
    split_llm, split = _generate(path, kv_cache_dtype=kv_cache_dtype)
    monkeypatch.setenv("JAXPAGE_KV_LAYOUT", "fused")
    fused_llm, fused = _generate(path, kv_cache_dtype=kv_cache_dtype)
    runner = fused_llm.llm_engine.runner
    assert runner.kv_layout == "fused" and len(runner.kv_cache) == 1
    assert runner.kv_cache[0].ndim == 4
    stats = fused_llm.get_stats()
    assert stats["num_preemptions"] > 0  # the swaps moved fused blocks to the host and back
    assert fused == split
