#!/usr/bin/env python3
"""Tiny pre-quantized Llama checkpoints, each made by its format's own tool, with HF reference outputs.

Writes ``tests/data/quantized/<name>/`` for every checkpoint below. Each folder holds what the
tool saved (``config.json`` with its ``quantization_config``, ``model.safetensors``,
``generation_config.json`` and the tool's own side files ``quantize_config.json`` or
``recipe.yaml`` where it writes one; tokenizer files and logs are dropped) plus
``hf_reference.npz``:

* ``token_ids`` int32 [16]: the fixed prompt (:data:`TOKEN_IDS`);
* ``logits`` float32 [16, 256]: Hugging Face transformers' logits for that prompt, from
  ``AutoModelForCausalLM.from_pretrained(<that very folder>, dtype=torch.float32, ...)`` on the CPU;
* ``greedy`` int32 [12]: ``generate`` greedy continuation (``do_sample=False``, exactly 12 new
  tokens, no EOS stop), cross-checked against a cache-free argmax loop;
* ``hf_load``: how the folder was loaded (call, Linear class after loading, precision notes);
* ``versions``: the quantizing tool and libraries, and those that made the reference.

The base model, ``float_source/``, is a random ``LlamaForCausalLM`` (hidden 64, intermediate 128,
2 layers, 4 heads, 2 KV heads, vocab 256, untied ``lm_head``, ``initializer_range`` 0.3 so the
logits are far from flat, ``torch.manual_seed(0)``, saved in bfloat16). Every group size is 32,
which divides every Linear's input size (64 or 128).

=================  ==============  ===============================================================
name               tool            format
=================  ==============  ===============================================================
float_source       transformers    the bf16 model everything else was quantized from
ct_fp8_static      llmcompressor   compressed-tensors float-quantized: FP8 per-tensor weights,
                                   static per-tensor FP8 input scales (preset ``FP8``, calibrated)
ct_fp8_dynamic     llmcompressor   FP8 per-channel weights, dynamic per-token FP8 activations
ct_fp8_block       llmcompressor   FP8 weights per 32 x 32 block, dynamic FP8 activations per token
                                   and group of 32 (``FP8_BLOCK``'s scheme, scaled down)
ct_w4a16_sym       llmcompressor   pack-quantized int4, group 32, symmetric
ct_w4a16_asym      llmcompressor   pack-quantized int4, group 32, with ``weight_zero_point``
ct_w8a16_g32       llmcompressor   pack-quantized int8, group 32, symmetric
ct_w8a8_int8       llmcompressor   int-quantized: int8 per-channel weights, dynamic per-token int8
                                   activations (preset ``W8A8``)
awq_autoawq        AutoAWQ         ``quant_method: awq``, GEMM packing, 4 bit, group 32, zero point
gptq_sym           GPTQModel       ``quant_method: gptq`` v1, 4 bit, group 32, symmetric
gptq_asym          GPTQModel       as above, asymmetric
gptq_actorder      GPTQModel       as ``gptq_sym`` with ``desc_act=True`` (non-trivial ``g_idx``)
gptq_8bit          GPTQModel       8 bit, group 32, symmetric
=================  ==============  ===============================================================

How HF loads each folder for the reference (all on the CPU, ``dtype=torch.float32``):

* compressed-tensors: the default route (weights stay compressed and are dequantized on the fly,
  activations fake-quantized as the config says), except ``ct_w4a16_asym``: transformers 5.24
  cannot load asymmetric pack-quantized checkpoints by default (``weight_zero_point`` shape
  mismatch, vllm-project/llm-compressor#1618), so it uses
  ``quantization_config=CompressedTensorsConfig(dequantize=True)``, which builds dense weights
  (rounded to bfloat16, the scales' dtype); the scheme has no activation quantization to lose.
* GPTQ and AWQ load through GPTQModel's kernels. The default CPU kernels (``TorchAtenLinear``,
  ``TorchAtenAwqLinear``) run every matmul in bfloat16 whatever ``dtype`` says, so the
  reference asks for GPTQModel's pure-torch
  kernels instead: ``GPTQConfig(bits=..., backend="torch")`` and ``AwqConfig(bits=4,
  backend="torch_awq")`` (the rest of the saved quantization config is kept). They dequantize in
  the scales' dtype (float16) and multiply in float32.

Precision of the references, measured against an exact float32 dequantization of the stored
tensors: compressed-tensors default loads are bit-exact (activation fake-quant included, done in
float32); ``ct_w4a16_asym`` (weights rounded to bfloat16) about 0.14 logits off; GPTQ and AWQ (weights
rounded to float16) about 0.02 off (the aten kernels would be about 0.2 off). This random model
is sensitive: 1e-4 relative noise on the float weights moves its logits (|max| about 9) by about
0.02, and its int4 checkpoints differ from the float model by up to 7 logits.

Tool environments (CPU only, no Hub access needed; ``C`` is a constraints file holding
``torch==2.13.0`` and ``transformers==5.24.0``):

Main venv (compressed-tensors, GPTQ, and the HF references of everything, AWQ included)::

    python3 -m venv /tmp/qtools-venv
    /tmp/qtools-venv/bin/pip install torch==2.13.0                     # the CPU build, 2.13.0+cpu
    /tmp/qtools-venv/bin/pip install -c C transformers==5.24.0 safetensors accelerate numpy
    /tmp/qtools-venv/bin/pip install -c C compressed-tensors              # 0.20.0
    # every llmcompressor release pins transformers<=5.17 and compressed-tensors==0.19, so pip
    # cannot resolve it; without its pins it works with transformers 5.24 / compressed-tensors 0.20:
    /tmp/qtools-venv/bin/pip install -c C --no-deps llmcompressor==0.14.0.1
    /tmp/qtools-venv/bin/pip install -c C auto-round==0.15.1 datasets nvidia-ml-py pillow requests py-cpuinfo
    /tmp/qtools-venv/bin/pip install -c C gptqmodel                       # 7.6.0 (7.7 needs torch>=2.14.1)
    /tmp/qtools-venv/bin/pip install -c C optimum                         # HF needs it to load GPTQ

AWQ venv (AutoAWQ pulls triton; kept apart from the main venv)::

    python3 -m venv /tmp/qtools-awq-venv
    /tmp/qtools-awq-venv/bin/pip install torch==2.13.0                 # the CPU build, 2.13.0+cpu
    /tmp/qtools-awq-venv/bin/pip install -c C transformers==5.24.0 safetensors accelerate numpy
    /tmp/qtools-awq-venv/bin/pip install -c C autoawq                     # 0.2.9

Tool quirks handled here: llmcompressor's ``oneshot`` wants a model loaded from a folder (it
reloads ``config._name_or_path``) that also holds a tokenizer when given a dataset, so the float
model is staged in a scratch folder with a small word-level tokenizer (``t0`` .. ``t255``);
GPTQModel on a 2-core machine needs ``GPTQMODEL_CPU_WORKERS=2`` (set below); AutoAWQ's clip
search asserts ``out_features % 64 == 0`` (k/v_proj have 32), so it runs with
``apply_clip=False``, and it drops calibration rows longer than ``max_calib_seq_len``, so the rows
are token-id lists of exactly that length. Tools run with the scratch folder as the working
directory, so their logs do not land in the repository.

Run, from the repository root (the first command rewrites ``float_source`` and all but AWQ; the
second quantizes with AutoAWQ from that same ``float_source``; the third records AWQ's reference
in the main venv, whose GPTQModel provides the AWQ kernels transformers needs)::

    /tmp/qtools-venv/bin/python scripts/make_quantized_checkpoints.py
    /tmp/qtools-awq-venv/bin/python scripts/make_quantized_checkpoints.py --only awq_autoawq
    /tmp/qtools-venv/bin/python scripts/make_quantized_checkpoints.py --reference-only awq_autoawq
    /tmp/qtools-venv/bin/python scripts/make_quantized_checkpoints.py --verify

``--only NAME ...`` makes just those (quantized ones start from the existing ``float_source``),
``--reference-only NAME ...`` rewrites just ``hf_reference.npz`` of existing folders, and
``--verify`` checks every ``hf_reference.npz`` with numpy alone (every run ends with that check and
the total size). ``--threads N`` caps torch's CPU threads. All three runs take about a minute on
two CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

# GPTQModel sizes its CPU worker pools from this; its default (1) is below what its model loader
# asks for on a 2-core machine. Must be set before gptqmodel is imported.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "quantized"

MODEL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    initializer_range=0.3,
)
SEED = 0
GROUP_SIZE = 32
TOKEN_IDS = [1, 5, 9, 17, 33, 65, 129, 200, 7, 3, 99, 150, 42, 250, 11, 64]
NEW_TOKENS = 12
CALIB_ROWS, CALIB_LEN = 16, 32
REFERENCE_FILE = "hf_reference.npz"

# What is copied from a tool's output folder; everything else (tokenizer, logs) is dropped.
KEEP_FILES = ("config.json", "generation_config.json", "quantize_config.json", "quant_config.json",
              "recipe.yaml", "model.safetensors.index.json")
TOOL_PACKAGES = {"transformers": "transformers", "llmcompressor": "llmcompressor", "gptqmodel": "gptqmodel",
                 "awq": "autoawq"}  # importable module -> distribution name
VERSION_PACKAGES = ("torch", "transformers", "safetensors", "numpy", "compressed-tensors",
                    "llmcompressor", "gptqmodel", "optimum", "autoawq")


# ----------------------------------------------------------------------------- fixtures


@dataclass(frozen=True)
class Fixture:
    """One checkpoint: how the tool makes it and how HF loads it for the reference."""

    name: str
    tool: str  # the importable module that quantizes it
    quantize: Callable[[Path, Path], None] | None  # (staged float folder, tool output folder)
    reference: str  # how HF loads it: "plain", "ct_dequantize", "gptq" or "awq" (see reference_load)
    note: str  # what the reference load does with this format
    bits: int = 4


def _ct_group_recipe(num_bits: int, symmetric: bool) -> Any:
    """A weight-only int ``num_bits`` group-32 recipe (the presets use group 128 > in_features)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    weights = QuantizationArgs(num_bits=num_bits, type="int", strategy="group", group_size=GROUP_SIZE,
                               symmetric=symmetric, dynamic=False)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    return QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])


