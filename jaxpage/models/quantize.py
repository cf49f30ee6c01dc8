"""Weight-only quantization at load time, on the host, one tensor at a time.

A *plan* says which parameters are stored quantized and how: ``{name: QuantFormat}`` for
the parameter names of ``QUANTIZABLE`` (the same format in every layer). The formats are
those of ``pallas_kernels.quantized_matmul``: 8-bit symmetric codes with a scale per
group of rows, or 4-bit asymmetric codes (two per byte) with a scale and a zero.

Modes (``quantization=``):

* ``"int8"``: every linear weight, the embedding and the LM head in 8 bits, one scale
  (the projections: and a zero, asymmetric; the vocabulary tables symmetric) per group of
  ``group_size`` input rows of each output channel (default 32; the largest power of two
  up to it that divides the input size when it does not). ``group_size=0``: one scale per
  output channel. The format was chosen by measurement on SmolLM2
  (``docs/quantization.md``).
* ``"int4"``: the decoder layers' linear weights in 4 bits, asymmetric, a scale and zero
  per group (default 32, same rule); the embedding and the LM head in int8 with groups of
  128 (as llama.cpp's Q4_K_M keeps them at 6-8 bits). On SmolLM2 groups of 128 or a 4-bit
  embedding cost 6-44% perplexity; this costs 0.2% (``docs/quantization.md``).
* ``"fp8"``: the decoder layers' linear weights as float8 e4m3 codes with one scale per
  output channel (``max |w| / 448``), their activations quantized per token where the chip
  multiplies FP8 (W8A8, ``QuantFormat.activations``) and weight-only elsewhere; the
  embedding and the LM head stay in the model dtype. vLLM's ``--quantization fp8`` on a
  float checkpoint. (On a checkpoint stored as Hugging Face FP8, ``"fp8"`` names that
  stored method instead: ``jaxpage.models.prequantized``.)
* ``"gguf"``: a GGUF file's Q8_0, Q4_0 and Q4_1 tensors as stored (blocks of 32 along the
  input, repacked once into the formats above, bit for bit the same weights); tensors of
  other types are dequantized to the model dtype as without quantization.

The embedding table is stored quantized as ``[hidden, vocab]`` (the layout a tied LM
head multiplies by, one scale per vocabulary row for int8); a lookup converts only the
rows it reads (``quantized_matmul.gather_columns``). Norms and biases stay in the model
dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import jax.numpy as jnp
import numpy as np

QUANTIZATION_MODES = ("int8", "int4", "fp8", "gguf")
QUANTIZABLE = ("embed", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
               "up_proj", "down_proj")
PARTS = ("codes", "codes_t", "scale", "zero", "input_scale", "perm")
DEFAULT_GROUP_SIZE = {"int8": 32, "int4": 32}  # input rows per scale, by mode
VOCAB_INT8_GROUP = 128  # int4 mode's embedding / LM head: int8 with this group size
VOCAB_PARAMS = ("embed", "lm_head")
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value
GGUF_BLOCK = 32
FP8_DTYPE = jnp.float8_e4m3fn  # an ml_dtypes numpy type


# W8A8 activation scales: per token at run time / per tensor, stored / per token and per
# group of the weight's ``group_size`` input channels at run time (never native here)
ACTIVATION_SCHEMES = ("dynamic", "static", "dynamic_group")


@dataclass(frozen=True)
class QuantFormat:
    """How one parameter is stored: ``bits`` 8 or 4, with a scale per group of
    ``group_size`` input rows (``None``: one group, per channel).

    * ``codes="int"``: 8-bit codes are int8, symmetric unless ``zero``; 4-bit codes are
      unsigned, two per byte, always with a zero (asymmetric).
    * ``codes="fp8"``: 8-bit float8_e4m3fn codes times the scale (a pre-quantized FP8
      checkpoint's; a per-tensor scale is stored repeated per channel).
    * ``activations``: ``None`` weight-only; ``"dynamic"`` / ``"static"`` /
      ``"dynamic_group"``: the checkpoint also quantizes the matmul's input (per token at
      run time / by its stored per-tensor ``input_scale`` / per token and group of
      ``group_size`` inputs), done where the hardware multiplies such codes natively
      (``pallas_kernels.quantized_matmul.activation_quant``).
    * ``emulated``: where it does not, the input is still rounded to those codes and back
      before the weight-only matmul, as the format's own runtime does on every platform
      (compressed-tensors); False: weight-only there (Hugging Face FP8 and jaxpage's own
      ``fp8``, as transformers and vLLM run them without FP8 units).
    * ``act_order``: the input rows are stored sorted by group, and ``perm`` int32 [K]
      says which input each row multiplies (``x[..., perm] @ W``).
    * ``transposed``: a W8A8 weight's codes stored ``[out, in]`` as part ``codes_t``, the
      layout a GPU's FP8 / int8 GEMM reads (both operands contiguous along K); ``[in,
      out]`` codes would be transposed by XLA on every call (``prequantized.for_device``).
    """

    bits: int
    group_size: int | None = None
    codes: str = "int"
    zero: bool = False
    activations: str | None = None
    act_order: bool = False  # a GPTQ act-order weight: rows sorted by group, ``perm`` kept
    transposed: bool = False  # W8A8 codes kept [out, in] (``codes_t``) for a GPU's 8-bit GEMM
    emulated: bool = False    # off-native, the activations are rounded as stored (above)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or self.codes not in ("int", "fp8") or (
                self.codes == "fp8" and (self.bits != 8 or self.zero)) or (
                self.activations not in (None, *ACTIVATION_SCHEMES)) or (
                self.activations is not None and self.bits != 8 and not self.emulated) or (
                self.activations == "dynamic_group" and self.group_size is None) or (
                self.emulated and self.activations is None) or (
                self.activations == "dynamic_group" and self.act_order) or (
                self.transposed and (self.activations not in ("dynamic", "static")
                                     or self.zero or self.group_size is not None
                                     or self.bits != 8)):
            raise ValueError(f"unsupported quantized format {self!r}")

    @property
    def has_zero(self) -> bool:
        return self.bits == 4 or self.zero

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def shapes(self, in_features: int, out_features: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        """part name -> (shape, numpy dtype) of the stored weight."""
        g = self.groups(in_features)
        if self.bits == 8:
            dtype = np.int8 if self.codes == "int" else FP8_DTYPE
            shapes = ({"codes_t": ((out_features, in_features), dtype)} if self.transposed
                      else {"codes": ((in_features, out_features), dtype)})
        else:
            shapes = {"codes": ((in_features // 2, out_features), np.uint8)}
        shapes["scale"] = ((g, out_features), np.float32)
        if self.has_zero:
            shapes["zero"] = ((g, out_features), np.float32)
        if self.activations == "static":
            shapes["input_scale"] = ((1,), np.float32)
        if self.act_order:
            shapes["perm"] = ((in_features,), np.int32)
        return shapes

    def to_json(self) -> list:
        extra = [self.codes, self.zero, self.activations, self.act_order, self.transposed,
                 self.emulated]
        return [self.bits, self.group_size] + (
            extra if extra != ["int", False, None, False, False, False] else [])


def group_size_for(in_features: int, requested: int = 128) -> int | None:
    """The largest power of two <= ``requested`` dividing ``in_features`` (at least 2);
    None (one group, per output channel) for ``requested=0``."""
    if requested == 0:
        return None
    size = 1 << (max(requested, 2).bit_length() - 1)
    while size > 2 and in_features % size:
        size //= 2
    if in_features % size:
        raise ValueError(f"grouped quantization needs an even input size, got {in_features}")
    return size


def weight_dims(name: str, hidden: int, intermediate: int, q_dim: int, kv_dim: int,
                vocab: int) -> tuple[int, int]:
    """(in_features, out_features) of a quantizable parameter; the embedding's are
    (hidden, vocab), as stored quantized."""
    return {"embed": (hidden, vocab), "lm_head": (hidden, vocab), "q_proj": (hidden, q_dim),
            "k_proj": (hidden, kv_dim), "v_proj": (hidden, kv_dim), "o_proj": (q_dim, hidden),
            "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}[name]


def mode_plan(mode: str, dims: dict[str, tuple[int, int]],
              group_size: int | None = None) -> dict[str, QuantFormat]:
    """The plan of ``"int8"``, ``"int4"`` or ``"fp8"`` for parameters of (in, out) sizes
    ``dims`` (``group_size`` None: the mode's default; ``"fp8"`` takes none). A GPU keeps
    fp8's codes ``[out, in]``: pass the plan through ``prequantized.for_device``."""
    if mode == "fp8":
        if group_size is not None:
            raise ValueError(f"quantization_group_size={group_size!r} applies to 'int8' / "
                             "'int4'; 'fp8' has one scale per output channel")
        return {name: QuantFormat(8, None, "fp8", activations="dynamic")
                for name in dims if name not in VOCAB_PARAMS}
    if mode in ("int8", "int4"):
        size = DEFAULT_GROUP_SIZE[mode] if group_size is None else group_size
        plan = {}
        for name, (k, _) in dims.items():
            if mode == "int4" and name in VOCAB_PARAMS:
                plan[name] = QuantFormat(8, group_size_for(k, VOCAB_INT8_GROUP))
            elif mode == "int8":  # projections asymmetric, vocabulary tables symmetric
                plan[name] = QuantFormat(8, group_size_for(k, size),
                                         zero=name not in VOCAB_PARAMS)
            else:
                plan[name] = QuantFormat(4, group_size_for(k, size))
        return plan
    raise ValueError(f"quantization={mode!r} has no fixed plan")


def plan_to_json(plan: dict[str, QuantFormat]) -> dict[str, list]:
    return {name: fmt.to_json() for name, fmt in plan.items()}


def plan_from_json(data: dict[str, list] | None) -> dict[str, QuantFormat]:
    """``plan_to_json`` undone (plans saved before the extra fields were added too)."""
    return {name: QuantFormat(int(bits), None if group is None else int(group), *extra)
            for name, (bits, group, *extra) in (data or {}).items()}


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [K, N] in 0..15 -> uint8 [K / 2, N]: row 2i low nibble, row 2i + 1 high."""
    return (q[0::2] | (q[1::2] << 4)).astype(np.uint8)


def quantize(weight: np.ndarray, fmt: QuantFormat) -> dict[str, np.ndarray]:
    """A float weight [K, N] -> its stored parts in ``fmt``."""
    w = np.asarray(weight, np.float32)
    k, n = w.shape
    g = fmt.groups(k)
    grouped = w.reshape(g, k // g, n)
    if fmt.codes == "fp8":  # e4m3 codes, the group's max |w| at the format's largest value
        scale = np.abs(grouped).max(axis=1) / FP8_MAX                        # [G, N]
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        codes = np.clip(grouped / scale[:, None, :], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
        codes = codes.reshape(k, n)
        if fmt.transposed:  # a GPU's FP8 GEMM reads [out, in] (prequantized.for_device)
            return {"codes_t": np.ascontiguousarray(codes.T), "scale": scale}
        return {"codes": codes, "scale": scale}
    if fmt.bits == 8 and fmt.zero:  # asymmetric: 256 codes from the group's min to max
        low, high = grouped.min(axis=1), grouped.max(axis=1)                 # [G, N]
        scale = ((high - low) / 255.0).astype(np.float32)
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        q = np.clip(np.rint((grouped - low[:, None, :]) / scale[:, None, :]), 0, 255)
        codes = (q.astype(np.int32) - 128).astype(np.int8)
        zero = (low + 128.0 * scale).astype(np.float32)
        return {"codes": codes.reshape(k, n), "scale": scale, "zero": zero}
    if fmt.bits == 8:
        scale = np.abs(grouped).max(axis=1) / 127.0                          # [G, N]
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        codes = np.clip(np.rint(grouped / scale[:, None, :]), -127, 127).astype(np.int8)
        return {"codes": codes.reshape(k, n), "scale": scale}
    low, high = grouped.min(axis=1), grouped.max(axis=1)                     # [G, N]
    scale = ((high - low) / 15.0).astype(np.float32)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint((grouped - low[:, None, :]) / scale[:, None, :]), 0, 15)
    return {"codes": pack_nibbles(q.astype(np.uint8).reshape(k, n)), "scale": scale,
            "zero": low.astype(np.float32)}


def dequantize(parts: dict[str, np.ndarray]) -> np.ndarray:
    """Stored parts -> the float32 weight [K, N] they stand for (host side, for checks)."""
    scale = parts["scale"]
    if parts["codes"].dtype == np.uint8:  # 4-bit, two per byte
        packed = parts["codes"]
        q = np.empty((2 * packed.shape[0], packed.shape[1]), np.uint8)
        q[0::2], q[1::2] = packed & 15, packed >> 4
    else:
        q = parts["codes"]
    k, n = q.shape
    g = scale.shape[0]
    w = q.reshape(g, k // g, n).astype(np.float32) * scale[:, None, :]
    if "zero" in parts:
        w = w + parts["zero"][:, None, :]
    return w.reshape(k, n)


def quantize_arrays(arrays: Iterable[tuple[tuple, Any]],
                    plan: dict[str, QuantFormat]) -> Iterator[tuple[tuple, Any]]:
    """(path keys, host array) pairs with the planned ones replaced by their parts.

    A source may yield a planned parameter already quantized (a dict of parts, e.g. GGUF
    blocks kept); those pass through. The embedding arrives ``[vocab, hidden]`` and is
    stored ``[hidden, vocab]``.
    """
    for keys, array in arrays:
        fmt = plan.get(keys[-1])
        if fmt is None:
            yield keys, array
            continue
        if not isinstance(array, dict):
            if keys[-1] == "embed":
                array = np.asarray(array).T
            array = quantize(array, fmt)
        for part, value in array.items():
            yield (*keys, part), value


# --- GGUF blocks ---------------------------------------------------------------------

GGUF_KEPT = {"Q8_0": QuantFormat(8, GGUF_BLOCK), "Q4_0": QuantFormat(4, GGUF_BLOCK),
             "Q4_1": QuantFormat(4, GGUF_BLOCK)}


def gguf_parts(raw: np.ndarray, type_name: str, out_features: int,
               in_features: int) -> dict[str, np.ndarray]:
    """A GGUF tensor's raw blocks (uint8 [out, in / 32 * block bytes], HF's [out, in]
    orientation) -> its parts in our [in, out] layout, the same weights bit for bit.

    Q8_0 block: float16 d, 32 int8 q; w = d q.  Q4_0: float16 d, 16 bytes (element j in
    the low nibble of byte j, element j + 16 in the high nibble); w = d (q - 8).
    Q4_1: float16 d, float16 m, 16 bytes as Q4_0; w = d q + m.
    """
    blocks = in_features // GGUF_BLOCK
    data = np.ascontiguousarray(raw).reshape(out_features, blocks, -1)
    d = data[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)      # [out, blocks]
    if type_name == "Q8_0":
        q = data[..., 2:34].copy().view(np.int8).reshape(out_features, in_features)
        return {"codes": np.ascontiguousarray(q.T),
                "scale": np.ascontiguousarray(d.T)}
    if type_name == "Q4_1":
        zero = data[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = data[..., 4:20]
    elif type_name == "Q4_0":
        zero = -8.0 * d
        packed = data[..., 2:18]
    else:
        raise ValueError(f"GGUF type {type_name} is not kept quantized")
    q = np.concatenate([packed & 15, packed >> 4], axis=-1)              # [out, blocks, 32]
    q = q.reshape(out_features, in_features)
    return {"codes": pack_nibbles(np.ascontiguousarray(q.T)),
            "scale": np.ascontiguousarray(d.T), "zero": np.ascontiguousarray(zero.T)}


def stored_bytes(tree: Any) -> int:
    """Bytes of every array leaf of a nested dict (device or host arrays)."""
    if isinstance(tree, dict):
        return sum(stored_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(stored_bytes(value) for value in tree)
    size = getattr(tree, "nbytes", None)
    return int(size) if size is not None else 0


def pack_quantized_panels(tree: Any) -> Any:
    """``tree`` (nested dicts of params) with every quantized weight whose N is a multiple
    of 64 packed by panels (``quantized_matmul.pack_panels``): the CPU kernels' layout,
    read as one stream per panel. Only for models whose matmuls run those kernels
    (``loader._cpu_kernels_run``); ``unpack_quantized_panels`` undoes it (checkpoints are
    plain)."""
    from pallas_kernels.quantized_matmul import (PANEL, is_packed, is_quantized, pack_panels,
                                                 weight_shape)

    if not isinstance(tree, dict):
        return tree
    if is_quantized(tree):
        if "codes" not in tree:  # W8A8 codes kept [out, in] for a GPU: not the CPU's layout
            return tree
        packable = not is_packed(tree) and weight_shape(tree)[1] % PANEL == 0
        return pack_panels(tree) if packable else tree
    return {key: pack_quantized_panels(value) for key, value in tree.items()}


def unpack_quantized_panels(tree: Any) -> Any:
    """``tree`` with every quantized weight in the plain layout (``pack_quantized_panels``
    undone)."""
    from pallas_kernels.quantized_matmul import is_quantized, unpack_panels

    if not isinstance(tree, dict):
        return tree
    if is_quantized(tree):
        return unpack_panels(tree)
    return {key: unpack_quantized_panels(value) for key, value in tree.items()}
