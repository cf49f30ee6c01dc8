"""``quantization="fp8"`` on a float checkpoint (vLLM's ``--quantization fp8``): the
decoder's linear weights quantized to float8 e4m3 as they load, one scale per output
channel, activations per token where the chip multiplies FP8.

The references are written here independently of jaxpage: torch's own float8 e4m3
conversion of each weight, Hugging Face run on those dequantized weights (what the CPU
computes: weight-only) and, for the W8A8 path an H100 takes, with every projection's input
quantized per token by a forward hook.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.reference import hf_logits, load_hf_model, round_projection_inputs_to_fp8

SOURCE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "quantized",
                      "float_source")
ENGINE = dict(max_model_len=64, max_num_seqs=2, num_kv_blocks=16, warmup=False)
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
IDS = [3, 17, 42, 9, 88, 5, 61, 23]


def _fp8_weight(weight):
    """torch [out, in] -> (e4m3 codes, float32 [out, 1] scales), per output channel."""
    import torch

    scale = weight.float().abs().amax(dim=1, keepdim=True) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (weight.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, scale


def _dequantized_copy(directory) -> str:
    """float_source with every projection's weight replaced by its FP8 dequantization."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(SOURCE, "model.safetensors"))
    out = {}
    for name, value in tensors.items():
        if name.split(".")[-2] in PROJECTIONS:
            codes, scale = _fp8_weight(value)
            value = codes.float() * scale
        out[name] = value.float().contiguous()
    os.makedirs(directory, exist_ok=True)
    save_file(out, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(SOURCE, "config.json")) as f:
        config = json.load(f)
    config["torch_dtype"] = "float32"
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


def _per_token_scale(_name, x):
    """max |x| / 448 per token (1 for an all-zero row), as the W8A8 path scales."""
    import torch

    s = x.float().abs().amax(dim=-1, keepdim=True) / 448.0
    return torch.where(s > 0, s, torch.ones_like(s))


def _logits(llm) -> np.ndarray:
    return np.asarray(llm.llm_engine.prompt_logits([{"prompt_token_ids": IDS}])[0])


def test_fp8_weights_are_torchs_e4m3_per_channel_and_run_weight_only_on_the_cpu(tmp_path):
    import torch
    from safetensors.torch import load_file

    from jaxpage import LLM, SamplingParams
    from pallas_kernels.quantized_matmul import unpack_panels
    from tests.reference import hf_greedy

    llm = LLM(model=SOURCE, quantization="fp8", **ENGINE)
    assert llm.get_stats()["quantization"] == "fp8"
    plan = llm.llm_engine.runner.quant_plan
    assert set(plan) == PROJECTIONS                       # embedding and LM head stay float
    assert all(f.codes == "fp8" and f.group_size is None and f.activations == "dynamic"
               for f in plan.values())
    stored = load_file(os.path.join(SOURCE, "model.safetensors"))
    codes, scale = _fp8_weight(stored["model.layers.1.mlp.down_proj.weight"])
    ours = unpack_panels(llm.llm_engine.runner.params["layers"][1]["down_proj"])
    np.testing.assert_array_equal(np.asarray(ours["codes"]).view(np.uint8),   # [in, out]
                                  codes.T.contiguous().view(torch.uint8).numpy())
    np.testing.assert_allclose(np.asarray(ours["scale"])[0], scale[:, 0].numpy(), rtol=1e-7)
    float_bytes = LLM(model=SOURCE, **ENGINE).get_stats()["weight_bytes"]
    assert llm.get_stats()["weight_bytes"] < 0.55 * float_bytes
    reference = load_hf_model(_dequantized_copy(tmp_path / "dequantized"))
    assert np.abs(_logits(llm) - hf_logits(reference, IDS)).max() < 1e-4
    out = llm.generate([{"prompt_token_ids": IDS}],
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(reference, IDS, 12, None)


def test_fp8_quantizes_activations_per_token_where_the_chip_has_fp8(tmp_path, monkeypatch):
    """The W8A8 program an H100 runs (emulated on the CPU: XLA's CPU dot takes FP8 codes)
    against Hugging Face with each projection's input quantized per token."""
    from jaxpage import LLM
    from pallas_kernels.quantized_matmul import activation_quant

    monkeypatch.setattr(activation_quant, "runs_natively",
                        lambda codes_dtype, groups, platform=None, device=None: groups == 1)
    reference = load_hf_model(_dequantized_copy(tmp_path / "dequantized"))
    weight_only = hf_logits(reference, IDS)
    round_projection_inputs_to_fp8(reference, _per_token_scale)
    expected = hf_logits(reference, IDS)
    assert np.abs(expected - weight_only).max() > 1e-2     # the activations' rounding shows
    logits = _logits(LLM(model=SOURCE, quantization="fp8", **ENGINE))
    assert np.abs(logits - expected).max() < 1e-4


def test_fp8_codes_are_kept_out_by_in_for_a_gpus_fp8_gemm():
    """An H100 multiplies the codes natively, so they are stored ``[out, in]`` (XLA:GPU
    transposed ``[in, out]`` FP8 codes on every call); a v5e, with no FP8 units, keeps the
    weight-only layout."""
    from jaxpage.models.prequantized import for_device
    from jaxpage.models.quantize import mode_plan, quantize
    from jaxpage.parallel.targets import target_devices

    dims = {"embed": (64, 100), "q_proj": (64, 64), "down_proj": (128, 64)}
    plan = mode_plan("fp8", dims)
    assert set(plan) == {"q_proj", "down_proj"}
    h100 = for_device(plan, target_devices("h100")[0])
    v5e = for_device(plan, target_devices("v5e:1x1")[0])
    assert all(f.transposed for f in h100.values()) and not any(f.transposed for f in v5e.values())
    w = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32)
    parts = quantize(w, h100["down_proj"])
    assert parts["codes_t"].shape == (64, 128) and "codes" not in parts
    np.testing.assert_array_equal(parts["codes_t"].T, quantize(w, v5e["down_proj"])["codes"])


