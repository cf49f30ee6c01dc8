"""``hf_overrides`` replaces Hugging Face config keys before the model is built (vLLM's name)."""

import json
import os

import pytest

from jaxpage import LLM, SamplingParams
from tests.options import TINY
from tests.reference import hf_greedy


def test_fewer_layers_match_hf_truncated_the_same_way(tiny_checkpoints):
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["qwen2"]
    llm = LLM(path, hf_overrides={"num_hidden_layers": 1}, **TINY)
    assert llm.llm_engine.arch.num_layers == 1
    assert llm.llm_engine.runner.kv_cache[0].shape[0] == 1  # one layer of KV cache
    hf = AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=1,
                                              dtype=torch.float32).eval()
    prompt = [5, 17, 230, 41, 9, 1000]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert out == hf_greedy(hf, prompt, 12, -1)


def test_bad_overrides_are_rejected(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"hf_overrides=\['num_hidden_layers'\] must be"):
        LLM(tiny_checkpoints["llama"], hf_overrides=["num_hidden_layers"])
    # an orbax checkpoint holds the architecture it was saved with
    saved = tmp_path / "saved"
    os.makedirs(saved)
    (saved / "jaxpage_checkpoint.json").write_text(json.dumps(
        {"format": 2, "hf_config": {"architectures": ["LlamaForCausalLM"]}, "dtype": "float32",
         "arch": {}, "tensor_parallel_size": 1}))
    with pytest.raises(ValueError, match="cannot change the architecture saved"):
        LLM(str(saved), hf_overrides={"num_hidden_layers": 1})
