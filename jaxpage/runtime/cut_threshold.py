"""The top-k / top-p cut of a sampled row: the smallest logit the row keeps.

The rule (vLLM's): rank the row's logits in descending order; a token is kept when its rank
is below ``k`` and the probability mass ranked above it (the temperature-scaled softmax
over the top ``k`` ranks) is below ``top_p``; the top token is always kept. The cut is
the logit of the last kept rank, and every token whose logit is at least the cut is
kept (ties with it included).

Two ways to find it, the same cut up to the rounding of the mass sums:

* ``sorted_cut``: sort the row, a running sum of the probabilities, read the cut off.
* ``bisected_cut``: no sort. A float maps to a uint32 key with the same order
  (``order_keys``), and whether a candidate cut ``t`` keeps its first rank is a count
  and a masked sum over the row (``#{x > t} < k`` and ``mass{x > t} < top_p``), which
  only grow as ``t`` falls. The smallest key where it holds is found by halving the key
  range, 32 passes over the row, and it is always one of the row's logits: the condition
  only changes where ``t`` crosses one. The top-``k`` normaliser takes a first bisection
  for the ``k``-th largest logit (counts only).

XLA:CPU sorts slowly (a 49k vocabulary: ~12 ms a row on this project's CPU), where the
bisection's passes are plain fused reductions: 5.8x faster there
(``scripts/bench_sampler.py`` times both). On GPUs and TPUs the sort stays until the
bisection is timed there: its 64 passes read ~384 bytes per logit, which at 128 rows of
a 262k vocabulary is ~13 GB a step, not obviously less than a sort (``cut_method``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._backend import current_platform

METHODS = ("sort", "bisect")
_SIGN = 0x80000000


def cut_method(platform: str | None = None) -> str:
    """``"bisect"`` on the CPU (timed faster); ``"sort"`` on GPUs and TPUs, where the
    bisection is compiled, not timed (an H200's timed decode step sorted)."""
    return "bisect" if (platform or current_platform()) == "cpu" else "sort"


def order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of float32 ``x`` (same shape) in the floats' order: ``a < b`` exactly when
    ``key(a) < key(b)``, with -0.0 and +0.0 one key (NaNs are not ordered)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    return jnp.where(bits >= jnp.uint32(_SIGN), ~bits, bits | jnp.uint32(_SIGN))


def key_values(keys: jax.Array) -> jax.Array:
    """The float32 each uint32 key of ``order_keys`` stands for."""
    bits = jnp.where(keys >= jnp.uint32(_SIGN), keys & jnp.uint32(_SIGN - 1), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _smallest_key(keys: jax.Array, holds) -> jax.Array:
    """uint32 [S]: per row of ``keys`` [S, V], the smallest key ``t`` with ``holds(t)``
    (bool [S] from uint32 [S]), given that it holds at the row's largest key and, as ``t``
    falls, stops holding once and for all (before the row's smallest key)."""
    lo = jnp.min(keys, axis=-1) - jnp.uint32(1)   # does not hold (a logit's key is >= 2**23)
    hi = jnp.max(keys, axis=-1)                   # holds

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // jnp.uint32(2)
        ok = holds(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def bisected_cut(logits: jax.Array, temperature: jax.Array, k: jax.Array,
                 top_p: jax.Array) -> jax.Array:
    """float32 [S]: each row's cut (the module's rule) by bisection. ``logits`` float32
    [S, V] (-inf for tokens already ruled out); ``temperature`` > 0 [S]; ``k`` int32 [S]
    in [1, V]; ``top_p`` float32 [S] in (0, 1] (1: no top-p cut)."""
    keys = order_keys(logits)                                               # [S, V]

    def count_above(t: jax.Array) -> jax.Array:                             # [S]
        return jnp.sum(keys > t[:, None], axis=-1, dtype=jnp.int32)

    vocab = logits.shape[-1]
    # Each bisection runs only when some row needs it: with k = V the k-th largest is the
    # row's minimum, and with top_p = 1 the cut is the k-th largest.
    kth = jax.lax.cond(jnp.any(k < vocab),                                  # [S]
                       lambda: _smallest_key(keys, lambda t: count_above(t) < k),
                       lambda: jnp.min(keys, axis=-1))

    def top_p_cut() -> jax.Array:                                           # [S]
        top = jnp.max(logits, axis=-1, keepdims=True)                       # [S, 1]
        weight = jnp.exp((logits - top) / temperature[:, None])             # [S, V]; -inf: 0
        kth_weight = jnp.exp((key_values(kth) - top[:, 0]) / temperature)
        ties_in = (k - count_above(kth)).astype(jnp.float32)  # ranks of the k-th value in k
        total = (jnp.sum(jnp.where(keys > kth[:, None], weight, 0.0), axis=-1)
                 + ties_in * kth_weight)
        budget = top_p * total

        def keeps_first_rank(t: jax.Array) -> jax.Array:                    # [S]
            mass = jnp.sum(jnp.where(keys > t[:, None], weight, 0.0), axis=-1)
            return (count_above(t) < k) & ((top_p >= 1.0) | (mass < budget))

        return _smallest_key(keys, keeps_first_rank)

    return key_values(jax.lax.cond(jnp.any(top_p < 1.0), top_p_cut, lambda: kth))


def sorted_cut(logits: jax.Array, temperature: jax.Array, k: jax.Array,
               top_p: jax.Array) -> jax.Array:
    """float32 [S]: each row's cut (the module's rule) from the sorted row; arguments as
    for ``bisected_cut``."""
    vocab = logits.shape[-1]
    ordered = -jnp.sort(-logits, axis=-1)                                   # [S, V] descending
    rank = jnp.arange(vocab)[None, :]
    within_k = rank < k[:, None]
    probs = jax.nn.softmax(jnp.where(within_k, ordered / temperature[:, None], -jnp.inf),
                           axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs     # probability mass ranked above each token
    keep = within_k & ((top_p[:, None] >= 1.0) | (before < top_p[:, None]))
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    return jnp.take_along_axis(ordered, (num_keep - 1)[:, None], axis=-1)[:, 0]


def rows_cut(temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
             vocab: int) -> jax.Array:
    """bool [S]: the rows whose top-k or top-p cuts something (sampled rows only)."""
    return (temperature > 0) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))


def cut_threshold(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, method: str | None = None) -> jax.Array:
    """float32 [S]: the smallest logit (unscaled) each sampled row of ``logits`` [S, V]
    keeps under its ``top_k`` (<= 0 or >= V: none) and ``top_p`` (1: none); -inf where
    neither cuts or the row is greedy (temperature 0). ``method``: one of ``METHODS``
    (default ``cut_method()``, for the platform being built for)."""
    method = method or cut_method()
    if method not in METHODS:
        raise ValueError(f"cut method={method!r} is not one of {METHODS}")
    vocab = logits.shape[-1]
    sampled = temperature > 0                                               # [S]
    cuts = rows_cut(temperature, top_k, top_p, vocab)                       # [S]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab).astype(jnp.int32)
    temperature = jnp.where(sampled, temperature, 1.0)
    find = bisected_cut if method == "bisect" else sorted_cut
    return jnp.where(cuts, find(logits, temperature, k, top_p), -jnp.inf)