def test_fp8_arguments_are_checked(tmp_path):
    from jaxpage import LLM

    with pytest.raises(ValueError, match="quantization_group_size=64 applies to 'int8'"):
        LLM(model=SOURCE, quantization="fp8", quantization_group_size=64, **ENGINE)
    ct_fp8 = os.path.join(os.path.dirname(SOURCE), "ct_fp8_dynamic")
    with pytest.raises(ValueError, match="quantized with 'compressed-tensors'"):
        LLM(model=ct_fp8, quantization="fp8", **ENGINE)


def test_fp8_models_save_and_restore_as_orbax_checkpoints(tmp_path):
    """An FP8 model, quantized as it loaded or read from a Hugging Face FP8 checkpoint,
    saved with ``save_sharded_checkpoint`` restores with the same codes (float8 in orbax),
    bytes and tokens, without quantizing again; a float orbax checkpoint quantizes to FP8
    as it loads, like the safetensors it came from."""
    from jaxpage import LLM, SamplingParams
    from tests.models.test_prequantized import hf_fp8_checkpoint

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": IDS}, {"prompt_token_ids": [100, 3, 3]}]

    def tokens(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]

    sources = {"online": (SOURCE, "fp8"),
               "stored": (hf_fp8_checkpoint(tmp_path / "hf", block=[32, 32]), None)}
    for name, (path, quantization) in sources.items():
        llm = LLM(model=path, quantization=quantization, **ENGINE)
        saved = llm.save_sharded_checkpoint(str(tmp_path / f"{name}_orbax"))
        restored = LLM(saved, **ENGINE)
        assert restored.get_stats()["quantization"] == "fp8", name
        assert restored.get_stats()["weight_bytes"] == llm.get_stats()["weight_bytes"], name
        assert restored.llm_engine.runner.quant_plan == llm.llm_engine.runner.quant_plan, name
        assert tokens(restored) == tokens(llm), name
    floats = LLM(model=SOURCE, **ENGINE).save_sharded_checkpoint(str(tmp_path / "float"))
    restored, direct = (LLM(floats, quantization="fp8", **ENGINE),
                        LLM(model=SOURCE, quantization="fp8", **ENGINE))
    assert restored.get_stats()["quantization"] == "fp8"
    assert restored.get_stats()["weight_bytes"] == direct.get_stats()["weight_bytes"]
    assert restored.llm_engine.runner.quant_plan == direct.llm_engine.runner.quant_plan
    restored_codes = restored.llm_engine.runner.params["layers"][0]["q_proj"]["codes"]
    direct_codes = direct.llm_engine.runner.params["layers"][0]["q_proj"]["codes"]
    np.testing.assert_array_equal(np.asarray(restored_codes).view(np.uint8),
                                  np.asarray(direct_codes).view(np.uint8))
    assert tokens(restored) == tokens(direct)