def _ct_fp8_block_recipe() -> Any:
    """FP8 weights per block of 32 x 32 and FP8 activations per token and group of 32, dynamic:
    the ``FP8_BLOCK`` preset's scheme at this model's size (the preset's 128 > in_features)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    weights = QuantizationArgs(num_bits=8, type="float", strategy="block",
                               block_structure=[GROUP_SIZE, GROUP_SIZE], symmetric=True, dynamic=False)
    inputs = QuantizationArgs(num_bits=8, type="float", strategy="group", group_size=GROUP_SIZE,
                              symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    return QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])


def _ct_preset_recipe(scheme: str) -> Callable[[], Any]:
    """A recipe factory for one of llmcompressor's preset schemes (all Linears but lm_head)."""

    def make() -> Any:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])

    return make


def llmcompressor_quantizer(recipe: Callable[[], Any],
                            calibrate: bool = False) -> Callable[[Path, Path], None]:
    """Round-to-nearest weights with llmcompressor ``oneshot``; ``calibrate`` feeds it random token rows
    (needed for static activation scales)."""

    def run(src: Path, out: Path) -> None:
        import torch
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        kwargs: dict[str, Any] = {}
        if calibrate:
            from datasets import Dataset

            rows = calibration_rows().tolist()
            data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * CALIB_LEN] * CALIB_ROWS})
            kwargs = dict(dataset=data, num_calibration_samples=CALIB_ROWS, max_seq_length=CALIB_LEN)
        oneshot(model=model, recipe=recipe(), **kwargs)
        model.save_pretrained(out, save_compressed=True)

    return run


