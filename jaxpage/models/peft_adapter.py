"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``)
into our layout, checked against the base model.

PEFT stores, per adapted projection ``W`` [out, in] (torch layout), ``lora_A`` [r, in]
and ``lora_B`` [r, out]^T = [out, r], and adds ``scale * B @ A @ x`` with ``scale =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). Here every projection is
stored ``[in, out]`` (``models/llama.py``), so an adapter becomes, per (layer, projection),
``a`` [in, r] = A^T and ``b`` [r, out] = scale * B^T: the delta is ``(x @ a) @ b``.

Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` adapters are split like the weights
(``hf_layout``): each part keeps the same ``a`` and takes its rows of ``b``.

Everything PEFT can express that this engine does not apply is refused with a
``ValueError`` naming it (DoRA, trained biases, ``modules_to_save``, per-module rank or
alpha patterns, embeddings or the LM head, expert weights): an adapter is never run
partially.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from jaxpage.arch_config import ArchConfig

# The projections an adapter may adapt, as named in this engine (and in Hugging Face).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?"
                  r"\.weight$")


@dataclass
class LoRAWeights:
    """One adapter in our layout (float32, host memory).

    ``weights[(layer, target)] = (a [in, rank], b [rank, out])``, the scale folded into
    ``b``; projections the adapter leaves alone are absent. ``rank`` is the largest rank
    of its modules.
    """

    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def projection_shape(arch: ArchConfig, target: str) -> tuple[int, int]:
    """(in, out) features of projection ``target`` of a dense layer of ``arch``."""
    H, I = arch.hidden_size, arch.intermediate_size
    q_dim, kv_dim = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {"q_proj": (H, q_dim), "k_proj": (H, kv_dim), "v_proj": (H, kv_dim),
            "o_proj": (q_dim, H), "gate_proj": (H, I), "up_proj": (H, I),
            "down_proj": (I, H)}[target]


def load_peft_adapter(path: str, arch: ArchConfig, max_rank: int) -> LoRAWeights:
    """Read the adapter in directory ``path`` for a base model of ``arch``; ValueError when
    it cannot be applied exactly (see the module docstring) or its rank exceeds
    ``max_rank``."""
    config = _read_config(path)
    tensors = _read_tensors(path)
    rank = config["r"]
    alpha = config.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"adapter {path!r}: tensor {key!r} is not a LoRA A/B weight of "
                             f"an attention or MLP projection ({', '.join(LORA_TARGETS)}); "
                             "embeddings, the LM head, biases and expert weights cannot "
                             "be adapted")
        layer, module, which = int(match.group(1)), match.group(3), match.group(4)
        if module not in LORA_TARGETS and module not in _FUSED:
            raise ValueError(f"adapter {path!r}: module {module!r} (tensor {key!r}) cannot be "
                             f"adapted; supported: {', '.join(LORA_TARGETS)}")
        if not 0 <= layer < arch.num_layers:
            raise ValueError(f"adapter {path!r}: tensor {key!r} names layer {layer}, but the "
                             f"model has {arch.num_layers}")
        pair = pairs.setdefault((layer, module), {})
        if which in pair:  # e.g. "lora_A.default.weight" and "lora_A.other.weight"
            raise ValueError(f"adapter {path!r} holds more than one lora_{which} for layer "
                             f"{layer} {module} (several adapters in one file?)")
        pair[which] = np.asarray(value, np.float32)
    if not pairs:
        raise ValueError(f"adapter {path!r} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    largest = 0
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {path!r}: layer {layer} {module} has lora_"
                             f"{''.join(pair)} without its partner")
        a, b = pair["A"], pair["B"]                          # [r, in], [out, r]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter {path!r}: layer {layer} {module} has lora_A "
                             f"{a.shape} and lora_B {b.shape}, which do not pair")
        r = a.shape[0]
        if r > max_rank:
            raise ValueError(f"adapter {path!r} has rank {r} (layer {layer} {module}), more "
                             f"than max_lora_rank={max_rank}")
        largest = max(largest, r)
        for target, rows in _split_rows(arch, layer, module, b, path):
            if arch.is_sparse(layer) and target in ("gate_proj", "up_proj", "down_proj"):
                raise ValueError(f"adapter {path!r}: layer {layer} is a mixture of experts; "
                                 f"its {target} cannot be adapted")
            size_in, size_out = projection_shape(arch, target)
            if a.shape[1] != size_in or rows.shape[0] != size_out:
                raise ValueError(f"adapter {path!r}: layer {layer} {target} maps "
                                 f"{a.shape[1]} -> {rows.shape[0]} features, but the model's "
                                 f"maps {size_in} -> {size_out}: not an adapter of this model")
            weights[(layer, target)] = (np.ascontiguousarray(a.T),
                                        np.ascontiguousarray(rows.T * scale))
    return LoRAWeights(path=path, rank=largest, weights=weights)


def _split_rows(arch: ArchConfig, layer: int, module: str, b: np.ndarray,
                path: str) -> list[tuple[str, np.ndarray]]:
    """``b`` [out, r] of ``module`` as (target, rows) parts: fused modules split."""
    if module not in _FUSED:
        return [(module, b)]
    targets = _FUSED[module]
    sizes = [projection_shape(arch, t)[1] for t in targets]
    if b.shape[0] != sum(sizes):
        raise ValueError(f"adapter {path!r}: layer {layer} {module} lora_B has {b.shape[0]} "
                         f"rows; the model's {module} has {sum(sizes)}")
    bounds = np.cumsum([0] + sizes)
    return [(t, b[bounds[i]:bounds[i + 1]]) for i, t in enumerate(targets)]


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"lora_path={path!r} is not a directory (expected a PEFT adapter "
                         "with adapter_config.json and adapter_model.safetensors)")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"lora_path={path!r} has no adapter_config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path}: not valid JSON ({error})") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{config_path}: peft_type={config.get('peft_type')!r}; only LORA "
                         "adapters are supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{config_path}: r={rank!r} must be a positive integer")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{config_path}: lora_alpha={alpha!r} must be a number")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "bias": config.get("bias", "none") not in (None, "none"),
    }
    for name, used in unsupported.items():
        if used:
            raise ValueError(f"{config_path}: {name}={config.get(name)!r} is not supported "
                             "(plain LoRA on the attention and MLP projections only)")
    return config


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise ValueError(f"lora_path={path!r} holds adapter_model.bin (a pickle); save "
                             "the adapter with safetensors (PEFT's default)")
        raise ValueError(f"lora_path={path!r} has no adapter_model.safetensors")
    try:
        return load_file(file)
    except TypeError:  # bfloat16 tensors: numpy has no such dtype; read them through ml_dtypes
        return _read_bfloat16(file)


def _read_bfloat16(file: str) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    with safe_open(file, framework="flax") as f:
        return {key: np.asarray(f.get_tensor(key), np.float32) for key in f.keys()}
