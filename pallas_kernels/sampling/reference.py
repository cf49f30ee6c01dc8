"""The last step of sampling in plain jnp (any platform): Gumbel noise, the first argmax,
and ``sample_rows``, one token per row from logits that penalties and masks already
adjusted. ``cpu_kernel.cc`` computes the same thing in one pass per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def first_argmax(values: jax.Array) -> jax.Array:
    """int32 [S]: the first index of each row's maximum of ``values`` [S, V], as
    ``jnp.argmax`` (NaN aside). XLA's CPU argmax is a variadic reduce, several times slower
    than a max followed by the smallest index holding it (indices as float32: exact below 2**24,
    and float reductions vectorize where int32 ones did not)."""
    vocab = values.shape[-1]
    top = jnp.max(values, axis=-1, keepdims=True)                           # [S, 1]
    index = jnp.arange(vocab, dtype=jnp.float32)
    return jnp.min(jnp.where(values == top, index, float(vocab)), axis=-1).astype(jnp.int32)


def _mix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 whose every output bit
    depends on every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel_noise(seeds: jax.Array, index: jax.Array, vocab: int) -> jax.Array:
    """float32 [S, V] standard Gumbel noise; entry (i, v) depends only on ``seeds[i]``
    (uint32), ``index[i]`` (the row's sample number) and ``v``.

    A counter-based hash (splitmix's pattern: a per-draw key plus the token id times the
    golden ratio, then a strong mixer) in a few integer operations per entry, where
    ``jax.random``'s threefry takes dozens, which made the noise most of sampling's cost
    on the CPU (``docs/benchmarks/design_measurements.md``).
    """
    golden = jnp.uint32(0x9E3779B9)
    key = _mix32(_mix32(seeds.astype(jnp.uint32)) ^ (index.astype(jnp.uint32) * golden
                                                     + jnp.uint32(0x7F4A7C15)))   # [S]
    bits = _mix32(key[:, None] + jnp.arange(vocab, dtype=jnp.uint32)[None, :] * golden)
    uniform = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))       # (0, 1)
    return -jnp.log(-jnp.log(uniform))


def kept_scaled(logits: jax.Array, temperature: jax.Array, threshold: jax.Array,
                min_p: jax.Array) -> jax.Array:
    """float32 [S, V]: logits / temperature (1 for greedy rows) where a sampled row keeps
    the token (``sample_rows``' rule: logit >= ``threshold``, and within ``min_p`` of the
    row's top when min_p > 0), -inf elsewhere."""
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    floor = (jnp.max(scaled, axis=-1) + jnp.log(jnp.maximum(min_p, 1e-30)))[:, None]
    keep = (logits >= threshold[:, None]) & ((min_p[:, None] <= 0) | (scaled >= floor))
    return jnp.where(keep, scaled, -jnp.inf)


def sample_rows(logits: jax.Array, temperature: jax.Array, threshold: jax.Array,
                min_p: jax.Array, seeds: jax.Array, index: jax.Array,
                stochastic: bool | None = None) -> jax.Array:
    """int32 [S]: one token per row of ``logits`` float32 [S, V].

    A row with ``temperature`` [S] 0 takes its first argmax (greedy). Any other row
    keeps the tokens whose logit is at least ``threshold`` [S] (unscaled; -inf: all; a
    top-k / top-p cut from the caller) and, when ``min_p`` [S] > 0, whose scaled logit
    (logit / temperature) is at least the row's largest plus log(min_p); it takes the first
    argmax of the kept scaled logits plus ``gumbel_noise(seeds, index)`` (Gumbel-max: a
    draw from their softmax).

    ``stochastic``: None draws the noise only when some row samples (a conditional on the
    device); True draws it for every row (greedy rows still take their argmax); False
    leaves it out, for a caller that knows every temperature is 0.
    """
    sampled = temperature > 0                                               # [S]
    greedy = first_argmax(logits)

    def draw() -> jax.Array:
        filtered = kept_scaled(logits, temperature, threshold, min_p)
        drawn = first_argmax(filtered + gumbel_noise(seeds, index, logits.shape[-1]))
        return jnp.where(sampled, drawn, greedy)

    if stochastic is not None:
        return draw() if stochastic else greedy
    return jax.lax.cond(jnp.any(sampled), draw, lambda: greedy)
