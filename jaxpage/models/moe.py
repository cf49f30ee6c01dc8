"""Mixture-of-experts MLP: top-k routing and grouped (ragged) matmuls over the experts.

Each token's hidden state goes to its ``k`` highest-scoring experts. The (token, expert)
assignments are sorted by expert, so every expert's rows are contiguous, and each expert
projection is one ``jax.lax.ragged_dot`` over all of them (``group_sizes`` rows per
expert): no dense loop over experts, no capacity padding, no dropped tokens. The outputs
are weighted by the routing scores and summed back into their tokens.

Under tensor parallelism the experts are split over the mesh axis (expert parallelism):
every device holds ``num_experts / N`` experts and all tokens (activations are
replicated between layers), computes the assignments to its own experts, and the
partial outputs are summed across devices (``psum``). Routing runs on every device
from the replicated router, so all agree on the assignments.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpage.parallel.sharding_rules import TP
from pallas_kernels._backend import current_platform
from pallas_kernels.precision import dot_precision


def route(x: jax.Array, router: jax.Array, k: int,
          normalize: bool) -> tuple[jax.Array, jax.Array]:
    """x [T, H], router [H, E] -> (expert ids int32 [T, k], weights float32 [T, k]):
    the softmax over all experts' logits, its top ``k``, renormalized to sum 1 when
    ``normalize`` (Mixtral, Qwen3-MoE), else kept as they are (Qwen2-MoE)."""
    logits = jnp.einsum("th,he->te", x, router, precision=dot_precision(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def expert_mlp(x: jax.Array, ids: jax.Array, weights: jax.Array, gate: jax.Array,
               up: jax.Array, down: jax.Array, act: Callable, first_expert=0) -> jax.Array:
    """The experts ``[first_expert, first_expert + E)`` held here, applied to their
    assignments: x [T, H], ids / weights [T, k], gate / up [E, H, I], down [E, I, H]
    -> [T, H], the weighted sum of this block of experts' outputs per token (assignments
    to other experts contribute zeros).

    Grouped matmuls (``ragged_experts``) everywhere, except on the CPU with fewer
    assignments than experts (decode batches): XLA's CPU ragged_dot computes every
    expert, so there each assignment's expert weights are gathered instead and only
    T * k experts are read (``gathered_experts``; ``scripts/bench_moe.py``: 4.6x at one
    token of 8 experts, top 2).
    """
    if ids.size < gate.shape[0] and current_platform() == "cpu":
        return gathered_experts(x, ids, weights, gate, up, down, act, first_expert)
    return ragged_experts(x, ids, weights, gate, up, down, act, first_expert)


def gathered_experts(x, ids, weights, gate, up, down, act: Callable,
                     first_expert=0) -> jax.Array:
    """``expert_mlp`` by gathering each assignment's expert weights ([T*k, H, I])."""
    num_tokens, k = ids.shape
    expert = ids.reshape(-1) - first_expert                           # [T*k]
    here = (expert >= 0) & (expert < gate.shape[0])
    expert = jnp.where(here, expert, 0)
    token = jnp.repeat(jnp.arange(num_tokens), k)
    rows = x[token]                                                   # [T*k, H]
    precision = dot_precision(x.dtype)
    hidden = act(jnp.einsum("ah,ahi->ai", rows, gate[expert], precision=precision)) * \
        jnp.einsum("ah,ahi->ai", rows, up[expert], precision=precision)
    out = jnp.einsum("ai,aih->ah", hidden, down[expert], precision=precision)
    out = jnp.where(here[:, None], out.astype(jnp.float32) * weights.reshape(-1)[:, None], 0.0)
    summed = jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token].add(out)
    return summed.astype(x.dtype)


def ragged_experts(x, ids, weights, gate, up, down, act: Callable,
                   first_expert=0) -> jax.Array:
    """``expert_mlp`` as grouped matmuls over the assignments sorted by expert."""
    num_tokens, k = ids.shape
    num_local = gate.shape[0]
    expert = ids.reshape(-1) - first_expert                           # [T*k]
    here = (expert >= 0) & (expert < num_local)
    key = jnp.where(here, expert, num_local)          # others sort last, in no group
    order = jnp.argsort(key, stable=True)                             # [T*k]
    token = order // k
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    rows = x[token]                                                   # [T*k, H]
    precision = dot_precision(x.dtype)
    dot = functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes, precision=precision)
    hidden = act(dot(rows, gate)) * dot(rows, up)                     # [T*k, I]
    out = dot(hidden, down).astype(jnp.float32)                       # [T*k, H]
    scale = weights.reshape(-1)[order][:, None]
    out = jnp.where(here[order][:, None], out * scale, 0.0)  # rows past the groups: zero
    summed = jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token].add(out)
    return summed.astype(x.dtype)


def moe_mlp(x: jax.Array, router: jax.Array, gate: jax.Array, up: jax.Array,
            down: jax.Array, *, k: int, normalize: bool, act: Callable,
            mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """x [T, H] -> [T, H]: routing, then the experts (split over ``mesh``'s axis if any)."""
    ids, weights = route(x, router, k, normalize)
    if mesh is None:
        return expert_mlp(x, ids, weights, gate, up, down, act)

    def local(x, ids, weights, gate, up, down):
        first = jax.lax.axis_index(TP) * gate.shape[0]
        return jax.lax.psum(expert_mlp(x, ids, weights, gate, up, down, act, first), TP)

    experts = P(TP, None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), experts, experts, experts),
                         out_specs=P(), check_vma=False)(x, ids, weights, gate, up, down)
