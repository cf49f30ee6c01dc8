"""What every pre-quantized format's reader shares: ``StoredQuantization`` (the plan of
the linears stored quantized, the same in every layer) and the unpacking helpers (int32
words of 4- or 8-bit codes, integer zero points to ``zero = -z * s``, act-order rows
sorted by group)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from jaxpage.arch_config import ArchConfig
from jaxpage.models.quantize import QuantFormat, pack_nibbles

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Getter = Callable[[str], np.ndarray]


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
            formats = {self.format_of(module.format(i), names) for i in range(arch.num_layers)}
            if len(formats) > 1:
                raise ValueError(f"{self.directory!r}: {ours} is stored in several formats "
                                 f"across layers ({sorted(map(str, formats))}); jaxpage "
                                 "needs the same format in every layer")
            plan[ours] = formats.pop()
        if not plan:
            raise ValueError(f"{self.directory!r} says it is quantized with {self.method!r} "
                             "but has no quantized linear tensors")
        self.formats = plan
        return plan

    def is_stored(self, module: str, names: set[str]) -> bool:  # pragma: no cover
        raise NotImplementedError

    def format_of(self, module: str, names: set[str]) -> QuantFormat:  # pragma: no cover
        raise NotImplementedError

    def parts(self, get: Getter, names: set[str], module: str,
              fmt: QuantFormat) -> dict[str, np.ndarray]:
        """``read``'s parts, W8A8 codes laid out ``[out, in]`` where ``fmt`` says so (a GPU's
        8-bit GEMM: ``prequantized.for_device``)."""
        parts = self.read(get, names, module, fmt)
        if fmt.transposed:
            parts["codes_t"] = np.ascontiguousarray(parts.pop("codes").T)
        return parts

    def read(self, get: Getter, names: set[str], module: str,
             fmt: QuantFormat) -> dict[str, np.ndarray]:  # pragma: no cover
        """Module ``module``'s stored tensors (``get(name)``; ``names``: every tensor) ->
        our parts of its weight [in, out] in ``fmt``."""
        raise NotImplementedError


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


def group_order(g_idx: np.ndarray | None, k: int, size: int, name: str) -> np.ndarray | None:
    """``perm`` int64 [K] sorting input rows by group (GPTQ act-order: ``g_idx`` [K] names
    each row's group, ``size`` rows a group), or None when ``g_idx`` is absent or already
    in group order; ``name`` names the tensor in errors."""
    default = np.arange(k) // size
    if g_idx is None or np.array_equal(g_idx, default):
        return None
    if g_idx.shape != (k,):
        raise ValueError(f"{name} has shape {g_idx.shape}, not ({k},)")
    perm = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[perm], default):
        raise ValueError(f"{name} does not give every group {size} rows")
    return perm
