"""Hugging Face's fine-grained FP8 checkpoints (``quant_method: "fp8"``): the format of
DeepSeek-V3 / R1 and of the Qwen3 ``-FP8`` models, written by ``transformers``'
``FineGrainedFP8Config``.

Each quantized linear stores ``weight`` as float8 e4m3 ``[N, K]`` and ``weight_scale_inv``,
the factor that multiplies the codes back (``W = q * s``): per block of
``weight_block_size = [bn, bk]`` (``[ceil(N / bn), ceil(K / bk)]``), or one per tensor
without a block size. The older AutoFP8 layout under the same method (neuralmagic's
``-FP8`` models, which vLLM reads as ``fp8``) stores one ``weight_scale`` per tensor and,
with static activations, ``input_scale``; it is read the same way. ``scale_fmt: "ue8m0"`` stores each scale as a power of two in one
byte (float8 e8m0). Modules in ``modules_to_not_convert`` (the LM head, as a rule) are
stored in float and found by their tensors.

Activations: ``activation_scheme: "static"`` stores a per-tensor ``activation_scale``
(AutoFP8: ``input_scale``), by which the activations are divided;
``"dynamic"`` scales at run time. A per-tensor weight runs W8A8 where the chip multiplies
FP8 (``QuantFormat.activations``; dynamic activations per token, as vLLM runs these
checkpoints), weight-only elsewhere. Block-scaled weights run weight-only everywhere (the
scales become groups of ``bk`` input rows, each repeated over its ``bn`` output columns):
their checkpoints quantize activations per token and per 128 channels, which no native
path here multiplies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpage.models.prequantized.base import Getter, StoredQuantization
from jaxpage.models.quantize import FP8_DTYPE, QuantFormat

ACTIVATION_SCHEMES = ("dynamic", "static")
SCALE_FORMATS = ("float", "ue8m0")
WEIGHT_SCALES = ("weight_scale_inv", "weight_scale")      # Hugging Face's, AutoFP8's
ACTIVATION_SCALES = ("activation_scale", "input_scale", "act_scale")  # likewise (+ early AutoFP8)


class HfFp8(StoredQuantization):
    """``quant_method: "fp8"`` (see the module)."""

    def __init__(self, config: dict[str, Any], directory: str) -> None:
        super().__init__(config, directory, "fp8")
        block = config.get("weight_block_size")
        if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2
                                  or not all(isinstance(b, int) and b >= 1 for b in block)):
            raise ValueError(f"{directory!r}: weight_block_size={block!r} must be two "
                             "positive integers or null")
        self.block = None if block is None else (int(block[0]), int(block[1]))
        self.scheme = str(config.get("activation_scheme") or "dynamic").lower()
        if self.scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"{directory!r}: activation_scheme={self.scheme!r} is not one of "
                             f"{ACTIVATION_SCHEMES}")
        element = str(config.get("fmt") or "e4m3").lower()  # DeepSeek-V3 / Qwen3 write "e4m3"
        if element != "e4m3":
            raise ValueError(f"{directory!r}: FP8 weights in {element!r} are not supported "
                             "(e4m3 are)")
        scale_fmt = str(config.get("scale_fmt") or "float").lower()
        if scale_fmt not in SCALE_FORMATS:
            raise ValueError(f"{directory!r}: scale_fmt={scale_fmt!r} is not one of "
                             f"{SCALE_FORMATS}")

    def is_stored(self, module: str, names: set[str]) -> bool:
        return any(f"{module}.{scale}" in names for scale in WEIGHT_SCALES)

    def format_of(self, module: str, names: set[str]) -> QuantFormat:
        if self.block is not None:
            return QuantFormat(8, self.block[1], "fp8")
        return QuantFormat(8, None, "fp8", activations=self.scheme)

    def read(self, get: Getter, names: set[str], module: str,
             fmt: QuantFormat) -> dict[str, np.ndarray]:
        w = np.asarray(get(f"{module}.weight"))                              # [N, K] f8
        if w.dtype == np.uint8:  # FP8 bytes read without their dtype
            w = w.view(FP8_DTYPE)
        if w.dtype != FP8_DTYPE:
            raise ValueError(f"{self.directory!r}: {module}.weight is {w.dtype}; a "
                             "quant_method 'fp8' weight must be float8 e4m3")
        n, k = w.shape
        name = next(f"{module}.{s}" for s in WEIGHT_SCALES if f"{module}.{s}" in names)
        scale = np.asarray(get(name)).astype(np.float32)
        parts = {"codes": np.ascontiguousarray(w.T),
                 "scale": self._scale_to_groups(scale, n, k, module)}
        if fmt.activations == "static":
            found = [f"{module}.{s}" for s in ACTIVATION_SCALES if f"{module}.{s}" in names]
            if not found:
                raise ValueError(f"{self.directory!r}: activation_scheme 'static', but "
                                 f"{module} has no {' or '.join(ACTIVATION_SCALES)}")
            input_scale = np.asarray(get(found[0]), np.float32).reshape(-1)
            if input_scale.size != 1:
                raise ValueError(f"{self.directory!r}: {found[0]} has {input_scale.size} "
                                 "values; a static activation scale is one per tensor")
            parts["input_scale"] = input_scale
        return parts

    def _scale_to_groups(self, scale: np.ndarray, n: int, k: int, module: str) -> np.ndarray:
        """``weight_scale_inv`` -> float32 [G, N] for the weight [N, K] as stored."""
        if self.block is None:
            if scale.size != 1:
                raise ValueError(f"{self.directory!r}: {module}'s weight scale has shape "
                                 f"{scale.shape}; without weight_block_size it is one scale")
            return np.full((1, n), scale.reshape(()), np.float32)
        bn, bk = self.block
        expected = (-(-n // bn), -(-k // bk))
        if scale.shape != expected:
            raise ValueError(f"{self.directory!r}: {module}'s weight scale has shape "
                             f"{scale.shape}, not {expected} for a [{n}, {k}] weight in "
                             f"blocks of {self.block}")
        if k % bk:
            raise ValueError(f"{self.directory!r}: {module} has {k} inputs, not a multiple of "
                             f"its scale block's {bk}; jaxpage reads whole input blocks only")
        rows = np.repeat(scale, bn, axis=0)[:n]                               # [N, K / bk]
        return np.ascontiguousarray(rows.T)
