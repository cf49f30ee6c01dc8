"""The mixture-of-experts MLP: routing, and both expert forms against a dense loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.models.moe import expert_mlp, gathered_experts, ragged_experts, route

H, I, E = 16, 24, 6


def _weights(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(ks[0], (H, E)), jax.random.normal(ks[1], (E, H, I)) * 0.3,
            jax.random.normal(ks[2], (E, H, I)) * 0.3, jax.random.normal(ks[3], (E, I, H)) * 0.3)


def _dense(x, ids, weights, gate, up, down, first=0):
    """Per token, per routed expert held here: the weighted expert MLP, summed."""
    x, ids, weights = (np.asarray(a, np.float64) for a in (x, ids, weights))
    gate, up, down = (np.asarray(a, np.float64) for a in (gate, up, down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].astype(int), weights[t]):
            if first <= e < first + gate.shape[0]:
                g, u = x[t] @ gate[e - first], x[t] @ up[e - first]
                out[t] += w * ((g / (1 + np.exp(-g))) * u) @ down[e - first]
    return out


def test_route_picks_the_top_k_of_the_softmax_and_renormalizes_when_asked():
    router, *_ = _weights()
    x = jax.random.normal(jax.random.PRNGKey(5), (7, H))
    probs = jax.nn.softmax(np.asarray(x) @ np.asarray(router), axis=-1)
    ids, weights = route(x, router, 2, normalize=False)
    top = np.argsort(-np.asarray(probs), axis=-1)[:, :2]
    np.testing.assert_array_equal(np.asarray(ids), top)
    np.testing.assert_allclose(np.asarray(weights), np.take_along_axis(np.asarray(probs), top, -1),
                               rtol=1e-5)
    _, normed = route(x, router, 2, normalize=True)
    np.testing.assert_allclose(np.asarray(normed).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("form", [ragged_experts, gathered_experts, expert_mlp])
@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("first, held", [(0, E), (2, 3)])  # all experts, or a block of them
def test_expert_forms_equal_a_dense_loop(form, tokens, first, held):
    router, gate, up, down = _weights(1)
    x = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, H))
    ids, weights = route(x, router, 2, normalize=True)
    block = (gate[first:first + held], up[first:first + held], down[first:first + held])
    got = form(x, ids, weights, *block, jax.nn.silu, first)
    np.testing.assert_allclose(np.asarray(got), _dense(x, ids, weights, *block, first),
                               rtol=1e-4, atol=1e-4)
