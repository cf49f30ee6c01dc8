"""Mixture-of-experts MLP: grouped (ragged) matmuls against a dense loop over experts.

    python scripts/bench_moe.py [--hidden 1024] [--expert 1408] [--experts 8] [--top-k 2]

Forms: ``ragged`` (assignments sorted by expert, one ``jax.lax.ragged_dot`` per
projection), ``gathered`` (each assignment's expert weights gathered: reads T * k
experts), ``engine`` (``jaxpage.models.moe.expert_mlp``: what the model runs, gathered on
the CPU when T * k < experts, else ragged), and the dense loop (every expert on every
token, outputs weighted, zero for unrouted experts). All jitted, outputs checked against
the dense loop; median milliseconds per call on this machine's default JAX backend.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench_common import median_ms
from jaxpage.models.moe import expert_mlp, gathered_experts, ragged_experts, route


def dense_mlp(x, ids, weights, gate, up, down):
    """Every expert on every token, weighted by its routing weight (0 when unrouted)."""
    num_experts = gate.shape[0]
    dense_weights = jnp.zeros((x.shape[0], num_experts), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], ids].set(weights)                # [T, E]
    h = jax.nn.silu(jnp.einsum("th,ehi->eti", x, gate)) * jnp.einsum("th,ehi->eti", x, up)
    out = jnp.einsum("eti,eih->eth", h, down)                              # [E, T, H]
    return jnp.einsum("eth,te->th", out, dense_weights).astype(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert", type=int, default=1408)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", default="1,16,128,512")
    args = parser.parse_args()
    key = jax.random.PRNGKey(0)
    ks = jax.random.split(key, 5)
    H, I, E = args.hidden, args.expert, args.experts
    router = jax.random.normal(ks[0], (H, E)) * 0.1
    gate = jax.random.normal(ks[1], (E, H, I)) * 0.02
    up = jax.random.normal(ks[2], (E, H, I)) * 0.02
    down = jax.random.normal(ks[3], (E, I, H)) * 0.02
    forms = {name: jax.jit(lambda x, i, w, g, u, d, f=f: f(x, i, w, g, u, d, jax.nn.silu))
             for name, f in (("engine", expert_mlp), ("ragged", ragged_experts),
                             ("gathered", gathered_experts))}
    dense = jax.jit(dense_mlp)
    print(f"# {jax.default_backend()}, hidden {H}, expert width {I}, {E} experts, "
          f"top {args.top_k}, float32; median ms per call")
    print("| tokens | engine (expert_mlp) | ragged_dot | gathered | dense loop "
          "| dense / engine |")
    print("|---|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        x = jax.random.normal(ks[4], (tokens, H))
        ids, weights = jax.jit(route, static_argnums=(2, 3))(x, router, args.top_k, True)
        operands = (x, ids, weights, gate, up, down)
        reference = dense(*operands)
        ms = {}
        for name, fn in forms.items():
            got = fn(*operands)
            err = float(jnp.max(jnp.abs(got - reference)) / jnp.max(jnp.abs(reference)))
            assert err < 1e-4, f"{name} and the dense loop differ: {err}"
            ms[name] = median_ms(fn, *operands)
        d = median_ms(dense, *operands)
        print(f"| {tokens} | {ms['engine']:.2f} | {ms['ragged']:.2f} | {ms['gathered']:.2f} "
              f"| {d:.2f} | {d / ms['engine']:.2f}x |")


if __name__ == "__main__":
    main()
