"""Pre-quantized Hugging Face checkpoints, read as stored: compressed-tensors, Hugging
Face's FP8, AWQ, GPTQ.

A checkpoint quantized by its format's own tool (llm-compressor, AutoAWQ, GPTQModel,
``transformers``' ``FineGrainedFP8Config``) says
so in ``config.json``'s ``quantization_config`` (or an older ``quant_config.json`` /
``quantize_config.json`` beside it). ``stored_quantization`` reads that into a
``StoredQuantization``; its ``plan`` names the parameters stored quantized (found by
their tensors, the same in every layer) and ``read`` turns one linear's stored tensors
into ``jaxpage.models.quantize``'s parts in our ``[in, out]`` layout, the same weights:

* compressed-tensors ``float-quantized`` (FP8 e4m3 ``weight`` with a per-tensor,
  per-channel, group or block ``weight_scale``; ``input_scale`` for static activations):
  FP8 codes, the scale spread to ``[G, N]``;
* compressed-tensors ``int-quantized`` / ``naive-quantized`` (int8 ``weight``) and
  ``pack-quantized`` (4 or 8 bits, packed eight or four to an int32 along the input,
  stored as value + 2^(bits-1); optional ``weight_zero_point``, packed along the output):
  int8 codes (a zero where the zero points are not zero), or 4-bit codes with a zero;
* Hugging Face FP8 (``quant_method: "fp8"``: e4m3 ``weight`` and ``weight_scale_inv`` per
  ``weight_block_size`` block or per tensor; ``fp8.py``): FP8 codes, the scale spread to
  ``[G, N]``;
* AWQ (GEMM layout): ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` ``[G, N / 8]``
  packed along the output in the order 0, 2, 4, 6, 1, 3, 5, 7; ``scales [G, N]``;
  ``W = (q - z) * s``;
* GPTQ: ``qweight`` int32 ``[K * bits / 32, N]`` packed along the input, ``qzeros``
  ``[G, N * bits / 32]`` along the output, stored as z - 1 (format v1; v2 as z),
  ``scales [G, N]`` and ``g_idx [K]``; ``W = (q - z) * s``. With act-order (``g_idx``
  not ascending) the input rows are sorted by group and the weight keeps the
  permutation (``perm``), applied to the activations in the matmul.

Every zero becomes ``zero = -z * s`` (exact in float32 for float16 / bfloat16 scales and
integer z). Checkpoints with activation quantization (W8A8) keep their scheme
(``QuantFormat.activations``): run natively where the hardware multiplies 8-bit codes
(``pallas_kernels.quantized_matmul.activation_quant``), weight-only elsewhere, where a
compressed-tensors checkpoint still rounds its activations as stored
(``QuantFormat.emulated``: what compressed-tensors itself does on every platform).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

import numpy as np

from jaxpage.models.prequantized.awq import AWQ
from jaxpage.models.prequantized.base import StoredQuantization
from jaxpage.models.prequantized.compressed_tensors import COMPRESSED_FORMATS, CompressedTensors
from jaxpage.models.prequantized.fp8 import HfFp8
from jaxpage.models.prequantized.gptq import GPTQ
from jaxpage.models.quantize import FP8_DTYPE, QuantFormat

STORED_METHODS = ("compressed-tensors", "fp8", "awq", "gptq")
READERS = {"compressed-tensors": CompressedTensors, "fp8": HfFp8, "awq": AWQ, "gptq": GPTQ}
# ``quantization=`` names that mean a stored method (vLLM's kernel-specific names too)
METHOD_ALIASES = {"compressed-tensors": "compressed-tensors",
                  "compressed_tensors": "compressed-tensors", "fp8": "fp8", "awq": "awq",
                  "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq"}


def canonical_method(name: str) -> str | None:
    """A ``quantization=`` value's stored method, or None if it names none."""
    return METHOD_ALIASES.get(name.lower()) if isinstance(name, str) else None


def stored_quantization(hf_config: dict[str, Any], directory: str) -> StoredQuantization | None:
    """The checkpoint's stored quantization, None for a float checkpoint; a ``ValueError``
    naming the method for one jaxpage does not read."""
    config = hf_config.get("quantization_config")
    if config is None:
        for name in ("quant_config.json", "quantize_config.json"):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                with open(path) as f:
                    config = json.load(f)
                break
    if config is None:
        return None
    method = str(config.get("quant_method") or _guess_method(config)).lower()
    if method not in STORED_METHODS:
        raise ValueError(f"{directory!r} is quantized with {method!r}, which jaxpage does not "
                         f"read; supported pre-quantized formats: {', '.join(STORED_METHODS)} "
                         "(compressed-tensors: " + ", ".join(COMPRESSED_FORMATS) + "); or load "
                         "a float checkpoint with quantization='int8' / 'int4'")
    reader = READERS[method]
    return reader(config, directory)


def for_device(plan: dict[str, QuantFormat], device: Any) -> dict[str, QuantFormat]:
    """``plan`` with the W8A8 weights that a GPU multiplies natively kept ``[out, in]``
    (``QuantFormat.transposed``): cuBLASLt's FP8 and int8 GEMMs read both operands
    contiguous along K, and codes stored ``[in, out]`` made XLA:GPU transpose every weight
    on every call (found compiling an FP8 Llama-3-8B for an H100: 6.6 GiB of transposed
    codes hoisted out of the decode loop). TPUs and the CPU keep ``[in, out]``."""
    from pallas_kernels import _backend
    from pallas_kernels.quantized_matmul.activation_quant import runs_natively

    if _backend.platform_backend(device.platform) != "gpu":
        return plan
    out = {}
    for name, fmt in plan.items():
        dtype = FP8_DTYPE if fmt.codes == "fp8" else np.int8
        native = (fmt.activations is not None and fmt.bits == 8 and not fmt.zero
                  and fmt.group_size is None
                  and runs_natively(dtype, 1, device.platform, device))
        out[name] = replace(fmt, transposed=True) if native else fmt
    return out


def _guess_method(config: dict[str, Any]) -> str:
    """An older AutoAWQ / AutoGPTQ config file without ``quant_method``."""
    if "w_bit" in config or "q_group_size" in config or "zero_point" in config:
        return "awq"
    if "desc_act" in config or "damp_percent" in config:
        return "gptq"
    return "unknown"
