"""Reading PEFT adapters: our layout equals PEFT's own delta, and whatever cannot be
applied exactly is refused with a ValueError naming it."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxpage.models.peft_adapter import load_peft_adapter
from jaxpage.models.registry import resolve_architecture
from tests.reference import load_hf_model, make_lora_adapter


@pytest.fixture(scope="module")
def arch(tiny_checkpoints):
    with open(f"{tiny_checkpoints['llama']}/config.json") as f:
        return resolve_architecture(json.load(f))[1]


def test_layout_and_scale_equal_peft_delta(tiny_checkpoints, tmp_path):
    import torch
    from peft import PeftModel

    base = tiny_checkpoints["llama"]
    for rslora in (False, True):
        path = make_lora_adapter(base, str(tmp_path / f"a{rslora}"), rank=4, alpha=12, seed=3,
                                 use_rslora=rslora)
        with open(f"{base}/config.json") as f:
            arch = resolve_architecture(json.load(f))[1]
        weights = load_peft_adapter(path, arch, max_rank=8)
        assert weights.rank == 4 and len(weights.weights) == 7 * arch.num_layers
        model = PeftModel.from_pretrained(load_hf_model(base), path)
        x = np.random.default_rng(0).standard_normal((3, 128)).astype(np.float32)
        for layer, target, width in ((1, "down_proj", 128), (2, "k_proj", 64)):
            module = model.base_model.model.model.layers[layer]
            module = getattr(module.mlp if target == "down_proj" else module.self_attn, target)
            inputs = torch.tensor(x[:, :width])
            with torch.no_grad():
                want = (module(inputs) - module.base_layer(inputs)).numpy()
            a, b = weights.weights[(layer, target)]
            np.testing.assert_allclose(x[:, :width] @ a @ b, want, rtol=1e-4, atol=1e-5)


def _write(path, config: dict, tensors: dict) -> str:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def _pair(module: str, rows: int, cols: int, layer: int = 0) -> dict:
    prefix = f"base_model.model.model.layers.{layer}.{module}"
    return {f"{prefix}.lora_A.weight": np.ones((2, cols), np.float32),
            f"{prefix}.lora_B.weight": np.ones((rows, 2), np.float32)}


@pytest.mark.parametrize("config, tensors, message", [
    ({"use_dora": True}, _pair("self_attn.q_proj", 64, 64), "use_dora"),
    ({"modules_to_save": ["lm_head"]}, _pair("self_attn.q_proj", 64, 64), "modules_to_save"),
    ({"bias": "lora_only"}, _pair("self_attn.q_proj", 64, 64), "bias"),
    ({"rank_pattern": {"q_proj": 4}}, _pair("self_attn.q_proj", 64, 64), "rank_pattern"),
    ({"peft_type": "IA3"}, _pair("self_attn.q_proj", 64, 64), "only LORA"),
    ({}, {"base_model.model.lm_head.lora_A.weight": np.ones((2, 64), np.float32)},
     "lm_head.lora_A"),
    ({}, _pair("self_attn.rotary", 64, 64), "module 'rotary'"),
    ({}, _pair("self_attn.q_proj", 64, 64, layer=7), "names layer 7"),
    ({}, _pair("self_attn.k_proj", 64, 64), "maps 64 -> 64 features, but the model's maps "
                                           "64 -> 32"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
          np.ones((2, 64), np.float32)}, "without its partner"),
    ({}, _pair("self_attn.q_proj", 64, 64) | {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.other.weight":
            np.ones((2, 64), np.float32)}, "more than one lora_A"),
    ({}, _pair("self_attn.q_proj", 64, 64) | {
        "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight": np.ones((32, 64), np.float32),
        "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight": np.ones((128, 32), np.float32)},
     "rank 32"),
])
def test_adapters_that_cannot_be_applied_exactly_are_refused(arch, tmp_path, config, tensors,
                                                              message):
    path = _write(tmp_path / "adapter", config, tensors)
    with pytest.raises(ValueError, match=message):
        load_peft_adapter(path, arch, max_rank=16)


def test_missing_or_pickled_adapter_files_are_refused(arch, tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        load_peft_adapter(str(tmp_path / "none"), arch, 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_peft_adapter(str(tmp_path / "empty"), arch, 8)
    (tmp_path / "empty" / "adapter_config.json").write_text('{"r": 2}')
    (tmp_path / "empty" / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="adapter_model.bin"):
        load_peft_adapter(str(tmp_path / "empty"), arch, 8)
