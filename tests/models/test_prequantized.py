"""Pre-quantized checkpoints (compressed-tensors, Hugging Face FP8, AWQ, GPTQ) read as
stored, against Hugging Face loading the same folder.

The folders under ``tests/data/quantized/`` were made from one tiny random Llama by each
format's own tool (llm-compressor 0.14 / compressed-tensors 0.20, AutoAWQ 0.2.9,
GPTQModel 7.6) with ``scripts/make_quantized_checkpoints.py``, which also recorded
Hugging Face's logits and greedy tokens for them (``hf_reference.npz``: those tools do
not install beside this project's pins, so the reference is recorded, not recomputed).
Each test loads a folder through ``LLM(model=path)`` with no quantization argument.

Tolerances are Hugging Face's own rounding, measured by the script against an exact
float32 dequantization of the stored tensors (this random model is sensitive: logits
reach ~9): exact for compressed-tensors FP8 / int (0.0); GPTQModel's and AutoAWQ's torch
kernels round each weight to float16 (0.016-0.024); the asymmetric compressed-tensors
load (``dequantize=True``) rounds them to bfloat16 (0.14).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tests.reference import hf_logits, load_hf_model, round_projection_inputs_to_fp8

ROOT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "quantized")
ENGINE = dict(max_model_len=64, max_num_seqs=2, num_kv_blocks=16, warmup=False)

# fixture -> (method, logits tolerance against Hugging Face's)
FIXTURES = {
    "ct_w4a16_sym": ("compressed-tensors", 1e-4),
    "ct_w4a16_asym": ("compressed-tensors", 0.2),
    "ct_w8a16_g32": ("compressed-tensors", 1e-4),
    "awq_autoawq": ("awq", 0.05),
    "gptq_sym": ("gptq", 0.05),
    "gptq_asym": ("gptq", 0.05),
    "gptq_actorder": ("gptq", 0.05),
    "gptq_8bit": ("gptq", 0.05),
}
# W8A8: Hugging Face simulates the activation quantization on every platform, and so
# does jaxpage for compressed-tensors: natively where the chip multiplies 8-bit codes
# (FP8 on an H100, int8 on TPUs and GPUs), elsewhere by rounding the activations to their
# codes and back before a weight-only matmul (QuantFormat.emulated): the same logits
# to float32 rounding here (an input a ulp apart can round to another code; on these
# fixtures none does). (fixture, tolerance of the native product)
W8A8 = {"ct_fp8_static": 1e-4, "ct_fp8_dynamic": 1e-4,
        # int32 sums of int8 codes, scaled once, against Hugging Face's float32 sums of
        # the dequantized codes: a nearly tied code pair can round apart downstream
        "ct_w8a8_int8": 0.5}
# compressed-tensors activation schemes that never run natively here (emulated everywhere)
EMULATED_ONLY = ("ct_fp8_block",)   # FP8 per token and group of 32 inputs


def _reference(name: str) -> dict:
    with np.load(os.path.join(ROOT, name, "hf_reference.npz")) as data:
        return {key: data[key] for key in data.files}


def _logits_and_greedy(llm, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    from jaxpage import SamplingParams

    logits = np.asarray(llm.llm_engine.prompt_logits([{"prompt_token_ids": ids}])[0])
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    return logits, list(out.outputs[0].token_ids)


@pytest.mark.parametrize("name", list(FIXTURES))
def test_prequantized_checkpoint_gives_hugging_faces_logits_and_tokens(name):
    from jaxpage import LLM

    method, tolerance = FIXTURES[name]
    ref = _reference(name)
    llm = LLM(model=os.path.join(ROOT, name), **ENGINE)
    assert llm.get_stats()["quantization"] == method
    logits, greedy = _logits_and_greedy(llm, [int(t) for t in ref["token_ids"]])
    assert np.abs(logits - ref["logits"]).max() < tolerance, name
    assert greedy == [int(t) for t in ref["greedy"]], name


@pytest.fixture
def native_w8a8(monkeypatch):
    """The CPU running W8A8 checkpoints with quantized activations, as an H100 (FP8) or a
    TPU (int8) does: the same jnp program, emulated (XLA's CPU dots take 8-bit codes)."""
    from pallas_kernels.quantized_matmul import activation_quant

    monkeypatch.setattr(activation_quant, "runs_natively",
                        lambda codes_dtype, groups, platform=None, device=None: groups == 1)


@pytest.mark.parametrize("name", list(W8A8))
def test_w8a8_checkpoint_quantizes_activations_as_stored(name, native_w8a8):
    from jaxpage import LLM

    ref = _reference(name)
    llm = LLM(model=os.path.join(ROOT, name), **ENGINE)
    config = llm.llm_engine.runner.quant_plan["q_proj"]
    assert config.activations == ("static" if "static" in name else "dynamic")
    logits, greedy = _logits_and_greedy(llm, [int(t) for t in ref["token_ids"]])
    assert np.abs(logits - ref["logits"]).max() < W8A8[name], name
    if W8A8[name] < 1e-3:
        assert greedy == [int(t) for t in ref["greedy"]], name


def _dequantized_fp8_copy(source: str, directory) -> str:
    """The FP8 checkpoint folder ``source`` (one ``weight_scale`` per tensor, channel or
    block) with every weight dequantized (``weight * weight_scale``, written here independently of
    jaxpage's reader) as a plain float32 checkpoint in ``directory``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {}
    with safe_open(os.path.join(source, "model.safetensors"), "pt") as f:
        for key in f.keys():
            tensors[key] = f.get_tensor(key)
    out = {}
    for key, value in tensors.items():
        if key.endswith(("weight_scale", "input_scale")):
            continue
        if value.dtype == torch.float8_e4m3fn:
            scale = tensors[key + "_scale"].float()
            if scale.ndim == 2 and scale.shape[1] not in (1, value.shape[1]):   # blocks
                rows, cols = (-(-n // s) for n, s in zip(value.shape, scale.shape))
                scale = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
            value = value.float() * (scale if scale.ndim == 2 else scale.reshape(()))
        out[key] = value.float().contiguous()
    save_file(out, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    config["torch_dtype"] = "float32"
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


@pytest.mark.parametrize("name", [*W8A8, *EMULATED_ONLY])
def test_w8a8_checkpoint_rounds_its_activations_where_not_native(name, tmp_path):
    """On the CPU (no native W8A8 here) a compressed-tensors W8A8 checkpoint still
    quantizes its activations as stored, rounding them to their codes and back before the
    weight-only matmul: Hugging Face's logits and tokens, not those of the dequantized
    weights alone (which differ by whole logits on this model)."""
    from jaxpage import LLM

    ref = _reference(name)
    ids = [int(t) for t in ref["token_ids"]]
    llm = LLM(model=os.path.join(ROOT, name), **ENGINE)
    config = llm.llm_engine.runner.quant_plan["q_proj"]
    assert config.emulated
    assert config.activations == ("static" if "static" in name else
                                  "dynamic_group" if "block" in name else "dynamic")
    logits, greedy = _logits_and_greedy(llm, ids)
    assert np.abs(logits - ref["logits"]).max() < 1e-4, name
    assert greedy == [int(t) for t in ref["greedy"]], name
    if name.startswith("ct_fp8"):   # weight-only would be far off: the rounding happened
        weight_only = hf_logits(load_hf_model(_dequantized_fp8_copy(
            os.path.join(ROOT, name), tmp_path)), ids)
        assert np.abs(logits - weight_only).max() > 0.1, name


def test_act_order_by_group_gives_the_checkpoints_own_logits(tmp_path):
    """``ct_w4a16_sym`` rewritten as GPTQ act-order by group writes it (compressed-tensors
    < 0.20: ``actorder: "group"``, ``weight_g_idx``): each linear's groups renamed, so the
    rows' group labels run out of order and the scales are stored under the new labels.
    The same function, so the same logits as the fixture (and Hugging Face's)."""
    import torch
    from safetensors.torch import load_file, save_file

    from jaxpage import LLM

    folder = shutil.copytree(os.path.join(ROOT, "ct_w4a16_sym"), tmp_path / "model")
    tensors = load_file(str(folder / "model.safetensors"))
    rng = np.random.default_rng(7)
    for name in [key for key in tensors if key.endswith(".weight_scale")]:
        scale = tensors[name]                                          # [N, G]
        groups = scale.shape[1]
        label = torch.from_numpy(rng.permutation(groups))              # old group -> new
        k = int(tensors[name.replace("_scale", "_shape")][1])
        tensors[name] = scale[:, torch.argsort(label)]                 # stored by new label
        tensors[name.replace("_scale", "_g_idx")] = label.repeat_interleave(k // groups).int()
    save_file(tensors, str(folder / "model.safetensors"))
    with open(folder / "config.json") as f:
        config = json.load(f)
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["actorder"] = "group"
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    llm = LLM(model=str(folder), **ENGINE)
    assert llm.llm_engine.runner.quant_plan["o_proj"].act_order
    ref = _reference("ct_w4a16_sym")
    logits, greedy = _logits_and_greedy(llm, [int(t) for t in ref["token_ids"]])
    assert np.abs(logits - ref["logits"]).max() < 1e-4
    assert greedy == [int(t) for t in ref["greedy"]]


def test_quantization_argument_is_checked_against_the_checkpoint(tmp_path):
    from jaxpage import LLM

    gptq = os.path.join(ROOT, "gptq_sym")
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        LLM(model=gptq, quantization="awq", **ENGINE)
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        LLM(model=gptq, quantization="int8", **ENGINE)
    llm = LLM(model=gptq, quantization="gptq_marlin", **ENGINE)  # vLLM's kernel name: same method
    assert llm.get_stats()["quantization"] == "gptq"
    with pytest.raises(ValueError, match="quantization_group_size=64"):
        LLM(model=gptq, quantization_group_size=64, **ENGINE)
    with pytest.raises(ValueError, match="is not one"):
        LLM(model=os.path.join(ROOT, "float_source"), quantization="compressed-tensors", **ENGINE)


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "mxfp4"])
def test_an_unsupported_format_is_named_with_the_supported_ones(method, tmp_path):
    from jaxpage import LLM

    folder = shutil.copytree(os.path.join(ROOT, "float_source"), tmp_path / "model")
    with open(folder / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": method, "load_in_4bit": True}
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=f"'{method}'.*compressed-tensors, fp8, awq, gptq"):
        LLM(model=str(folder), **ENGINE)


def hf_fp8_checkpoint(directory, *, block, scale_fmt="float", scheme="dynamic") -> str:
    """``float_source`` quantized to Hugging Face's fine-grained FP8 by ``transformers``' own
    quantizer (``Fp8Quantize``, the op behind ``FineGrainedFP8Config``; it needs a GPU only
    to run the model, not to write it), the LM head kept in float as the format does. With
    ``scheme="static"`` every linear also gets a per-tensor ``activation_scale``."""
    import types

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=block, scale_fmt=scale_fmt,
                                  activation_scheme=scheme, modules_to_not_convert=["lm_head"])
    quantize = Fp8Quantize(types.SimpleNamespace(quantization_config=config))
    source = os.path.join(ROOT, "float_source")
    tensors = {}
    for name, value in load_file(os.path.join(source, "model.safetensors")).items():
        if not name.endswith("proj.weight"):
            tensors[name] = value
            continue
        tensors.update(quantize.convert({name: value}))
        if scheme == "static":
            tensors[name.replace(".weight", ".activation_scale")] = torch.tensor(0.01 * len(name))
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        hf_config = json.load(f)
    hf_config["quantization_config"] = json.loads(json.dumps(config.to_dict()))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return str(directory)


