"""The decode memory roofline: the output tokens/s that memory bandwidth alone allows.

One decode step of ``batch`` sequences must read every weight the step uses once (all
layers' projections and the LM head; the embedding table only for ``batch`` rows, which
is negligible) and each sequence's cached keys and values. At peak bandwidth ``bw``:

    step_s >= (weight_bytes + batch * context * kv_bytes_per_token) / bw
    output tokens/s <= batch / step_s

``batch`` is the engine's concurrency (``min(max_num_seqs, num_requests)``) and
``context`` the mean context length during decode (mean prompt + half the mean output).
Prefill time is not in the bound, so the fraction reached understates how close decode
itself runs to the roof; it is a whole-run figure of merit, not a kernel measurement.
"""

from __future__ import annotations

from typing import Any

# Peak HBM bandwidth (bytes/s) by a substring of JAX's device_kind (vendor data sheets).
PEAK_BANDWIDTH = [("H200", 4.8e12), ("H100", 3.35e12), ("GH200", 4.0e12), ("A100", 2.0e12),
                  ("L4", 0.3e12), ("TPU v6", 1.64e12), ("TPU v5p", 2.765e12),
                  ("TPU v5 lite", 0.819e12), ("TPU v5e", 0.819e12), ("TPU v4", 1.2e12)]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def peak_bandwidth(device_kind: str) -> float | None:
    for needle, bw in PEAK_BANDWIDTH:
        if needle.lower() in device_kind.lower():
            return bw
    return None


def decode_bytes(arch, dtype: str) -> tuple[int, int]:
    """(weight bytes read per decode step, KV bytes per cached token) for an ArchConfig."""
    size = DTYPE_BYTES[dtype]
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    weights = arch.num_layers * per_layer + arch.vocab_size * h + h   # layers, LM head, norm
    kv_per_token = arch.num_layers * 2 * kv
    return weights * size, kv_per_token * size


def roofline(arch, dtype: str, batch: int, context: float, bandwidth: float) -> dict[str, Any]:
    weights, kv_per_token = decode_bytes(arch, dtype)
    step_s = (weights + batch * context * kv_per_token) / bandwidth
    return {"roofline_batch": batch, "roofline_context": context,
            "weight_bytes": weights, "kv_bytes_per_token": kv_per_token,
            "peak_bandwidth_gbs": bandwidth / 1e9, "roofline_output_tokens_per_s": batch / step_s}