def gptqmodel_quantizer(bits: int, sym: bool, desc_act: bool) -> Callable[[Path, Path], None]:
    """GPTQ (v1 checkpoint format) with GPTQModel on the CPU, group 32."""

    def run(src: Path, out: Path) -> None:
        from gptqmodel import GPTQModel, QuantizeConfig

        extra = {"act_group_aware": False} if desc_act else {}  # desc_act turns it off anyway
        config = QuantizeConfig(bits=bits, group_size=GROUP_SIZE, sym=sym, desc_act=desc_act, **extra)
        model = GPTQModel.load(str(src), config, device="cpu")
        rows = [{"input_ids": row, "attention_mask": [1] * CALIB_LEN} for row in calibration_rows().tolist()]
        model.quantize(rows, batch_size=1)
        model.save(str(out))

    return run


def autoawq_quantize(src: Path, out: Path) -> None:
    """AWQ (GEMM packing, 4 bit, group 32, zero points) with AutoAWQ on the CPU."""
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    model = AutoAWQForCausalLM.from_pretrained(str(src))
    model.quantize(
        AutoTokenizer.from_pretrained(src),
        quant_config={"zero_point": True, "q_group_size": GROUP_SIZE, "w_bit": 4, "version": "GEMM"},
        calib_data=calibration_rows().tolist(),  # token-id rows of exactly max_calib_seq_len
        max_calib_seq_len=CALIB_LEN,
        max_calib_samples=CALIB_ROWS,
        n_parallel_calib_samples=4,
        apply_clip=False,  # the clip search asserts out_features % 64 == 0; k/v_proj have 32
    )
    model.save_quantized(str(out))


