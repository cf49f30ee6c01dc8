"""Multi-LoRA serving against Hugging Face + PEFT, request by request.

Adapters are made locally with ``peft`` on the tiny Llama and Qwen2 checkpoints, with
random A and B (PEFT starts B at zero) so each really moves the outputs: different ranks
(4, 8, 16), alpha/r and rsLoRA scaling, attention-only and MLP-only targets. One batch
mixes all three adapters and the base model, with chunked prefill and preemption; every
request's greedy tokens equal ``generate`` of the base model with that adapter merged
(``merge_and_unload``).
"""

import numpy as np
import pytest

from jaxpage import LLM, LoRARequest, SamplingParams
from tests.conftest import assert_all_blocks_free
from tests.default_suite import every_nth
from tests.engine.prompts import BASE
from tests.engine.test_greedy_matches_hf import CONFIG
from tests.reference import (hf_greedy, load_hf_merged, load_hf_model, make_lora_adapter,
                             make_tiny_checkpoint)

ATTENTION, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> how it is made
    "every": dict(rank=8, alpha=16, seed=11, target_modules=ATTENTION + MLP),
    "attn": dict(rank=4, alpha=4, seed=12, target_modules=ATTENTION, use_rslora=True),
    "mlp": dict(rank=16, alpha=8, seed=13, target_modules=MLP),
}
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory) -> dict[str, dict[str, LoRARequest]]:
    """kind -> adapter name -> LoRARequest, for the tiny Llama and Qwen2."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for kind in ("llama", "qwen2"):
        out[kind] = {
            name: LoRARequest(name, i, make_lora_adapter(tiny_checkpoints[kind],
                                                         str(root / kind / name), **spec))
            for i, (name, spec) in enumerate(ADAPTERS.items(), start=1)}
    return out


def _references(base: str, loras: list[LoRARequest | None], prompt_ids, eos) -> list[list[int]]:
    models = {}
    out = []
    for lora, ids in zip(loras, prompt_ids):
        key = None if lora is None else lora.lora_path
        if key not in models:
            models[key] = load_hf_model(base) if lora is None else load_hf_merged(base, key)
        out.append(hf_greedy(models[key], ids, MAX_TOKENS, eos))
    return out


@pytest.mark.parametrize("kind", every_nth(["llama", "qwen2"], 2))  # qwen2: slow
def test_a_batch_mixing_three_adapters_and_the_base_model_equals_hf_merged(
        kind, tiny_checkpoints, adapters, smollm2_tokenizer):
    base = tiny_checkpoints[kind]
    cycle = [None, *adapters[kind].values()]
    loras = [cycle[i % len(cycle)] for i in range(len(BASE))]
    llm = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=16, num_kv_blocks=24,
              **CONFIG)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(BASE, params, lora_request=loras, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0  # the cache was too small for all at once
    prompt_ids = [smollm2_tokenizer(p).input_ids for p in BASE]
    eos = sorted(llm.llm_engine.eos_token_ids)
    expected = _references(base, loras, prompt_ids, eos)
    base_only = _references(base, [None] * len(BASE), prompt_ids, eos)
    for lora, out, want, plain in zip(loras, outputs, expected, base_only):
        assert out.outputs[0].token_ids == want, (lora, out.prompt)
    for lora in adapters[kind].values():  # each adapter really changes what is generated
        assert any(w != p for l, w, p in zip(loras, expected, base_only) if l == lora), lora
    assert llm.llm_engine.scheduler.lora.slots.num_loads == 3
    assert_all_blocks_free(llm)


def test_more_adapters_than_slots_are_swapped_in_lru_and_stay_exact(
        tiny_checkpoints, adapters, smollm2_tokenizer):
    base = tiny_checkpoints["llama"]
    names = list(adapters["llama"].values())
    loras = [names[i % 3] if i % 4 else None for i in range(12)]
    prompts = BASE[:12]
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, **CONFIG,
              num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    prompt_ids = [smollm2_tokenizer(p).input_ids for p in prompts]
    expected = _references(base, loras, prompt_ids, sorted(llm.llm_engine.eos_token_ids))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    slots = llm.llm_engine.scheduler.lora.slots
    assert slots.num_loads == 3 and sorted(slots.resident().values()) == [1, 2]
    # the adapter left out goes into the least recently used adapter's slot
    key_of = {llm.llm_engine.loras.get(lora).key: lora for lora in names}
    (lru_key, lru_slot), = list(slots.resident().items())[:1]
    missing, = [lora for key, lora in key_of.items() if key not in slots.resident()]
    again = llm.generate(prompts[:2], params, lora_request=missing, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == _references(
        base, [missing] * 2, prompt_ids[:2], sorted(llm.llm_engine.eos_token_ids))
    assert slots.num_loads == 4 and lru_key not in slots.resident()
    assert slots.slot_of(llm.llm_engine.loras.get(missing).key) == lru_slot
    assert_all_blocks_free(llm)


def test_the_same_prompt_under_two_adapters_never_shares_prefix_blocks(tiny_checkpoints,
                                                                       adapters, tmp_path):
    base = tiny_checkpoints["llama"]
    every, attn = adapters["llama"]["every"], adapters["llama"]["attn"]
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, **CONFIG,
              num_kv_blocks=64)
    prompt = {"prompt_token_ids": list(range(100, 160))}  # 7 full blocks of 8
    params = SamplingParams(temperature=0, max_tokens=4)

    def cached(lora):
        return llm.generate([prompt], params, lora_request=lora,
                            use_tqdm=False)[0].num_cached_tokens

    assert cached(every) == 0
    assert cached(attn) == 0      # same tokens, other adapter: no block is shared
    assert cached(None) == 0      # nor with the base model
    assert cached(every) == 56    # its own blocks are found again
    assert cached(None) == 56
    # unloaded and loaded again (perhaps new files): the old blocks are never matched
    assert llm.remove_lora("every")
    assert cached(every) == 0
    assert_all_blocks_free(llm)
    # a checkpoint saved from a LoRA engine holds the base model only
    base_tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    saved = LLM(llm.save_sharded_checkpoint(str(tmp_path / "saved")), **CONFIG,
                num_kv_blocks=64)
    assert saved.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == \
        base_tokens


def test_bad_adapter_requests_are_value_errors(tiny_checkpoints, adapters, tmp_path,
                                                smollm2_tokenizer):
    base = tiny_checkpoints["llama"]
    every = adapters["llama"]["every"]
    plain = LLM(base, **CONFIG, num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(["hi"], lora_request=every, use_tqdm=False)
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8, **CONFIG, num_kv_blocks=64)
    mlp = adapters["llama"]["mlp"]  # rank 16
    with pytest.raises(ValueError, match="rank 16.*max_lora_rank=8"):
        llm.generate(["hi"], lora_request=mlp, use_tqdm=False)
    with pytest.raises(ValueError, match="is not a directory"):
        llm.generate(["hi"], lora_request=LoRARequest("x", 9, str(tmp_path / "nope")),
                     use_tqdm=False)
    narrow = make_tiny_checkpoint("llama", str(tmp_path / "narrow"), smollm2_tokenizer,
                                  hidden_size=32, intermediate_size=64)
    other = make_lora_adapter(narrow, str(tmp_path / "other"), rank=4, alpha=4, seed=1)
    with pytest.raises(ValueError, match="not an adapter of this model"):
        llm.generate(["hi"], lora_request=LoRARequest("q", 7, other), use_tqdm=False)
    llm.add_lora(every)
    with pytest.raises(ValueError, match="remove it first"):
        llm.generate(["hi"], lora_request=LoRARequest("every", 5, every.lora_path),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="one LoRARequest or one per prompt"):
        llm.generate(["a", "b"], lora_request=[every], use_tqdm=False)
    assert [r.lora_name for r in llm.list_loras()] == ["every"]
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "p")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=1)
    # the engine still runs after every refusal, with nothing queued or held
    assert len(llm.generate(["hi"], lora_request=every, use_tqdm=False)) == 1
    assert_all_blocks_free(llm)


FUSED_AND_EXPERT = {  # family -> (checkpoint shape, adapted modules as the checkpoint names them)
    "phi3": (dict(pad_token_id=0), ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"]),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
                ["q_proj", "v_proj", "o_proj"]),
}


@pytest.mark.parametrize("kind", sorted(FUSED_AND_EXPERT))
def test_fused_projection_and_moe_adapters_equal_hf_merged(kind, tmp_path, smollm2_tokenizer):
    """Phi-3's fused qkv / gate_up adapters are split like its weights; a Mixtral adapter
    on the attention of a mixture-of-experts model."""
    shape, targets = FUSED_AND_EXPERT[kind]
    base = make_tiny_checkpoint(kind, str(tmp_path / "base"), smollm2_tokenizer, seed=5, **shape)
    lora = LoRARequest("a", 1, make_lora_adapter(base, str(tmp_path / "a"), rank=4, alpha=8,
                                                 seed=6, target_modules=targets))
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=4, **CONFIG, num_kv_blocks=64)
    prompts = BASE[:4]
    loras = [lora, None, lora, lora]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           lora_request=loras, use_tqdm=False)
    prompt_ids = [smollm2_tokenizer(p).input_ids for p in prompts]
    eos = sorted(llm.llm_engine.eos_token_ids)
    expected = _references(base, loras, prompt_ids, eos)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert expected[0] != _references(base, [None], prompt_ids[:1], eos)[0]


def test_adapters_under_ngram_speculation_and_beam_width_equal_plain(tiny_checkpoints, adapters):
    """Verify steps carry several tokens per row (each row's adapter over all of them),
    and n > 1 siblings run with their leader's adapter."""
    base = tiny_checkpoints["llama"]
    loras = [adapters["llama"]["every"], None, adapters["llama"]["mlp"], adapters["llama"]["attn"]]
    prompts = BASE[:4]
    greedy = SamplingParams(temperature=0, max_tokens=40)  # long enough to repeat itself
    options = dict(enable_lora=True, max_loras=3, max_lora_rank=16, **CONFIG, num_kv_blocks=64)
    plain = LLM(base, **options)
    want = [o.outputs[0].token_ids
            for o in plain.generate(prompts, greedy, lora_request=loras, use_tqdm=False)]
    spec = LLM(base, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1, "disable_by_batch_size": 16},
               **options)
    got = spec.generate(prompts, greedy, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert spec.get_stats()["spec_num_draft_tokens"] > 0
    sampled = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8)
    pair = plain.generate(prompts[:1], sampled, lora_request=loras[:1], use_tqdm=False)[0]
    alone = plain.generate(prompts[:1], SamplingParams(temperature=1.0, seed=3, max_tokens=8),
                           lora_request=loras[:1], use_tqdm=False)[0]
    assert pair.outputs[0].token_ids == alone.outputs[0].token_ids  # the leader's stream
    assert_all_blocks_free(plain)
    assert_all_blocks_free(spec)
