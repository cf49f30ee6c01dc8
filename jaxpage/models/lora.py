"""Multi-LoRA on the device: adapter slots stacked per projection, one program for any mix.

With LoRA enabled, every adaptable projection of every layer (``peft_adapter.LORA_TARGETS``;
the MLP ones only in dense layers) gets two parameters of fixed shape:

* ``{target}_lora_a`` [in, L * r]: slot s's A^T in columns ``[s*r, (s+1)*r)``;
* ``{target}_lora_b`` [L * r, out]: slot s's scaled B^T in the same rows,

for ``L = max_loras`` slots of rank ``r = max_lora_rank`` (smaller adapters are padded
with zeros; an empty slot is all zeros). A batch row names its slot (``lora_slot``, 1..L;
0 is the base model), and each token's delta is

    delta = ((x @ lora_a) * mask) @ lora_b,    mask[t, j] = (j // r == slot(t) - 1)

so rows with different adapters (or none) share one matmul pair per projection, and the
program's shapes never depend on which adapters are loaded. That reads every slot's
weights once, ``L*r*(in+out)`` elements, whatever the tokens. When a step has fewer tokens
than there are slots (decoding a few sequences with many slots), each token instead
gathers its own slot's A and B (``T*r*(in+out)`` elements) and the product runs per
token; which of the two is decided by the static shapes, so each program has one
(``lora_delta``). Writing a slot (``write_slot``) is a program of its own that replaces
the slot's columns and rows.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpage.arch_config import ArchConfig
from jaxpage.models.peft_adapter import LORA_TARGETS, LoRAWeights, projection_shape
from jaxpage.parallel.sharding_rules import repeat_kv_heads
from pallas_kernels._backend import searchsorted_right
from pallas_kernels.precision import dot_precision


def layer_targets(arch: ArchConfig, layer: int) -> tuple[str, ...]:
    """The projections of ``layer`` that carry LoRA slots."""
    if arch.is_sparse(layer):
        return LORA_TARGETS[:4]
    return LORA_TARGETS


def attach_lora(model: Any, max_loras: int, max_rank: int,
                mesh: jax.sharding.Mesh | None = None, *, abstract: bool = False) -> None:
    """Give ``model`` (a ``CausalLM`` as it runs: its ``cfg`` is the run architecture)
    empty LoRA slots: zeros in the model dtype, replicated over ``mesh``; with
    ``abstract`` only their shapes (a model built with ``rngs=None``, for planning)."""
    cfg = model.cfg
    dtype = model.final_norm.get_value().dtype if abstract else model.final_norm[...].dtype
    width = max_loras * max_rank
    sharding = None if mesh is None else jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec())
    for index, layer in enumerate(model.layers):
        for target in layer_targets(cfg, index):
            size_in, size_out = projection_shape(cfg, target)
            for suffix, shape in (("a", (size_in, width)), ("b", (width, size_out))):
                if abstract:
                    setattr(layer, f"{target}_lora_{suffix}",
                            nnx.Param(jax.ShapeDtypeStruct(shape, dtype)))
                    continue
                zeros = jnp.zeros(shape, dtype)
                if sharding is not None:
                    zeros = jax.device_put(zeros, sharding)
                setattr(layer, f"{target}_lora_{suffix}", nnx.Param(zeros))
    model.lora_shape = (max_loras, max_rank)  # static: read when the program is traced


class LoRATokens(NamedTuple):
    """Which adapter slot each token of a step uses: ``slot`` int32 [T] (0 = none) and,
    for a step with at least as many tokens as slots, ``mask`` [T, L * r] (0 / 1)."""

    slot: jax.Array
    mask: jax.Array | None
    shape: tuple[int, int]  # (max_loras, max_lora_rank)


def token_slots(lora_shape: tuple[int, int], lora_slot: jax.Array, cu_q_lens: jax.Array,
                num_tokens: int, dtype: Any) -> LoRATokens:
    """Each token's slot from its row's (lora_slot: int32 [S], 0 = none; cu_q_lens: int32
    [S + 1]). Padded tokens fall in the last row: their slot is junk, as they are."""
    slots, rank = lora_shape
    row = searchsorted_right(cu_q_lens[1:],
                             jnp.arange(num_tokens, dtype=cu_q_lens.dtype))  # [T]
    slot = lora_slot[jnp.minimum(row, lora_slot.shape[0] - 1)]               # [T]
    if num_tokens < slots:  # few tokens: each gathers its own slot (lora_delta)
        return LoRATokens(slot, None, lora_shape)
    column_slot = jnp.arange(slots * rank, dtype=jnp.int32) // rank + 1      # [L * r]
    return LoRATokens(slot, (slot[:, None] == column_slot[None, :]).astype(dtype), lora_shape)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, tokens: LoRATokens) -> jax.Array:
    """x [T, in] -> the adapters' delta [T, out] for a: [in, L*r], b: [L*r, out]:
    ``((x @ a) * mask) @ b``, or per token with its own slot's A and B gathered."""
    precision = dot_precision(x.dtype)
    if tokens.mask is not None:
        low = jnp.einsum("ti,ir->tr", x, a, precision=precision) * tokens.mask
        return jnp.einsum("tr,ro->to", low, b, precision=precision)
    slots, rank = tokens.shape
    index = jnp.maximum(tokens.slot - 1, 0)                                  # [T]
    a_tok = jnp.take(a.reshape(a.shape[0], slots, rank), index, axis=1)     # [in, T, r]
    b_tok = jnp.take(b.reshape(slots, rank, b.shape[1]), index, axis=0)     # [T, r, out]
    low = jnp.einsum("ti,itr->tr", x, a_tok, precision=precision)
    low = low * (tokens.slot > 0).astype(low.dtype)[:, None]                 # slot 0: none
    return jnp.einsum("tr,tro->to", low, b_tok, precision=precision)