HF_FP8 = {"block32": dict(block=[32, 32]), "block32_ue8m0": dict(block=[32, 32], scale_fmt="ue8m0"),
          "per_tensor": dict(block=None), "per_tensor_static": dict(block=None, scheme="static")}


@pytest.mark.parametrize("case", list(HF_FP8))
def test_hf_fp8_checkpoint_gives_hugging_faces_logits_and_tokens(case, tmp_path):
    """A fine-grained FP8 checkpoint (block or per-tensor scales, float32 or power-of-two
    ue8m0 scales) through ``LLM(model=path)``: Hugging Face dequantizes it on the CPU, and
    so does jaxpage (no FP8 units): the same logits to float32 rounding and greedy tokens."""
    from jaxpage import LLM
    from tests.reference import hf_greedy

    path = hf_fp8_checkpoint(tmp_path / case, **HF_FP8[case])
    llm = LLM(model=path, **ENGINE)
    assert llm.get_stats()["quantization"] == "fp8"
    plan = llm.llm_engine.runner.quant_plan
    assert set(plan) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"}                     # the LM head stays float
    block = HF_FP8[case]["block"]
    assert plan["down_proj"].group_size == (block[1] if block else None)
    # per-tensor weights multiply FP8 activations where the chip can (W8A8), blocks never
    assert plan["q_proj"].activations == (None if block else HF_FP8[case].get("scheme",
                                                                               "dynamic"))
    ids = [3, 17, 42, 9, 88, 5, 61, 23]
    model = load_hf_model(path)
    logits, greedy = _logits_and_greedy(llm, ids)
    assert np.abs(logits - hf_logits(model, ids)).max() < 1e-4
    assert greedy == hf_greedy(model, ids, 12, None)


