"""AutoAWQ checkpoints (``quant_method: "awq"``, GEMM layout)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpage.models.prequantized.base import (Getter, StoredQuantization, group_size_of,
                                              to_parts, unpack_int32)
from jaxpage.models.quantize import QuantFormat

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i]


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
