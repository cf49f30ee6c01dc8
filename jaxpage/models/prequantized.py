"""Pre-quantized Hugging Face checkpoints, read as stored: compressed-tensors, AWQ, GPTQ.

A checkpoint quantized by its format's own tool (llm-compressor, AutoAWQ, GPTQModel) says
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
(``pallas_kernels.quantized_matmul.activation_quant``), weight-only elsewhere.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from jaxpage.arch_config import ArchConfig
from jaxpage.models.quantize import FP8_DTYPE, QuantFormat, pack_nibbles

logger = logging.getLogger("jaxpage")

STORED_METHODS = ("compressed-tensors", "awq", "gptq")
# ``quantization=`` names that mean a stored method (vLLM's kernel-specific names too)
METHOD_ALIASES = {"compressed-tensors": "compressed-tensors",
                  "compressed_tensors": "compressed-tensors", "awq": "awq",
                  "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq"}
COMPRESSED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i]

Getter = Callable[[str], np.ndarray]


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
    reader = {"compressed-tensors": CompressedTensors, "awq": AWQ, "gptq": GPTQ}[method]
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


@dataclass
class StoredQuantization:
    """A pre-quantized checkpoint's method and how to read its linears (see the module)."""

    config: dict[str, Any]
    directory: str
    method: str = ""
    formats: dict[str, QuantFormat] = field(default_factory=dict)  # set by ``plan``

    def plan(self, arch: ArchConfig, names: set[str]) -> dict[str, QuantFormat]:
        """Our parameter -> its stored format, for every linear stored quantized. The same
        parameters must be quantized in every layer (else a ``ValueError`` names one)."""
        if arch.fused_projections or any(arch.is_sparse(i) for i in range(arch.num_layers)):
            raise ValueError(f"{self.directory!r}: pre-quantized ({self.method}) fused or "
                             "mixture-of-experts projections are not supported yet")
        plan = {}
        modules = {name: f"model.layers.{{}}.{'self_attn' if name[0] in 'qkvo' else 'mlp'}"
                         f".{name}" for name in LINEARS}
        if not arch.tie_word_embeddings:
            modules["lm_head"] = "lm_head"
        for ours, module in modules.items():
            stored = [self.is_stored(module.format(i), names) for i in range(arch.num_layers)]
            if not any(stored):
                continue
            if not all(stored):
                layer = stored.index(False)
                raise ValueError(f"{self.directory!r}: {ours} is quantized in some layers but "
                                 f"not in layer {layer}; jaxpage needs the same format in "
                                 "every layer")
            plan[ours] = self.format_of(module.format(0), names)
        if not plan:
            raise ValueError(f"{self.directory!r} says it is quantized with {self.method!r} "
                             "but has no quantized linear tensors")
        self.formats = plan
        return plan

    def is_stored(self, module: str, names: set[str]) -> bool:  # pragma: no cover
        raise NotImplementedError

    def format_of(self, module: str, names: set[str]) -> QuantFormat:  # pragma: no cover
        raise NotImplementedError

    def read(self, get: Getter, names: set[str], module: str,
             fmt: QuantFormat) -> dict[str, np.ndarray]:  # pragma: no cover
        """Module ``module``'s stored tensors (``get(name)``; ``names``: every tensor) ->
        our parts of its weight [in, out] in ``fmt``."""
        raise NotImplementedError


# --- packing helpers -----------------------------------------------------------------