def test_hf_fp8_static_activations_are_read_as_stored(tmp_path, native_w8a8):
    """``activation_scheme: "static"``: each linear's stored ``activation_scale`` is the
    input scale its activations are quantized by where the chip multiplies FP8."""
    from jaxpage import LLM

    path = hf_fp8_checkpoint(tmp_path / "static", block=None, scheme="static")
    llm = LLM(model=path, **ENGINE)
    assert llm.llm_engine.runner.quant_plan["o_proj"].activations == "static"
    name = "model.layers.1.self_attn.o_proj.activation_scale"
    stored = 0.01 * len(name.replace(".activation_scale", ".weight"))
    o_proj = llm.llm_engine.runner.params["layers"][1]["o_proj"]
    assert float(np.asarray(o_proj["input_scale"]).reshape(-1)[0]) == pytest.approx(stored)


def test_hf_fp8_configs_and_shapes_are_checked(tmp_path):
    from jaxpage import LLM

    path = hf_fp8_checkpoint(tmp_path / "fp8", block=[32, 32])
    assert LLM(model=path, quantization="fp8", **ENGINE).get_stats()["quantization"] == "fp8"
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["fmt"] = "e4m3"      # as DeepSeek-V3 and Qwen3 -FP8 say
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    assert LLM(model=path, **ENGINE).get_stats()["quantization"] == "fp8"
    with pytest.raises(ValueError, match="quantized with 'fp8'"):
        LLM(model=path, quantization="awq", **ENGINE)
    # on a float checkpoint "fp8" quantizes as it loads (tests/models/test_fp8_online.py)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    for key, value, message in (("weight_block_size", [64, 64], r"weight scale has shape"),
                                ("weight_block_size", [32], "two positive integers"),
                                ("activation_scheme", "tensor", "activation_scheme='tensor'"),
                                ("scale_fmt", "e4m3", "scale_fmt='e4m3'"),
                                ("fmt", "e5m2", "FP8 weights in 'e5m2'")):
        changed = json.loads(json.dumps(config))
        changed["quantization_config"][key] = value
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(changed, f)
        with pytest.raises(ValueError, match=message):
            LLM(model=path, **ENGINE)