_CT_DEFAULT = ("compressed-tensors keeps the weights compressed and dequantizes them on the fly in float32 "
               "(q * scale, exact)")
_GPTQ_TORCH = ("GPTQModel's pure-torch GPTQ kernel dequantizes in float16 (the scales' dtype, so the "
               "weights are float16-rounded) and multiplies in float32; the default TorchAtenLinear "
               "would run the matmuls in bfloat16")
FIXTURES = {f.name: f for f in [
    Fixture("float_source", "transformers", None, "plain", "the bf16 source model, upcast to float32"),
    Fixture("ct_fp8_static", "llmcompressor",
            llmcompressor_quantizer(_ct_preset_recipe("FP8"), calibrate=True),
            "plain", _CT_DEFAULT + " and fake-quantizes each Linear input to FP8 e4m3 with its stored "
            "per-tensor input_scale"),
    Fixture("ct_fp8_dynamic", "llmcompressor", llmcompressor_quantizer(_ct_preset_recipe("FP8_DYNAMIC")),
            "plain", _CT_DEFAULT + " and fake-quantizes each Linear input to FP8 e4m3 with a dynamic "
            "per-token scale (amax / 448)"),
    Fixture("ct_fp8_block", "llmcompressor", llmcompressor_quantizer(_ct_fp8_block_recipe),
            "plain", _CT_DEFAULT + " and fake-quantizes each Linear input to FP8 e4m3 with a dynamic "
            "scale per token and group of 32 inputs (amax / 448)", bits=8),
    Fixture("ct_w4a16_sym", "llmcompressor", llmcompressor_quantizer(lambda: _ct_group_recipe(4, True)),
            "plain", _CT_DEFAULT + " (weight-only, no activation quantization)"),
    Fixture("ct_w4a16_asym", "llmcompressor", llmcompressor_quantizer(lambda: _ct_group_recipe(4, False)),
            "ct_dequantize", "the default load fails in transformers 5.24 (weight_zero_point shape "
            "mismatch, vllm-project/llm-compressor#1618); dequantize=True builds dense nn.Linear weights, "
            "computed in the bfloat16 scale dtype and so bfloat16-rounded, then held in float32 "
            "(weight-only scheme)"),
    Fixture("ct_w8a16_g32", "llmcompressor", llmcompressor_quantizer(lambda: _ct_group_recipe(8, True)),
            "plain", _CT_DEFAULT + " (weight-only, no activation quantization)", bits=8),
    Fixture("ct_w8a8_int8", "llmcompressor", llmcompressor_quantizer(_ct_preset_recipe("W8A8")),
            "plain", _CT_DEFAULT + " and fake-quantizes each Linear input to int8 with a dynamic "
            "per-token symmetric scale (amax / 127.5, round half to even)", bits=8),
    Fixture("awq_autoawq", "awq", autoawq_quantize, "awq",
            "GPTQModel's pure-torch AWQ kernel dequantizes in float16 (the scales' dtype, so the weights "
            "are float16-rounded) and multiplies in float32; the default TorchAtenAwqLinear would run the "
            "matmuls in bfloat16"),
    Fixture("gptq_sym", "gptqmodel", gptqmodel_quantizer(4, sym=True, desc_act=False), "gptq", _GPTQ_TORCH),
    Fixture("gptq_asym", "gptqmodel", gptqmodel_quantizer(4, sym=False, desc_act=False), "gptq", _GPTQ_TORCH),
    Fixture("gptq_actorder", "gptqmodel", gptqmodel_quantizer(4, sym=True, desc_act=True), "gptq",
            _GPTQ_TORCH + "; groups are looked up through g_idx"),
    Fixture("gptq_8bit", "gptqmodel", gptqmodel_quantizer(8, sym=True, desc_act=False), "gptq", _GPTQ_TORCH,
            bits=8),
]}


