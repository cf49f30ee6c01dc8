"""The top-k / top-p cut's bisection (``jaxpage.runtime.cut_threshold``, the CPU's method)
compiles for a TPU and a GPU too, at Llama 3's vocabulary: either platform can switch to
it once it is timed there (``scripts/bench_sampler.py`` in ``accelerator_check.sh``)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxpage.parallel.targets import compile_on_device, target_devices
from jaxpage.runtime.cut_threshold import cut_threshold


@pytest.mark.parametrize("target", ["v5e:1x1", "h100"])
def test_the_bisection_compiles_for_tpus_and_gpus_without_a_sort(target):
    rows, vocab = 64, 128256
    compiled = compile_on_device(
        target_devices(target)[0], cut_threshold, ((rows, vocab), jnp.float32),
        ((rows,), jnp.float32), ((rows,), jnp.int32), ((rows,), jnp.float32),
        static_kwargs=dict(method="bisect"))
    assert " sort(" not in compiled.as_text()
