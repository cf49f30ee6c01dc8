"""The C++ CPU attention kernel (``backend="cpu"``, an XLA FFI call) against the reference.

Same cases as the Pallas kernels (``cases.py``: NaN in every cache slot no sequence owns
and in padding query rows, junk block-table entries past each sequence's end), in
float32, the kernel's one dtype; plus the fallbacks of ``"auto"`` and the errors of an
explicit ``"cpu"``.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import cpu, ragged_paged_attention, resolve_backend
from tests.kernels.cases import make_case, random_lens
from tests.kernels.test_attention_kernels import FAST_CASES, rng_for

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the kernel")


def compare(case, *, sm_scale=0.125, sliding_window=None, soft_cap=None, jit=False):
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    want = np.asarray(ragged_paged_attention(*case.args(poisoned=False), backend="reference", **kw))
    call = lambda *a: ragged_paged_attention(*a, backend="cpu", **kw)  # noqa: E731
    got = np.asarray((jax.jit(call) if jit else call)(*case.args(poisoned=True)))
    assert got.shape == case.q.shape and got.dtype == np.float32
    assert np.isfinite(got).all(), np.unique(np.argwhere(~np.isfinite(got))[:, 0])
    n = case.num_real_tokens
    np.testing.assert_allclose(got[:n], want[:n], rtol=2e-5, atol=2e-5)
    assert (got[n:] == 0).all(), "padding token rows must come back zero"


@pytest.mark.parametrize("name", sorted(FAST_CASES))
def test_kernel_matches_reference(name):
    q_lens, kv_lens, options = FAST_CASES[name]
    options = dict(options, dtype=np.float32)
    compare(make_case(rng_for("cpu", name), q_lens, kv_lens, **options), jit=True)


@pytest.mark.parametrize("seed", [*range(3), *(pytest.param(seed, marks=pytest.mark.slow)
                                               for seed in range(3, 16))])
def test_random_matrix(seed):
    rng = rng_for("cpu-matrix", seed)
    kind = ["decode", "prefill", "mixed", "boundary"][seed % 4]
    num_kv_heads = int(rng.choice([1, 2, 3]))
    group = int(rng.choice([1, 3, 4, 8]))
    block_size = int(rng.choice([1, 4, 8, 16]))
    q_lens, kv_lens = random_lens(rng, kind, int(rng.integers(1, 6)), 80, block_size)
    case = make_case(rng, q_lens, kv_lens, num_q_heads=group * num_kv_heads,
                     num_kv_heads=num_kv_heads, head_dim=int(rng.choice([32, 64, 128])),
                     block_size=block_size, pad_seqs=int(rng.integers(0, 3)),
                     pad_tokens=int(rng.integers(0, 5)))
    window = int(rng.integers(1, 20)) if rng.random() < 0.4 else None
    cap = float(rng.uniform(1, 10)) if rng.random() < 0.4 else None
    compare(case, sm_scale=float(rng.uniform(0.05, 0.3)), sliding_window=window, soft_cap=cap)


def test_long_prefill_spans_many_query_tiles():
    """130 new tokens of 9 heads: more than one tile of query rows per sequence."""
    case = make_case(rng_for("cpu-long"), [130, 1, 40], [200, 77, 40], num_q_heads=9,
                     num_kv_heads=3, block_size=16)
    compare(case, jit=True)


def test_no_sequences_gives_zeros():
    case = make_case(rng_for("cpu-empty"), [2], [5])
    q, k, v, lens, tables, cu, _ = case.args(poisoned=True)
    got = ragged_paged_attention(q, k, v, lens, tables, cu, jnp.zeros(1, jnp.int32),
                                 sm_scale=1.0, backend="cpu")
    assert (np.asarray(got) == 0).all()


def test_kernel_runs_inside_scan_and_while_loop():
    case = make_case(rng_for("cpu-loop"), [1, 3], [9, 20])
    args = case.args(poisoned=False)

    def looped(backend):
        def body(i, acc):
            return acc + ragged_paged_attention(*args, sm_scale=0.2, backend=backend)
        return jax.jit(lambda: jax.lax.fori_loop(0, jnp.int32(3), body,
                                                 jnp.zeros_like(args[0])))()

    np.testing.assert_allclose(np.asarray(looped("cpu")), np.asarray(looped("reference")),
                               rtol=2e-5, atol=2e-5)


def test_auto_picks_the_kernel_for_float32_only_and_explicit_cpu_explains():
    assert resolve_backend("auto") == "cpu"
    assert resolve_backend("auto", dtype=jnp.bfloat16) == "reference"
    with pytest.raises(ValueError, match="float32"):
        resolve_backend("cpu", dtype=jnp.bfloat16)
    case = make_case(rng_for("cpu-bf16"), [1], [5], dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        ragged_paged_attention(*case.args(poisoned=False), sm_scale=1.0, backend="cpu")
    # "auto" on a bfloat16 cache quietly takes the reference.
    got = ragged_paged_attention(*case.args(poisoned=False), sm_scale=1.0, backend="auto")
    assert got.dtype == jnp.bfloat16


def test_auto_falls_back_to_the_reference_without_the_kernel(monkeypatch):
    monkeypatch.setattr(cpu, "available", lambda dtype=jnp.float32: False)
    assert resolve_backend("auto") == "reference"
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        resolve_backend("cpu")


def test_loading_the_kernel_keeps_subnormal_floats():
    """The library must not change the process's float state (as -ffast-math's crtfastmath
    would, flushing subnormals to zero for numpy, torch and XLA alike)."""
    assert cpu.register()
    tiny = np.finfo(np.float32).smallest_subnormal
    assert np.float32(tiny) * np.float32(2) > 0