def unpack_int32(packed: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None
                 ) -> np.ndarray:
    """int32 values each holding ``32 / bits`` unsigned codes (code i in bits
    ``bits * i``), unpacked along ``axis`` (codes of one int32 adjacent; ``order``: nibble
    i holds element ``order[i]``) -> int32 codes."""
    per = 32 // bits
    words = packed.astype(np.int64) & 0xFFFFFFFF
    codes = np.stack([(words >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], axis=-1)
    if order is not None:
        codes = codes[..., np.argsort(order)]
    codes = np.moveaxis(codes, -1, axis + 1) if axis != packed.ndim - 1 else codes
    shape = list(packed.shape)
    shape[axis] *= per
    return codes.reshape(shape).astype(np.int32)


def to_parts(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None,
             fmt: QuantFormat, offset: int) -> dict[str, np.ndarray]:
    """Unsigned integer codes q [K, N] (``W = (q - offset - zp) * s``), scale and zero
    points [G, N] -> our parts: 4-bit codes with ``zero = -(offset + zp) * s``; int8 codes
    ``q - 128`` with ``zero = (128 - offset - zp) * s`` when ``fmt.zero`` (else that must
    be zero: a symmetric format)."""
    scale = scale.astype(np.float32)
    zp = np.zeros_like(scale) if zero_point is None else zero_point.astype(np.float32)
    if fmt.bits == 4:
        return {"codes": pack_nibbles(q.astype(np.uint8)), "scale": scale,
                "zero": (-(offset + zp) * scale).astype(np.float32)}
    parts = {"codes": (q.astype(np.int32) - 128).astype(np.int8), "scale": scale}
    zero = ((128 - offset - zp) * scale).astype(np.float32)
    if fmt.zero:
        parts["zero"] = zero
    elif np.any(zero != 0):
        raise ValueError("a symmetric 8-bit weight has zero points off the middle code")
    return parts


def group_size_of(k: int, groups: int) -> int | None:
    if groups == 1:
        return None
    if k % groups:
        raise ValueError(f"{groups} scale groups do not divide the input size {k}")
    return k // groups


# --- compressed-tensors --------------------------------------------------------------

class CompressedTensors(StoredQuantization):
    """llm-compressor's format (``quant_method: "compressed-tensors"``)."""

    def __init__(self, config: dict[str, Any], directory: str) -> None:
        super().__init__(config, directory, "compressed-tensors")
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError(f"{directory!r}: compressed-tensors config has no config_groups")
        self.groups = list(groups.values())
        self.ignore = list(config.get("ignore") or [])
        for group in self.groups:
            fmt = group.get("format") or config.get("format")
            if fmt not in COMPRESSED_FORMATS:
                raise ValueError(f"{directory!r}: compressed-tensors format {fmt!r} is not "
                                 f"supported; supported: {', '.join(COMPRESSED_FORMATS)}")

    def _group(self, module: str) -> dict[str, Any] | None:
        if any(_matches(target, module) for target in self.ignore):
            return None
        for group in self.groups:
            if any(target == "Linear" or _matches(target, module)
                   for target in group.get("targets") or ()):
                return group
        return None

    def is_stored(self, module: str, names: set[str]) -> bool:
        return self._group(module) is not None and (
            f"{module}.weight_packed" in names or f"{module}.weight_scale" in names)

    def format_of(self, module: str, names: set[str]) -> QuantFormat:
        group = self._group(module)
        weights = group.get("weights") or {}
        bits, kind = int(weights.get("num_bits", 8)), weights.get("type", "int")
        strategy = weights.get("strategy")
        if (kind, bits) not in (("float", 8), ("int", 8), ("int", 4)):
            raise ValueError(f"{self.directory!r}: compressed-tensors {kind} weights of {bits} "
                             "bits are not supported (FP8, int8 and int4 are)")
        if strategy not in ("tensor", "channel", "group", "block"):
            raise ValueError(f"{self.directory!r}: weight strategy {strategy!r} is not "
                             "supported (tensor, channel, group, block are)")
        group_size = None
        if strategy == "group":
            group_size = int(weights["group_size"])
        elif strategy == "block":
            group_size = int((weights.get("block_structure") or [0, 0])[1])
        zero = (kind == "int" and bits == 8 and not weights.get("symmetric", True))
        return QuantFormat(bits, group_size, "fp8" if kind == "float" else "int", zero,
                           self._activations(group, bits, group_size))

    def _activations(self, group: dict[str, Any], bits: int, group_size: int | None
                     ) -> str | None:
        acts = group.get("input_activations")
        if not acts:
            return None
        weights = group.get("weights") or {}
        native = (bits == 8 and group_size is None and int(acts.get("num_bits", 0)) == 8
                  and acts.get("type") == weights.get("type") and acts.get("symmetric", True)
                  and weights.get("symmetric", True))
        scheme = "dynamic" if acts.get("dynamic") else "static"
        if not native or (scheme == "dynamic" and acts.get("strategy") != "token") or (
                scheme == "static" and acts.get("strategy") != "tensor"):
            logger.warning("%s: activation quantization %s runs weight-only", self.directory,
                           acts)
            return None
        return scheme

    def read(self, get: Getter, names: set[str], module: str,
             fmt: QuantFormat) -> dict[str, np.ndarray]:
        group = self._group(module)
        weights = group.get("weights") or {}
        if fmt.codes == "fp8":
            w = get(f"{module}.weight")                                       # [N, K] f8
            codes = np.ascontiguousarray(w.T).view(np.uint8).view(FP8_DTYPE) if \
                w.dtype != FP8_DTYPE else np.ascontiguousarray(w.T)
            parts = {"codes": codes,
                     "scale": _scale_to_groups(get(f"{module}.weight_scale"), w.shape,
                                               weights)}
        elif f"{module}.weight_packed" in names:
            packed = get(f"{module}.weight_packed")                          # [N, K*bits/32]
            q = unpack_int32(packed, fmt.bits, axis=1).T                     # [K, N]
            k = q.shape[0]
            scale = get(f"{module}.weight_scale").astype(np.float32)         # [N, G]
            zp = None
            if not weights.get("symmetric", True):
                zp_stored = get(f"{module}.weight_zero_point")               # [N*bits/32, G]
                zp = unpack_int32(zp_stored, fmt.bits, axis=0)[:scale.shape[0]]
                zp = zp - (1 << (fmt.bits - 1))                              # stored + offset
                zp = zp.T
            parts = to_parts(q, _spread(scale.T, k), zp, fmt, 1 << (fmt.bits - 1))
        else:  # int8 stored as is
            w = get(f"{module}.weight").astype(np.int32)                     # [N, K]
            scale = get(f"{module}.weight_scale").astype(np.float32)         # [N, G]
            zp = None
            if not weights.get("symmetric", True):
                zp = get(f"{module}.weight_zero_point").astype(np.float32).reshape(
                    scale.shape).T
            parts = to_parts((w.T + 128), _spread(scale.T, w.shape[1]), zp, fmt, 128)
        if fmt.activations == "static":
            parts["input_scale"] = np.asarray(get(f"{module}.input_scale"),
                                              np.float32).reshape(-1)[:1]
        return parts


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def _spread(scale: np.ndarray, k: int) -> np.ndarray:
    """A scale [G, N] checked against K (G divides K)."""
    group_size_of(k, scale.shape[0])
    return scale


def _scale_to_groups(scale: np.ndarray, weight_shape: tuple[int, int],
                     weights: dict[str, Any]) -> np.ndarray:
    """An FP8 weight's stored scale -> float32 [G, N] for W [N, K] as stored: per tensor
    ``[1]`` or ``[]`` repeated per channel; per channel ``[N, 1]``; per group ``[N, G]``;
    per block ``[N / bn, K / bk]`` repeated over each block's columns."""
    n, k = weight_shape
    scale = np.asarray(scale, np.float32)
    if scale.size == 1:
        return np.full((1, n), scale.reshape(()), np.float32)
    if weights.get("strategy") == "block":
        bn, bk = (int(x) for x in weights["block_structure"])
        rows = np.repeat(scale, bn, axis=0)[:n]                               # [N, K / bk]
        return np.ascontiguousarray(rows.T)
    if scale.shape[0] != n:
        raise ValueError(f"FP8 weight scale {scale.shape} does not match the weight [{n}, {k}]")
    return _spread(np.ascontiguousarray(scale.T), k)


# --- AWQ -----------------------------------------------------------------------------

class AWQ(StoredQuantization):
    """AutoAWQ's format (GEMM layout; ``quant_method: "awq"``)."""

    def __init__(self, config: dict[str, Any], directory: str) -> None:
        super().__init__(config, directory, "awq")
        self.bits = int(config.get("bits", config.get("w_bit", 4)))
        version = str(config.get("version", "gemm")).lower()
        if self.bits != 4 or version != "gemm":
            raise ValueError(f"{directory!r}: AWQ with {self.bits} bits, version {version!r} is "
                             "not supported (4 bits, GEMM layout is)")
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))

    def is_stored(self, module: str, names: set[str]) -> bool:
        return f"{module}.qweight" in names

    def format_of(self, module: str, names: set[str]) -> QuantFormat:
        return QuantFormat(4, None if self.group_size <= 0 else self.group_size)

    def read(self, get: Getter, names: set[str], module: str,
             fmt: QuantFormat) -> dict[str, np.ndarray]:
        q = unpack_int32(get(f"{module}.qweight"), 4, axis=1, order=AWQ_ORDER)   # [K, N]
        z = unpack_int32(get(f"{module}.qzeros"), 4, axis=1, order=AWQ_ORDER)    # [G, N]
        scale = get(f"{module}.scales").astype(np.float32)                      # [G, N]
        group_size_of(q.shape[0], scale.shape[0])
        return to_parts(q, scale, z, fmt, 0)


