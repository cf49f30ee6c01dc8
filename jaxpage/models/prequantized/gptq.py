"""AutoGPTQ / GPTQModel checkpoints (``quant_method: "gptq"``; 4 / 8 bits, act-order)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpage.models.prequantized.base import (Getter, StoredQuantization, group_order,
                                              group_size_of, to_parts, unpack_int32)
from jaxpage.models.quantize import QuantFormat


class GPTQ(StoredQuantization):
    """AutoGPTQ / GPTQModel's format (``quant_method: "gptq"``)."""

    def __init__(self, config: dict[str, Any], directory: str) -> None:
        super().__init__(config, directory, "gptq")
        self.bits = int(config.get("bits", 4))
        if self.bits not in (4, 8):
            raise ValueError(f"{directory!r}: GPTQ with {self.bits} bits is not supported "
                             "(4 and 8 are)")
        self.group_size = int(config.get("group_size", 128))
        fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{directory!r}: GPTQ checkpoint_format {fmt!r} is not supported "
                             "(gptq, gptq_v2 are)")
        self.v1 = fmt == "gptq"  # v1 stores z - 1

    def is_stored(self, module: str, names: set[str]) -> bool:
        return f"{module}.qweight" in names

    def format_of(self, module: str, names: set[str]) -> QuantFormat:
        return QuantFormat(self.bits, None if self.group_size <= 0 else self.group_size,
                           zero=self.bits == 8 and not self.config.get("sym", True),
                           act_order=bool(self.config.get("desc_act")))

    def read(self, get: Getter, names: set[str], module: str,
             fmt: QuantFormat) -> dict[str, np.ndarray]:
        q = unpack_int32(get(f"{module}.qweight"), self.bits, axis=0)                # [K, N]
        words = np.asarray(get(f"{module}.qzeros")).astype(np.int64) & 0xFFFFFFFF
        if self.v1:  # v1 wrote each word less 0x11111111 (with borrows): add it back
            words = (words + (0x11111111 if self.bits == 4 else 0x01010101)) & 0xFFFFFFFF
        z = unpack_int32(words, self.bits, axis=1)                                  # [G, N]
        scale = get(f"{module}.scales").astype(np.float32)                           # [G, N]
        k = q.shape[0]
        z = z[:, :scale.shape[1]]
        g_idx = (np.asarray(get(f"{module}.g_idx"), np.int64) if f"{module}.g_idx" in names
                 else None)
        size = group_size_of(k, scale.shape[0]) or k
        perm = group_order(g_idx, k, size, f"{module}.g_idx")
        if perm is not None:
            if not fmt.act_order:
                raise ValueError(f"{self.directory!r}: {module}.g_idx orders the input rows "
                                 "by group (act-order) but the config's desc_act is not set")
            q = q[perm]
        parts = to_parts(q, scale, z, fmt, 0)
        if fmt.act_order:
            parts["perm"] = (np.arange(k) if perm is None else perm).astype(np.int32)
        return parts