def slot_arrays(weights: LoRAWeights | None, arch: ArchConfig, run_arch: ArchConfig,
                max_rank: int) -> dict[tuple[int, str, str], np.ndarray]:
    """One slot's contents: ``{(layer, target, "a"|"b"): array}`` padded to ``max_rank``,
    for every LoRA parameter of the model (zeros where the adapter leaves a projection
    alone; all zeros for ``weights=None``). K/V outputs repeat like the weights when the
    run architecture repeats KV heads (tensor parallelism, ``repeat_kv_heads``)."""
    repeats = run_arch.num_kv_heads // arch.num_kv_heads
    out = {}
    for layer in range(arch.num_layers):
        for target in layer_targets(arch, layer):
            size_in, size_out = projection_shape(run_arch, target)
            a = np.zeros((size_in, max_rank), np.float32)
            b = np.zeros((max_rank, size_out), np.float32)
            pair = None if weights is None else weights.weights.get((layer, target))
            if pair is not None:
                rank = pair[0].shape[1]
                a[:, :rank] = pair[0]
                if target in ("k_proj", "v_proj"):
                    b[:rank] = repeat_kv_heads(pair[1], arch.num_kv_heads, arch.head_dim,
                                               repeats)
                else:
                    b[:rank] = pair[1]
            out[(layer, target, "a")], out[(layer, target, "b")] = a, b
    return out


def lora_params(params: dict) -> dict[tuple[int, str, str], Any]:
    """The LoRA parameters in a model's pure dict: ``{(layer, target, "a"|"b"): array}``."""
    found = {}
    for layer, values in params["layers"].items():
        for name, array in values.items():
            if "_lora_" in name:
                target, _, which = name.rpartition("_lora_")
                found[(int(layer), target, which)] = array
    return found


def set_lora_params(params: dict, arrays: dict[tuple[int, str, str], Any]) -> None:
    """Put ``arrays`` (as ``lora_params`` names them) back into the pure dict, in place."""
    for (layer, target, which), array in arrays.items():
        layers = params["layers"]
        key = layer if layer in layers else str(layer)
        layers[key][f"{target}_lora_{which}"] = array


@functools.partial(jax.jit, static_argnames=("rank",))
def write_slot(current: dict, new: dict, slot: jax.Array, *, rank: int) -> dict:
    """``current`` with slot ``slot`` (0-based) replaced by ``new`` (same keys; a: [in,
    rank], b: [rank, out]): columns of the a's, rows of the b's. One program per model."""
    out = {}
    for key, array in current.items():
        part = new[key].astype(array.dtype)
        start = slot * rank
        if key[2] == "a":
            out[key] = jax.lax.dynamic_update_slice(array, part, (0, start))
        else:
            out[key] = jax.lax.dynamic_update_slice(array, part, (start, 0))
    return out


def write_adapter(params: dict, slot: int, weights: LoRAWeights | None, *,
                  lora_shape: tuple[int, int] | None, saved_arch: ArchConfig,
                  run_arch: ArchConfig) -> None:
    """Write ``weights`` (None: zeros) into LoRA slot ``slot`` (1..max_loras) of a model's
    plain-dict ``params``, in place of the slot's arrays (arrays already handed to a call
    are not changed). ``lora_shape``: the model's (max_loras, max_lora_rank), None when it
    has no slots; ``saved_arch``: the architecture as the adapter was trained (the
    checkpoint's KV heads), ``run_arch`` as it runs (KV heads repeated under tensor
    parallelism)."""
    if lora_shape is None:
        raise ValueError("this model has no LoRA slots (enable_lora=False)")
    max_loras, rank = lora_shape
    if not 1 <= slot <= max_loras:
        raise ValueError(f"LoRA slot {slot} is outside 1..{max_loras}")
    arrays = slot_arrays(weights, saved_arch, run_arch, rank)
    set_lora_params(params, write_slot(lora_params(params), arrays, np.int32(slot - 1),
                                       rank=rank))