# ----------------------------------------------------------------------------- float source


def calibration_rows() -> np.ndarray:
    """Random calibration token ids [CALIB_ROWS, CALIB_LEN] (ids 3.. to avoid pad/bos/eos)."""
    return np.random.default_rng(SEED).integers(3, MODEL_CONFIG["vocab_size"], size=(CALIB_ROWS, CALIB_LEN))


def build_float_model() -> Any:
    """The tiny random bf16 LlamaForCausalLM all checkpoints start from."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG)).to(torch.bfloat16)
    return model.eval()


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer ``t0``..``t255`` (the tools want one; it is not kept in the fixtures)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(MODEL_CONFIG["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(folder)


def copy_checkpoint(src: Path, dst: Path) -> None:
    """Replace ``dst`` with the kept files of ``src`` (configs, safetensors; no tokenizer or logs)."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        if path.name in KEEP_FILES or path.suffix == ".safetensors":
            shutil.copy2(path, dst / path.name)


def stage_float_source(out_root: Path, work: Path, rebuild: bool) -> Path:
    """Put the float model plus a tokenizer in ``work/float_source`` for the tools.

    With ``rebuild`` (or when the fixture is missing) the model is built afresh and also written
    to ``out_root/float_source``; otherwise the existing fixture is staged, so a second run in
    another venv quantizes exactly the same weights.
    """
    fixture, stage = out_root / "float_source", work / "float_source"
    if rebuild or not (fixture / "model.safetensors").exists():
        build_float_model().save_pretrained(stage)
        copy_checkpoint(stage, fixture)
        print(f"wrote {fixture}")
    else:
        copy_checkpoint(fixture, stage)
    write_tokenizer(stage)
    return stage


# ----------------------------------------------------------------------------- HF reference


def package_versions() -> str:
    """``name version`` of each installed package in VERSION_PACKAGES, comma separated."""
    found = []
    for name in VERSION_PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name} {importlib.metadata.version(name)}")
    return ", ".join(found)


def tool_version(fixture: Fixture) -> str:
    """``<tool> <version> (<libraries>)`` for the venv that quantizes ``fixture``."""
    dist = TOOL_PACKAGES[fixture.tool]
    return f"{dist} {importlib.metadata.version(dist)} ({package_versions()})"


