"""How a model's parameters are made, stored and multiplied.

``ParamInit`` makes new parameters (random, ones, zeros, or shapes only for a model whose
weights are loaded next); a projection the quantization plan names is a
``QuantizedWeight`` (``jaxpage.models.quantize``'s parts) instead of an ``nnx.Param``
array. ``linear`` multiplies by either, through ``pallas_kernels``' dense or quantized
matmul.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpage.models.quantize import QuantFormat
from pallas_kernels.dense_matmul import dense_matmul
from pallas_kernels.quantized_matmul import quantized_matmul


class QuantizedWeight(nnx.Module):
    """A weight [in, out] stored quantized (``jaxpage.models.quantize``): its parts
    ``codes``, ``scale`` and, for 4 bits, ``zero``, each an ``nnx.Param``."""

    def __init__(self, fmt: QuantFormat, in_features: int, out_features: int,
                 rngs: nnx.Rngs | None) -> None:
        for part, (shape, dtype) in fmt.shapes(in_features, out_features).items():
            # shapes only: quantized weights are always loaded (or quantized from floats)
            setattr(self, part, nnx.Param(jax.ShapeDtypeStruct(shape, dtype)))
        self.activations = fmt.activations  # static: a W8A8 checkpoint's activation scheme
        self.emulated = fmt.emulated        # and whether it is rounded where not native

    def parts(self) -> dict[str, jax.Array]:
        """The weight's own parts (codes or codes_t, scale, zero), not the activations'
        scale or the input permutation."""
        return {part: getattr(self, part)[...] for part in ("codes", "codes_t", "scale", "zero")
                if hasattr(self, part)}

    def input_permutation(self) -> jax.Array | None:
        """int32 [in]: a GPTQ act-order weight's row order (``x[..., perm] @ W``), else None."""
        return self.perm[...] if hasattr(self, "perm") else None

    def activation_scale(self) -> jax.Array | None:
        """float32 [1]: a static W8A8 checkpoint's ``input_scale``, else None."""
        return self.input_scale[...] if hasattr(self, "input_scale") else None


def linear(x: jax.Array, weight: Any, backend: str = "auto",
           rows: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ weight [in, out]: an ``nnx.Param`` array or a ``QuantizedWeight``
    (weight-only: the product is in x's dtype). ``backend`` picks the kernel of either
    (``pallas_kernels.dense_matmul`` / ``quantized_matmul``; "reference" under a mesh).
    ``rows`` (int32 scalar): x's rows past it are padding, their results unspecified."""
    if isinstance(weight, QuantizedWeight):
        perm = weight.input_permutation()
        if perm is not None:
            x = jnp.take(x, perm, axis=-1)
        return quantized_matmul(x, weight.parts(), backend=backend, rows=rows,
                                activations=weight.activations,
                                input_scale=weight.activation_scale(),
                                emulate=weight.emulated)
    return dense_matmul(x, weight[...], backend=backend, rows=rows)


class ParamInit:
    """New parameters: random normal (std 0.02), ones or zeros; with ``rngs=None`` only
    their shapes (``jax.ShapeDtypeStruct``), for a model whose weights are loaded next.

    Shapes only need no tracing: ``nnx.eval_shape`` of the same model costs ~0.7 s for
    SmolLM2, most of it flax asking each traced parameter for its sharding.
    """

    def __init__(self, rngs: nnx.Rngs | None, dtype: Any,
                 quant_plan: dict[str, QuantFormat] | None = None) -> None:
        self.rngs, self.dtype = rngs, dtype
        self.quant_plan = quant_plan or {}

    def weight(self, name: str, in_features: int, out_features: int):
        """Projection ``name`` [in, out]: quantized when the plan names it, else normal."""
        fmt = self.quant_plan.get(name)
        if fmt is None:
            return self.normal(in_features, out_features)
        if self.rngs is not None:
            raise ValueError("quantized weights are loaded or quantized from floats, not "
                             "initialized at random: build the float model and quantize it")
        return QuantizedWeight(fmt, in_features, out_features, self.rngs)

    def normal(self, *shape: int) -> nnx.Param:
        if self.rngs is None:
            return nnx.Param(jax.ShapeDtypeStruct(shape, self.dtype))
        return nnx.Param(nnx.initializers.normal(0.02)(self.rngs.params(), shape, self.dtype))

    def ones(self, *shape: int) -> nnx.Param:
        if self.rngs is None:
            return nnx.Param(jax.ShapeDtypeStruct(shape, self.dtype))
        return nnx.Param(jnp.ones(shape, self.dtype))

    def zeros(self, *shape: int) -> nnx.Param:
        if self.rngs is None:
            return nnx.Param(jax.ShapeDtypeStruct(shape, self.dtype))
        return nnx.Param(jnp.zeros(shape, self.dtype))