# --- GPTQ ----------------------------------------------------------------------------

class GPTQ(StoredQuantization):
    """AutoGPTQ / GPTQModel's format (``quant_method: "gptq"``)."""

    def __init__(self, config: dict[str, Any], directory: str) -> None:
        super().__init__(config, directory, "gptq")
        self.bits = int(config.get("bits", 4))
        if self.bits not in (4, 8):
            raise ValueError(f"{directory!r}: GPTQ with {self.bits} bits is not supported "
                             "(4 and 8 are)")
        self.group_size = int(config.get("group_size", 128))
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{directory!r}: GPTQ checkpoint_format {fmt!r} is not supported "
                             "(gptq, gptq_v2 are)")
        self.zero_offset = 1 if fmt == "gptq" else 0  # v1 stores z - 1

    def is_stored(self, module: str, names: set[str]) -> bool:
        return f"{module}.qweight" in names

    def format_of(self, module: str, names: set[str]) -> QuantFormat:
        return QuantFormat(self.bits, None if self.group_size <= 0 else self.group_size,
                           zero=self.bits == 8 and not self.config.get("sym", True),
                           act_order=bool(self.config.get("desc_act")))

    def read(self, get: Getter, names: set[str], module: str,
             fmt: QuantFormat) -> dict[str, np.ndarray]:
        q = unpack_int32(get(f"{module}.qweight"), self.bits, axis=0)                # [K, N]
        z = unpack_int32(get(f"{module}.qzeros"), self.bits, axis=1) + self.zero_offset
        scale = get(f"{module}.scales").astype(np.float32)                           # [G, N]
        k = q.shape[0]
        z = z[:, :scale.shape[1]]
        g_idx = (np.asarray(get(f"{module}.g_idx"), np.int64) if f"{module}.g_idx" in names
                 else None)
        size = group_size_of(k, scale.shape[0]) or k
        default = np.arange(k) // size
        perm = None
        if g_idx is not None and not np.array_equal(g_idx, default):
            perm = np.argsort(g_idx, kind="stable")
            if not np.array_equal(g_idx[perm], default):
                raise ValueError(f"{module}: g_idx does not give every group {size} rows")
            q = q[perm]
        parts = to_parts(q, scale, z, fmt, 0)
        if fmt.act_order:
            parts["perm"] = (np.arange(k) if perm is None else perm).astype(np.int32)
        return parts