def reference_load(fixture: Fixture) -> tuple[dict[str, Any], str]:
    """``from_pretrained`` keyword arguments for the reference load, and the same spelled out."""
    import torch

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    spelled = "dtype=torch.float32"
    if fixture.reference == "ct_dequantize":
        from transformers import CompressedTensorsConfig

        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
        spelled += ", quantization_config=CompressedTensorsConfig(dequantize=True)"
    elif fixture.reference == "gptq":
        from transformers import GPTQConfig

        kwargs["quantization_config"] = GPTQConfig(bits=fixture.bits, backend="torch")
        spelled += f", quantization_config=GPTQConfig(bits={fixture.bits}, backend='torch')"
    elif fixture.reference == "awq":
        from transformers import AwqConfig

        kwargs["quantization_config"] = AwqConfig(bits=4, backend="torch_awq")
        spelled += ", quantization_config=AwqConfig(bits=4, backend='torch_awq')"
    return kwargs, f"AutoModelForCausalLM.from_pretrained(folder, {spelled}) on CPU"


def reference_missing(fixture: Fixture) -> str | None:
    """Why this venv cannot load ``fixture`` through transformers, or None if it can."""
    needs = {"gptq": ("gptqmodel", "optimum"), "awq": ("gptqmodel",)}.get(fixture.reference, ())
    if fixture.name.startswith("ct_"):
        needs = ("compressed_tensors",)
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    return f"needs {', '.join(missing)}" if missing else None


