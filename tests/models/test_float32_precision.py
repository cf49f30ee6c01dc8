"""float32 means float32 on every platform: the models' projections and the reference
attention ask for ``HIGHEST`` precision with float32 operands (a GPU computes a default
precision float32 dot in TF32, which broke the float32 kernel tests on the first H100 run:
docs/benchmarks/accelerator/), and keep the platform's default for bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.models.layers import project
from pallas_kernels.precision import dot_precision
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.kernels.cases import make_case


def lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("dtype,highest", [(jnp.float32, True), (jnp.bfloat16, False),
                                           (jnp.float16, False)])
def test_projection_precision_follows_the_dtype(dtype, highest):
    x, w = jnp.ones((3, 8), dtype), jnp.ones((8, 5), dtype)
    text = lowered(lambda a, b: project("th,hd->td", a, b), x, w)
    assert ("HIGHEST" in text) == highest
    assert dot_precision(dtype) == (jax.lax.Precision.HIGHEST if highest else None)


@pytest.mark.parametrize("dtype,highest", [(np.float32, True), (jnp.bfloat16, False)])
def test_reference_attention_precision_follows_the_dtype(dtype, highest):
    case = make_case(np.random.default_rng(0), [1, 3], [5, 3], dtype=dtype)
    text = lowered(lambda *a: ragged_paged_attention(*a, sm_scale=0.5, backend="reference"),
                   *case.args(poisoned=False))
    assert text.count("HIGHEST") == (4 if highest else 0)  # two dots, two operands each
