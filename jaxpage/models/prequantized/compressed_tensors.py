"""llm-compressor's compressed-tensors checkpoints (``quant_method: "compressed-tensors"``):
``float-quantized`` (FP8), ``int-quantized`` / ``naive-quantized`` (int8, or int4 one value
to an int8: W4A8) and ``pack-quantized`` (4 / 8 bits in int32 words), with zero points
where asymmetric. Quantized activations are kept (``QuantFormat.activations``) and, off
native hardware, emulated (``QuantFormat.emulated``), as compressed-tensors runs them."""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from jaxpage.models.prequantized.base import (Getter, StoredQuantization, group_order,
                                              group_size_of, to_parts, unpack_int32)
from jaxpage.models.quantize import FP8_DTYPE, QuantFormat

logger = logging.getLogger("jaxpage")

COMPRESSED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")


class CompressedTensors(StoredQuantization):
    """llm-compressor's format (``quant_method: "compressed-tensors"``)."""

    def __init__(self, config: dict[str, Any], directory: str) -> None:
        super().__init__(config, directory, "compressed-tensors")
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError(f"{directory!r}: compressed-tensors config has no config_groups")
        self.groups = list(groups.values())
        self._warned: set[str] = set()   # activation schemes already warned about
        self.ignore = list(config.get("ignore") or [])
        for group in self.groups:
            fmt = group.get("format") or config.get("format")
            if fmt not in COMPRESSED_FORMATS:
                raise ValueError(f"{directory!r}: compressed-tensors format {fmt!r} is not "
                                 f"supported; supported: {', '.join(COMPRESSED_FORMATS)}")
        for extra in ("transform_config", "sparsity_config"):  # online rotations, 2:4 ...
            if config.get(extra):
                raise ValueError(f"{directory!r}: compressed-tensors with a {extra} "
                                 f"({config[extra]!r}) is not supported")

    def _group(self, module: str) -> dict[str, Any] | None:
        """The config group quantizing ``module``: a group naming it (by name or regex)
        before one targeting every ``Linear``, as compressed-tensors matches; None if
        ignored or untargeted."""
        if any(_matches(target, module) for target in self.ignore):
            return None
        for by_class in (False, True):
            for group in self.groups:
                targets = group.get("targets") or ()
                if any((target == "Linear") if by_class else _matches(target, module)
                       for target in targets):
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
        activations = self._activations(group, bits, group_size)
        # GPTQ's act-order by group (compressed-tensors < 0.20: ``weight_g_idx``)
        act_order = weights.get("actorder") == "group" and kind == "int"
        return QuantFormat(bits, group_size, "fp8" if kind == "float" else "int", zero,
                           activations, act_order, emulated=activations is not None)

    def _activations(self, group: dict[str, Any], bits: int, group_size: int | None
                     ) -> str | None:
        """The activation scheme of ``group`` (``QuantFormat.activations``), or None when it
        quantizes none, or in a way not reproduced here (then weight-only, warned once).
        Reproduced: 8-bit symmetric activations of the weights' type over 8-bit weights
        (or int8 over int4: W4A8), per token (dynamic), per token and weight group
        (dynamic, groups equal to the weight's input groups or blocks) or per tensor
        (static). Only symmetric 8-bit weights without groups can run natively."""
        acts = group.get("input_activations")
        if not acts:
            return None
        weights = group.get("weights") or {}
        scheme = "dynamic" if acts.get("dynamic") else "static"
        strategy = acts.get("strategy")
        if scheme == "dynamic" and strategy == "group" and group_size is not None and (
                int(acts.get("group_size") or 0) == group_size):
            scheme = "dynamic_group"
        elif strategy != ("token" if scheme == "dynamic" else "tensor"):
            scheme = None
        if scheme is None or not (
                (bits == 8 or weights.get("type") == "int") and int(acts.get("num_bits", 0)) == 8
                and acts.get("type") == weights.get("type") and acts.get("symmetric", True)):
            key = repr(sorted(acts.items()))
            if key not in self._warned:
                self._warned.add(key)
                logger.warning("%s: activation quantization %s is not reproduced: those "
                               "projections run weight-only", self.directory, acts)
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
            q = unpack_int32(packed, fmt.bits, axis=1).T                     # [K (padded), N]
            if f"{module}.weight_shape" in names:  # the true [N, K]: packing pads K
                q = q[:int(np.asarray(get(f"{module}.weight_shape")).reshape(-1)[1])]
            k, n = q.shape
            scale = get(f"{module}.weight_scale")
            zp = None
            if not weights.get("symmetric", True):
                zp_stored = np.asarray(get(f"{module}.weight_zero_point"))
                if zp_stored.dtype == np.int32 and zp_stored.shape[0] < n:  # packed by N
                    zp_stored = unpack_int32(zp_stored, fmt.bits, axis=0)[:n]
                    zp_stored = zp_stored - (1 << (fmt.bits - 1))            # stored + offset
                zp = _scale_to_groups(zp_stored, (n, k), weights)            # [G, N]
            scale = _scale_to_groups(scale, (n, k), weights)                # [G, N]
            q, perm = self._by_group(get, names, module, q, scale.shape[0], fmt)
            parts = to_parts(q, scale, zp, fmt, 1 << (fmt.bits - 1))
        else:  # int8 / int4 values stored one to an int8 (int-quantized, e.g. W4A8)
            w = get(f"{module}.weight").astype(np.int32)                     # [N, K]
            offset = 1 << (fmt.bits - 1)
            if w.size and (w.min() < -offset or w.max() >= offset):
                raise ValueError(f"{self.directory!r}: {module}.weight holds values "
                                 f"{w.min()}..{w.max()}, outside {fmt.bits}-bit codes")
            scale = _scale_to_groups(get(f"{module}.weight_scale"), w.shape, weights)
            zp = None
            if not weights.get("symmetric", True):
                zp = _scale_to_groups(get(f"{module}.weight_zero_point"), w.shape, weights)
            q, perm = self._by_group(get, names, module, w.T + offset, scale.shape[0], fmt)
            parts = to_parts(q, scale, zp, fmt, offset)
        if fmt.act_order:  # kept even when in order: the plan gives every layer a perm
            parts["perm"] = (np.arange(q.shape[0]) if perm is None else perm).astype(np.int32)
        if fmt.activations == "static":
            parts["input_scale"] = np.asarray(get(f"{module}.input_scale"),
                                              np.float32).reshape(-1)[:1]
        return parts

    def _by_group(self, get: Getter, names: set[str], module: str, q: np.ndarray,
                  groups: int, fmt: QuantFormat) -> tuple[np.ndarray, np.ndarray | None]:
        """Codes q [K, N] with their rows sorted by group when ``weight_g_idx`` [K] (GPTQ
        act-order by group) assigns rows to groups out of order, and that order (``perm``:
        row i multiplies input ``perm[i]``); None when the rows are in group order."""
        key = f"{module}.weight_g_idx"
        g_idx = np.asarray(get(key), np.int64).reshape(-1) if key in names else None
        perm = group_order(g_idx, q.shape[0], q.shape[0] // groups, f"{self.directory!r}: {key}")
        if perm is None:
            return q, None
        if not fmt.act_order:
            raise ValueError(f"{self.directory!r}: {key} orders the input rows by group, but "
                             "the weights' actorder is not 'group'")
        return q[perm], perm


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def _scale_to_groups(scale: np.ndarray, weight_shape: tuple[int, int],
                     weights: dict[str, Any]) -> np.ndarray:
    """A weight's stored scale (or zero point) -> float32 [G, N] for W [N, K] as stored:
    per tensor ``[1]`` or ``[]`` repeated per channel; per channel ``[N, 1]``; per group
    ``[N, G]``; per block ``[N / bn, K / bk]`` repeated over each block's columns."""
    n, k = weight_shape
    scale = np.asarray(scale, np.float32)
    if scale.size == 1:
        return np.full((1, n), scale.reshape(()), np.float32)
    if weights.get("strategy") == "block":
        bn, bk = (int(x) for x in weights["block_structure"])
        rows = np.repeat(scale, bn, axis=0)[:n]                               # [N, K / bk]
        return np.ascontiguousarray(rows.T)
    if scale.shape[0] != n:
        raise ValueError(f"weight scale {scale.shape} does not match the weight [{n}, {k}]")
    group_size_of(k, scale.shape[1])  # the groups divide K
    return np.ascontiguousarray(scale.T)