def autofp8_checkpoint(directory, *, scheme="static") -> str:
    """``float_source`` in the older AutoFP8 layout that vLLM reads as ``quant_method:
    "fp8"`` (neuralmagic's ``-FP8`` models): e4m3 ``weight`` with one ``weight_scale`` per
    tensor (``max |w| / 448``) and, for static activations, an ``input_scale`` per linear,
    written here with torch's own e4m3 conversion; the LM head in ``ignored_layers``."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name, value in load_file(os.path.join(ROOT, "float_source", "model.safetensors")).items():
        if not name.endswith("proj.weight"):
            tensors[name] = value
            continue
        scale = value.float().abs().max() / 448.0
        tensors[name] = (value.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name + "_scale"] = scale.reshape(())
        if scheme == "static":
            tensors[name.replace(".weight", ".input_scale")] = torch.tensor(0.004 + 0.0001 * len(name))
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(ROOT, "float_source", "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": scheme,
                                     "ignored_layers": ["lm_head"]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


def _hf_on_fp8_weights(path: str, directory, *, static_inputs: bool):
    """Hugging Face on the float32 weights an FP8 folder (one scale per tensor) stands for;
    with ``static_inputs`` each projection's input x also goes to e4m3(x / s) * s, s its
    stored ``input_scale`` (what a chip with FP8 units computes)."""
    from safetensors.torch import load_file

    model = load_hf_model(_dequantized_fp8_copy(path, directory))
    if static_inputs:
        stored = load_file(os.path.join(path, "model.safetensors"))
        round_projection_inputs_to_fp8(
            model, lambda name, _x: float(stored[f"{name}.input_scale"]))
    return model


def test_autofp8_checkpoint_reads_weight_scale_and_input_scale(tmp_path, monkeypatch):
    """The AutoFP8 layout under ``quant_method: "fp8"``: weight-only on the CPU, the logits
    of Hugging Face on the dequantized weights; with the activations quantized by the stored
    ``input_scale`` (the H100's W8A8, emulated on the CPU) those of Hugging Face with every
    projection's input divided by that scale, rounded to e4m3 and multiplied back."""
    from jaxpage import LLM
    from pallas_kernels.quantized_matmul import activation_quant

    path = autofp8_checkpoint(tmp_path / "autofp8")
    ids = [3, 17, 42, 9, 88, 5, 61, 23]
    llm = LLM(model=path, **ENGINE)
    assert llm.get_stats()["quantization"] == "fp8"
    assert llm.llm_engine.runner.quant_plan["q_proj"].activations == "static"
    weight_only = hf_logits(_hf_on_fp8_weights(path, tmp_path / "hf", static_inputs=False), ids)
    logits, _ = _logits_and_greedy(llm, ids)
    assert np.abs(logits - weight_only).max() < 1e-4
    monkeypatch.setattr(activation_quant, "runs_natively",
                        lambda codes_dtype, groups, platform=None, device=None: groups == 1)
    static = hf_logits(_hf_on_fp8_weights(path, tmp_path / "hf_static", static_inputs=True), ids)
    assert np.abs(static - weight_only).max() > 1e-2          # the activations' rounding shows
    logits, _ = _logits_and_greedy(LLM(model=path, **ENGINE), ids)
    assert np.abs(logits - static).max() < 1e-4


def test_hf_fp8_tensors_that_are_not_e4m3_or_lack_their_input_scale_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from jaxpage import LLM

    path = autofp8_checkpoint(tmp_path / "autofp8")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.input_scale"]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="no activation_scale or input_scale"):
        LLM(model=path, **ENGINE)
    import torch
    name = "model.layers.0.mlp.up_proj.input_scale"
    tensors[name] = torch.tensor(0.01)
    tensors["model.layers.0.mlp.up_proj.weight"] = (
        tensors["model.layers.0.mlp.up_proj.weight"].float().to(torch.float8_e5m2))
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj.weight is float8_e5m2.*must be float8 e4m3"):
        LLM(model=path, **ENGINE)
