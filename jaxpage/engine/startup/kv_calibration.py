"""Scales of a byte KV cache (int8 / fp8), measured once at start-up.

A byte cache stores ``k / scale`` and ``v / scale`` with a scale per layer, KV head and
channel (``CausalLM.kv_scale``, ``pallas_kernels.kv_quant``). The scales come from one
forward pass of the model over a fixed calibration text (English prose, code, numbers;
random token ids for a model without a tokenizer): the largest |k| and |v| seen per
channel, times ``HEADROOM``, maps to the format's largest value. Values beyond it
saturate. Keys have a few channels far larger than the rest (RoPE pairs), which a scale
per channel absorbs; a scale per layer would give them all the code points.

Not for an int8 cache, in either layout: that one stores a scale per token and KV head
with the token (``pallas_kernels.kv_token_scale``) and calibrates nothing. So this is the
fp8 caches' (e4m3, e5m2).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from pallas_kernels.kv_quant import MAX_VALUE

HEADROOM = 1.25  # calibrated |max| -> 80% of the format's range
MAX_CALIBRATION_TOKENS = 512
CALIBRATION_TEXT = """\
The history of computing is a history of abstractions. Early machines were programmed by
rewiring panels; later, stored programs let the same hardware run many tasks. Compilers
turned readable code into machine instructions, and operating systems shared one computer
among many users. Today a phone holds more memory than the rooms of machines that sent
people to the Moon in 1969, and a data center runs millions of requests every second.

def moving_average(values, window=3):
    '''Return the averages of each run of `window` consecutive values.'''
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out

Q: What is the boiling point of water at sea level?
A: 100 degrees Celsius, or 212 degrees Fahrenheit.

| city | population (millions) | country |
|------|-----------------------|---------|
| Tokyo | 37.4 | Japan |
| Delhi | 31.0 | India |
| Lagos | 15.4 | Nigeria |

Dear team, the quarterly report is attached. Revenue grew 12% while costs stayed flat,
so we can hire two more engineers next month. Please send your comments by Friday.
"""


def calibration_ids(tokenizer: Any, vocab_size: int, max_len: int) -> np.ndarray:
    """int32 [T] token ids of the calibration text (seeded random ids without a tokenizer)."""
    limit = min(MAX_CALIBRATION_TOKENS, max_len)
    if tokenizer is not None:
        ids = np.asarray(tokenizer(CALIBRATION_TEXT).input_ids[:limit], np.int32)
        if len(ids) >= 16 and ids.max() < vocab_size:
            return ids
    return np.random.default_rng(0).integers(0, vocab_size, limit).astype(np.int32)


def calibrate_kv_scales(model: Any, kv_format: str, tokenizer: Any, max_len: int) -> np.ndarray:
    """Set ``model.kv_scale`` from one forward pass; returns the scales [2, L, Hkv, D]."""
    ids = calibration_ids(tokenizer, model.cfg.vocab_size, max_len)
    graphdef, state = nnx.split(model)
    amax = jax.jit(lambda st, x: nnx.merge(graphdef, st).kv_amax(x))(state, ids)
    scale = np.maximum(np.asarray(amax) * HEADROOM / MAX_VALUE[kv_format], 1e-8)
    current = model.kv_scale[...]
    model.kv_scale[...] = jax.device_put(scale.astype(np.float32), current.sharding)
    return scale