def greedy_loop(model: Any, ids: list[int], steps: int) -> list[int]:
    """Greedy continuation by full recomputation and argmax (no KV cache, no generate)."""
    import torch

    seq = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def record_reference(fixture: Fixture, folder: Path, quantized_with: str) -> None:
    """Load ``folder`` with transformers and write its ``hf_reference.npz``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    kwargs, call = reference_load(fixture)
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    q_proj = model.model.layers[0].self_attn.q_proj
    linear = type(q_proj).__name__
    status = getattr(q_proj, "quantization_status", None)
    if status is not None:
        linear += f" (compressed-tensors status {getattr(status, 'value', status)})"
    ids = torch.tensor([TOKEN_IDS])
    with torch.no_grad():
        logits = model(ids).logits[0].float().numpy()
    # No EOS at all: the continuation is the plain argmax chain, never cut or steered.
    model.generation_config.eos_token_id = None
    generation = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  eos_token_id=None, pad_token_id=0, bos_token_id=1)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation)
    greedy = out[0, len(TOKEN_IDS):].tolist()
    check = greedy_loop(model, TOKEN_IDS, NEW_TOKENS)
    if greedy != check:
        raise RuntimeError(f"{fixture.name}: generate {greedy} != argmax loop {check}")
    hf_load = f"{call}; Linear class {linear}; {fixture.note}"
    versions = f"quantized with: {quantized_with}; reference with: {package_versions()}"
    np.savez(folder / REFERENCE_FILE, token_ids=np.asarray(TOKEN_IDS, np.int32),
             logits=logits.astype(np.float32), greedy=np.asarray(greedy, np.int32),
             hf_load=np.str_(hf_load), versions=np.str_(versions))
    print(f"  {fixture.name}: hf_load = {hf_load}")


def previous_quantizer(folder: Path) -> str | None:
    """The ``quantized with`` part of an existing reference (kept by ``--reference-only``)."""
    path = folder / REFERENCE_FILE
    if not path.exists():
        return None
    text = str(np.load(path)["versions"])
    head = text.split("; reference with:")[0]
    return head.removeprefix("quantized with: ")


class PendingReference(Exception):
    """A folder quantized in another venv whose HF reference is still to be recorded."""


def verify_reference(folder: Path) -> str:
    """Check one ``hf_reference.npz`` with numpy alone; returns a one-line summary."""
    with np.load(folder / REFERENCE_FILE) as ref:
        if "logits" not in ref:
            raise PendingReference(f"run --reference-only {folder.name} in the main venv")
        token_ids, logits, greedy = ref["token_ids"], ref["logits"], ref["greedy"]
        hf_load, versions = str(ref["hf_load"]), str(ref["versions"])
    assert hf_load and versions, f"{folder}: empty hf_load or versions"
    assert token_ids.dtype == np.int32 and token_ids.tolist() == TOKEN_IDS, folder
    assert logits.dtype == np.float32 and logits.shape == (len(TOKEN_IDS), MODEL_CONFIG["vocab_size"]), folder
    assert greedy.dtype == np.int32 and greedy.shape == (NEW_TOKENS,), folder
    assert np.isfinite(logits).all(), f"{folder}: non-finite logits"
    argmax = logits.argmax(-1)
    assert len(set(argmax.tolist())) > 1, f"{folder}: argmax is the same at every position"
    assert argmax[-1] == greedy[0], f"{folder}: greedy does not start with the last position's argmax"
    size = sum(p.stat().st_size for p in folder.iterdir())
    return (f"{folder.name:15s} {size / 1024:6.1f} KiB  logits |max| {np.abs(logits).max():6.3f}  "
            f"{len(set(argmax.tolist()))} distinct argmax  greedy {greedy.tolist()}")


# ----------------------------------------------------------------------------- driver


def make(names: list[str], out_root: Path, rebuild_float: bool) -> list[str]:
    """Quantize ``names`` with their tools and record what this venv can; returns what was skipped."""
    skipped = []
    with tempfile.TemporaryDirectory(prefix="jaxpage_quant_") as tmp:
        work = Path(tmp)
        src = stage_float_source(out_root, work, rebuild_float)
        if rebuild_float:
            record_reference(FIXTURES["float_source"], out_root / "float_source",
                             tool_version(FIXTURES["float_source"]))
        for name in names:
            fixture = FIXTURES[name]
            if fixture.quantize is None:
                continue
            if importlib.util.find_spec(fixture.tool) is None:
                skipped.append(f"{name}: '{fixture.tool}' is not installed in this venv")
                continue
            print(f"== {name} ({fixture.tool})")
            raw = work / name
            with contextlib.chdir(work):  # tools drop logs into the working directory
                fixture.quantize(src, raw)
            folder = out_root / name
            copy_checkpoint(raw, folder)
            made_by = tool_version(fixture)
            why = reference_missing(fixture)
            if why:
                # Keep who quantized it, so the reference run in the other venv can say so.
                pending = f"quantized with: {made_by}; reference with: (pending)"
                np.savez(folder / REFERENCE_FILE, versions=np.str_(pending))
                skipped.append(f"{name}: quantized; reference pending ({why}): rerun with "
                               f"--reference-only {name} in the main venv")
                continue
            record_reference(fixture, folder, made_by)
    return skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture root (default %(default)s)")
    parser.add_argument("--only", nargs="+", choices=sorted(FIXTURES), metavar="NAME",
                        help="make just these (quantized ones start from the existing float_source)")
    parser.add_argument("--reference-only", nargs="+", choices=sorted(FIXTURES), metavar="NAME",
                        help="rewrite hf_reference.npz of these existing folders")
    parser.add_argument("--verify", action="store_true", help="check every hf_reference.npz with numpy")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    skipped: list[str] = []
    if args.reference_only:
        for name in args.reference_only:
            folder = args.out / name
            quantized_with = previous_quantizer(folder) or "(unknown)"
            record_reference(FIXTURES[name], folder, quantized_with)
    elif not args.verify:
        names = args.only or list(FIXTURES)
        skipped = make(names, args.out, rebuild_float=args.only is None or "float_source" in args.only)

    print("== fixtures")
    failed = False
    for folder in sorted(p for p in args.out.iterdir() if p.is_dir()):
        try:
            print("  " + verify_reference(folder))
        except PendingReference as pending:
            print(f"  {folder.name}: reference pending: {pending}")
        except (AssertionError, KeyError, OSError, ValueError) as error:
            failed = True
            print(f"  {folder.name}: NOT OK: {error!r}")
    for line in skipped:
        print("  skipped " + line)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"total {total / 1024:.0f} KiB under {args.out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
