"""Megatron-style tensor-parallel layout: one PartitionSpec per parameter name.

Projections are stored ``[in_features, out_features]``, one array per layer (see
``models/llama.py``). Over the mesh axis ``tp`` of N devices:

* ``q_proj`` / ``k_proj`` / ``v_proj`` (and their biases), ``gate_proj`` / ``up_proj``:
  split by output features, so each device computes its own heads / MLP columns;
* ``o_proj`` / ``down_proj``: split by input features; XLA sums the partial outputs
  (one all-reduce per block);
* ``embed`` (``[vocab, hidden]``) and ``lm_head`` (``[hidden, vocab]``): split by vocabulary;
* norms and ``o_bias``: replicated;
* the KV cache ``[layers, blocks, block_size, kv_heads, head_dim]``: split by KV head.

Invariant: a device holding query heads ``[d*Hq/N, (d+1)*Hq/N)`` also holds the KV heads
they read, ``[d*Hkv/N, (d+1)*Hkv/N)``. That needs ``Hq % N == 0`` and ``Hkv % N == 0``;
when ``Hkv < N`` (GQA), each KV head is repeated ``N / Hkv`` times (``replicated_arch``,
``repeat_kv_heads``), which keeps every query head paired with a copy of its own KV head.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpage.arch_config import ArchConfig

TP = "tp"  # the mesh axis of tensor parallelism

# parameter name (last key of its path) -> spec of one layer's (or the model's) array
PARAM_SPECS: dict[str, P] = {
    "embed": P(TP, None),
    "lm_head": P(None, TP),
    "final_norm": P(),
    "input_norm": P(),
    "post_attention_norm": P(),
    "attn_out_norm": P(), "mlp_out_norm": P(),  # Gemma 2/3
    "q_norm": P(), "k_norm": P(),  # [head_dim], shared by the heads (Qwen3, Gemma 3)
    "q_proj": P(None, TP), "k_proj": P(None, TP), "v_proj": P(None, TP),
    "q_bias": P(TP), "k_bias": P(TP), "v_bias": P(TP),
    "o_proj": P(TP, None), "o_bias": P(),
    "gate_proj": P(None, TP), "up_proj": P(None, TP),
    "down_proj": P(TP, None),
    "kv_scale": P(None, None, TP, None),  # [2, L, Hkv, D]: a byte KV cache's scales
    # mixture of experts (models/moe.py): experts split over the axis (expert parallelism)
    "router": P(), "expert_gate": P(TP, None, None), "expert_up": P(TP, None, None),
    "expert_down": P(TP, None, None),
    "shared_gate_proj": P(None, TP), "shared_up_proj": P(None, TP),
    "shared_down_proj": P(TP, None), "shared_expert_gate": P(),
}
# LoRA slots (models/lora.py): small, replicated; XLA splits their matmuls with the weights'
PARAM_SPECS.update({f"{target}_lora_{part}": P() for part in ("a", "b") for target in (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")})
KV_CACHE_SPEC = P(None, None, None, TP)  # axis 3: kv heads (split) or their fused row (kv_layout)
VOCAB_PARAMS = ("embed", "lm_head")


QUANTIZED_PARTS = ("codes", "codes_t", "scale", "zero", "input_scale", "perm")  # quantize.PARTS


def param_spec(name: str, shape: tuple[int, ...], tp_size: int) -> P:
    """The spec of parameter ``name``; vocab tables that do not divide are replicated.

    A quantized weight's parts are named ``"{param}.{part}"``: its ``codes`` [K (or K/2),
    N] split as the weight is; its ``scale`` / ``zero`` [G, N] split by N where the weight
    is, and by groups where the weight is split by K and the groups divide (per-channel
    scales, one group, are replicated). A quantized ``embed`` is stored [hidden, vocab].
    A W8A8 weight's ``codes_t`` [N, K] split as the weight (axes swapped), its
    ``input_scale`` [1] and an act-order ``perm`` [K] replicated.
    """
    if "." in name:
        return _part_spec(name, shape, tp_size)
    if name not in PARAM_SPECS:
        raise ValueError(f"no tensor-parallel sharding rule for parameter {name!r}")
    return _checked(name, PARAM_SPECS[name], shape, tp_size)


def _part_spec(name: str, shape: tuple[int, ...], tp_size: int) -> P:
    param, part = name.split(".", 1)
    if param not in PARAM_SPECS or part not in QUANTIZED_PARTS:
        raise ValueError(f"no tensor-parallel sharding rule for parameter {name!r}")
    if part in ("input_scale", "perm"):
        return P()  # a W8A8 input scale [1], an act-order permutation [K]: on every device
    spec = P(None, TP) if param == "embed" else PARAM_SPECS[param]
    if part == "codes_t":  # W8A8 codes kept [out, in]: the weight's spec, axes swapped
        return _checked(param, P(spec[1], spec[0]), shape, tp_size)
    if part != "codes" and spec[0] == TP and shape[0] % tp_size:
        spec = P(None, spec[1])  # too few groups to split: every device holds them all
    return _checked(param, spec, shape, tp_size)


def _checked(name: str, spec: P, shape: tuple[int, ...], tp_size: int) -> P:
    for dim, axis in enumerate(spec):
        if axis is not None and shape[dim] % tp_size:
            if name in VOCAB_PARAMS:
                return P()  # an odd vocabulary stays whole on every device
            raise ValueError(f"parameter {name} dimension {dim} of size {shape[dim]} does not "
                             f"divide over tensor_parallel_size={tp_size}")
    return spec


def kv_heads_for(arch: ArchConfig, tp_size: int) -> int:
    """KV heads after GQA replication for ``tp_size`` devices (raises if none fits)."""
    if arch.num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's "
                         f"num_heads={arch.num_heads}")
    kv = arch.num_kv_heads
    if kv % tp_size == 0:
        return kv
    if tp_size % kv == 0:
        return tp_size  # each KV head repeated tp_size / kv times
    raise ValueError(f"tensor_parallel_size={tp_size} and num_kv_heads={kv}: one must divide "
                     "the other")


def replicated_arch(arch: ArchConfig, tp_size: int) -> ArchConfig:
    """The architecture as the sharded model runs it (KV heads repeated when fewer than N)."""
    return dataclasses.replace(arch, num_kv_heads=kv_heads_for(arch, tp_size))


def repeat_kv_heads(weight: np.ndarray, num_kv_heads: int, head_dim: int,
                    repeats: int) -> np.ndarray:
    """Repeat each KV head's output columns ``repeats`` times (head j -> j*r ... j*r+r-1).

    weight: [..., num_kv_heads * head_dim] -> [..., num_kv_heads * repeats * head_dim].
    """
    if repeats == 1:
        return weight
    lead = weight.shape[:-1]
    heads = weight.reshape(*lead, num_kv_heads, head_dim)
    return np.repeat(heads, repeats, axis=-2).reshape(*lead, num_kv_heads * repeats * head_dim)
