"""Hugging Face tensor names to jaxpage's parameter tree, for sources that read by name.

``HFTensorSource`` is the part shared by the safetensors and GGUF sources: a subclass
provides ``hf_config`` and ``get(name)`` (the tensor as Hugging Face stores it, linears
[out, in]); this class turns those into our layout and places them. Invariants:

* layer ``i``'s tensors land at ``("layers", i, name)``; linears become [in, out];
* K/V projections (and biases) are repeated from the checkpoint's KV heads to the run
  architecture's (``sharding_rules.replicated_arch``) when tensor parallelism has more
  devices than KV heads;
* one host tensor exists at a time: each is converted, placed, and dropped.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import jax.numpy as jnp
import numpy as np

from jaxpage.arch_config import ArchConfig
from jaxpage.models.quantize import PARTS, QuantFormat, quantize_arrays
from jaxpage.parallel.placement import Placement
from jaxpage.parallel.sharding_rules import repeat_kv_heads, replicated_arch

# our per-layer name -> (Hugging Face suffix after "model.layers.{i}.", transposed?)
LAYER_TENSORS = {
    "input_norm": ("input_layernorm.weight", False),
    "post_attention_norm": ("post_attention_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
}
_KV_TENSORS = ("k_proj", "v_proj", "k_bias", "v_bias")


# A mixture-of-experts layer's tensors, per family: (module, expert gate / up / down)
_MOE_NAMES = {"MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2")}
_QWEN_MOE = ("mlp", "gate_proj", "up_proj", "down_proj")


def layer_tensor_names(arch: ArchConfig, layer: int = 0) -> dict[str, tuple[str, bool]]:
    """Our parameter -> (Hugging Face suffix, transposed?) for layer ``layer`` of ``arch``
    (fused Phi-3 projections are split by ``HFTensorSource._split_fused``, experts stacked
    by ``_experts`` instead)."""
    names = dict(LAYER_TENSORS)
    if arch.is_sparse(layer):
        for name in ("gate_proj", "up_proj", "down_proj"):
            del names[name]
        module = _MOE_NAMES.get(arch.architecture, _QWEN_MOE)[0]
        names["router"] = (f"{module}.gate.weight", True)
        if arch.shared_expert_intermediate_size:
            for name in ("gate_proj", "up_proj", "down_proj"):
                names[f"shared_{name}"] = (f"mlp.shared_expert.{name}.weight", True)
            names["shared_expert_gate"] = ("mlp.shared_expert_gate.weight", True)
    if arch.sandwich_norms:  # Gemma 2/3: HF's post_attention_layernorm is on the attention
        # output; the norm before the MLP is pre_feedforward_layernorm
        names.update(post_attention_norm=("pre_feedforward_layernorm.weight", False),
                      attn_out_norm=("post_attention_layernorm.weight", False),
                      mlp_out_norm=("post_feedforward_layernorm.weight", False))
    if arch.qk_norm:
        names.update(q_norm=("self_attn.q_norm.weight", False),
                     k_norm=("self_attn.k_norm.weight", False))
    if arch.qkv_bias:
        for name in ("q", "k", "v"):
            names[f"{name}_bias"] = (f"self_attn.{name}_proj.bias", False)
    if arch.o_bias:
        names["o_bias"] = ("self_attn.o_proj.bias", False)
    if arch.fused_projections:
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            names.pop(name, None)
    return names


class HFTensorSource:
    """A weight source that reads tensors by their Hugging Face names (see the module)."""

    hf_config: dict[str, Any]
    saved_dtype: str | None = None  # tensors are converted to the dtype asked for
    quant_plan: dict[str, QuantFormat] = {}  # set by the loader: parameters stored quantized

    def get(self, name: str) -> np.ndarray:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def run_arch(self, arch: ArchConfig, tp_size: int) -> ArchConfig:
        """The architecture as run on ``tp_size`` devices (KV heads repeated if fewer)."""
        return arch if tp_size == 1 else replicated_arch(arch, tp_size)

    def read_params(self, arch: ArchConfig, run_arch: ArchConfig, template: dict[str, Any],
                    placement: Placement, dtype: Any) -> dict[str, Any]:
        """The model's pure dict (keys as in ``template``), every array on its devices.
        A progress bar counts the tensors when the ``jaxpage`` logger shows INFO (the
        command line's default)."""
        arrays = loading_bar(self.param_arrays(arch, run_arch), template)
        return self.place(arrays, placement, dtype)

    def place(self, arrays: Iterable[tuple[tuple, np.ndarray]], placement: Placement,
              dtype: Any) -> dict[str, Any]:
        """(path keys, host array) pairs -> the pure dict (``place_arrays``)."""
        return place_arrays(arrays, placement, dtype, self.quant_plan)

    def param_arrays(self, arch: ArchConfig,
                     run_arch: ArchConfig) -> Iterator[tuple[tuple, np.ndarray]]:
        """Yield (path keys, host array) for every parameter, in our layout, one at a time."""
        return self.repeat_kv(self.layout_arrays(arch), arch, run_arch)

    @staticmethod
    def repeat_kv(arrays: Iterable[tuple[tuple, np.ndarray]], arch: ArchConfig,
                  run_arch: ArchConfig) -> Iterator[tuple[tuple, np.ndarray]]:
        """``arrays`` with K/V projections repeated to ``run_arch``'s KV heads."""
        repeats = run_arch.num_kv_heads // arch.num_kv_heads
        for keys, array in arrays:
            if keys[-1] in _KV_TENSORS:  # quantized parts too: their last axis is the output
                repeat = lambda a: repeat_kv_heads(a, arch.num_kv_heads, arch.head_dim,  # noqa: E731
                                                   repeats)
                array = ({part: repeat(value) if part in ("codes", "scale", "zero")
                          else repeat(value.T).T if part == "codes_t" else value
                          for part, value in array.items()}
                         if isinstance(array, dict) else repeat(array))
            yield keys, array

    def layout_arrays(self, arch: ArchConfig) -> Iterator[tuple[tuple, np.ndarray]]:
        """(path keys, host array) in our layout (linears [in, out]), KV heads as saved."""
        yield ("embed",), self.tensor("embed", "model.embed_tokens.weight", False)
        yield ("final_norm",), self.get("model.norm.weight")
        if not arch.tie_word_embeddings:
            yield ("lm_head",), self.tensor("lm_head", "lm_head.weight", True)
        for i in range(arch.num_layers):
            prefix = f"model.layers.{i}."
            if arch.fused_projections:
                yield from self._split_fused(arch, i, prefix)
            if arch.is_sparse(i):
                yield from self._experts(arch, i, prefix)
            for name, (suffix, transpose) in layer_tensor_names(arch, i).items():
                yield ("layers", i, name), self.tensor(name, prefix + suffix, transpose)

    def _experts(self, arch: ArchConfig, i: int,
                 prefix: str) -> Iterator[tuple[tuple, np.ndarray]]:
        """The experts' projections stacked: gate / up [E, hidden, I], down [E, I, hidden]
        (each expert's [out, in] tensor transposed)."""
        module, *names = _MOE_NAMES.get(arch.architecture, _QWEN_MOE)
        for ours, theirs in zip(("expert_gate", "expert_up", "expert_down"), names):
            yield ("layers", i, ours), self.expert_stack(
                f"{prefix}{module}.experts", theirs, arch.num_experts)

    def expert_stack(self, experts: str, name: str, count: int) -> np.ndarray:
        """Projection ``name`` of experts ``{experts}.0`` ... ``{experts}.{count - 1}``,
        each [out, in] as saved, stacked in our layout: [count, in, out]."""
        return np.stack([self.get(f"{experts}.{e}.{name}.weight").T for e in range(count)])

    def _split_fused(self, arch: ArchConfig, i: int,
                     prefix: str) -> Iterator[tuple[tuple, np.ndarray]]:
        """Phi-3's ``qkv_proj`` [(Hq + 2 Hkv) D, hidden] and ``gate_up_proj`` [2 I, hidden]
        as our q/k/v and gate/up projections [in, out]."""
        q_dim, kv_dim = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        qkv = self.get(prefix + "self_attn.qkv_proj.weight")
        if qkv.shape[0] != q_dim + 2 * kv_dim:
            raise ValueError(f"{prefix}self_attn.qkv_proj.weight has {qkv.shape[0]} rows, "
                             f"expected {q_dim + 2 * kv_dim}")
        for name, rows in (("q_proj", qkv[:q_dim]), ("k_proj", qkv[q_dim:q_dim + kv_dim]),
                           ("v_proj", qkv[q_dim + kv_dim:])):
            yield ("layers", i, name), np.ascontiguousarray(rows.T)
        del qkv
        gate_up = self.get(prefix + "mlp.gate_up_proj.weight")
        size = arch.intermediate_size
        if gate_up.shape[0] != 2 * size:
            raise ValueError(f"{prefix}mlp.gate_up_proj.weight has {gate_up.shape[0]} rows, "
                             f"expected {2 * size}")
        yield ("layers", i, "gate_proj"), np.ascontiguousarray(gate_up[:size].T)
        yield ("layers", i, "up_proj"), np.ascontiguousarray(gate_up[size:].T)

    def tensor(self, name: str, hf_name: str, transpose: bool) -> Any:
        """Our parameter ``name`` from the checkpoint's ``hf_name``: a host array in our
        layout, or (a source that keeps quantized blocks, a pre-quantized checkpoint) a
        dict of quantized parts."""
        stored = getattr(self, "stored", None)
        if stored is not None and name in stored.formats and name in self.quant_plan:
            return stored.parts(self.get, self.names(), hf_name.removesuffix(".weight"),
                                self.quant_plan[name])
        array = self.get(hf_name)
        return array.T if transpose else array


def place_arrays(arrays: Iterable[tuple[tuple, Any]], placement: Placement, dtype: Any,
                 plan: dict[str, QuantFormat]) -> dict[str, Any]:
    """(path keys, host array) pairs -> the pure dict, every array on its devices.

    Parameters of ``plan`` are quantized first (``quantize.quantize_arrays``); their parts
    keep their own dtypes and are placed as ``"{param}.{part}"`` (``param_spec``).
    """
    pure: dict[str, Any] = {}
    for keys, array in quantize_arrays(arrays, plan):
        node = pure
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        part = keys[-1] in PARTS
        name = f"{keys[-2]}.{keys[-1]}" if part else keys[-1]
        as_dtype = array.dtype if part else dtype
        node[keys[-1]] = (jnp.asarray(array, as_dtype) if placement.mesh is None
                          else placement.put(name, array, as_dtype))
        del array  # the host copy of one tensor at a time
    return pure


def loading_bar(arrays: Iterable, template: Any) -> Iterable:
    """``arrays`` under a "Loading weights" progress bar (total: ``template``'s arrays),
    shown when the ``jaxpage`` logger shows INFO (the command line's default)."""
    import logging

    from tqdm.auto import tqdm

    return tqdm(arrays, desc="Loading weights", unit=" tensors", total=_count_leaves(template),
                dynamic_ncols=True,
                disable=not logging.getLogger("jaxpage").isEnabledFor(logging.INFO))


def _count_leaves(tree: Any) -> int:
    """Arrays of a nested dict (the model's pure dict): the weight-loading bar's total."""
    if isinstance(tree, dict):
        return sum(_count_leaves(value) for value in tree.values())
    return 1
