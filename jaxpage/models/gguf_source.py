"""GGUF files: metadata becomes an HF-style config, tensors are dequantized to float32.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for Llama-type models
(per head, rows laid out as (2, head_dim/2) were written as (head_dim/2, 2)); we undo it so
that every tensor matches its Hugging Face counterpart exactly.

With a ``cache_dir`` the config and the converted params are kept there
(``converted_cache``): a second start opens neither the file's metadata nor its tensors.
The file is parsed only when something is missing from the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from typing import Any

import jax
import numpy as np
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

from jaxpage.arch_config import ArchConfig
from jaxpage.models.converted_cache import ConvertedCache, StaleEntry
from jaxpage.models.hf_layout import LAYER_TENSORS, HFTensorSource, loading_bar
from jaxpage.models.quantize import GGUF_KEPT, QuantFormat, gguf_parts, plan_to_json
from jaxpage.parallel.placement import Placement

logger = logging.getLogger("jaxpage")

_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                       "gemma3": "Gemma3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                       "qwen3moe": "Qwen3MoeForCausalLM"}
_PERMUTED_ARCHES = ("llama", "mistral")
# llama.cpp's converter stores Gemma's (1 + w) norm scales with the 1 added
_NORM_PLUS_ONE_ARCHES = ("gemma2", "gemma3")
# architectures whose tensor names come from gguf-py's own map (``_mapped_names``)
_MAPPED_ARCHES = ("qwen3", "phi3", "gemma2", "gemma3", "qwen2moe", "qwen3moe")
# Hugging Face per-layer names (without .weight / .bias) the mapped architectures may hold;
# "mlp.experts.{gate,up,down}_proj" stand for the stacked [E, out, in] expert tensors
_MAPPED_LAYER_NAMES = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
    "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj", "mlp.gate", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj", "mlp.shared_expert_gate", "mlp.experts.gate_proj",
    "mlp.experts.up_proj", "mlp.experts.down_proj")
_FUSED_LAYER_NAMES = ("self_attn.qkv_proj", "mlp.gate_up_proj")  # Phi-3's


def _mapped_names(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name for ``arch``, from gguf-py's tensor map."""
    import gguf
    from gguf.tensor_mapping import get_tensor_name_map

    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(model_arch, num_layers)
    layer_names = _MAPPED_LAYER_NAMES
    if arch == "phi3":  # its ffn_up is gate|up, attn_qkv is q|k|v
        layer_names = tuple(n for n in layer_names if n not in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
            "mlp.up_proj")) + _FUSED_LAYER_NAMES
    names = ["model.embed_tokens", "model.norm", "lm_head"] + [
        f"model.layers.{i}.{n}" for i in range(num_layers) for n in layer_names]
    mapped = {}
    for hf in names:
        ours = table.get_name(hf)
        if ours is not None:
            for suffix in (".weight", ".bias"):
                mapped[ours + suffix] = hf + suffix
    return mapped

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Mixtral (stored as llama): the router and the stacked experts [E, out, in]
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.gate_proj.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.up_proj.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


class GGUFSource(HFTensorSource):
    """Reads a GGUF file; ``get`` takes Hugging Face tensor names.

    ``from_cache`` tells whether ``read_params`` took the converted params from the cache.
    """

    caches_conversion = True  # takes cache_dir (weight_sources.open_source)

    @staticmethod
    def accepts(path: str) -> bool:
        return os.path.isfile(path) and path.endswith(".gguf")

    def __init__(self, path: str, cache_dir: str | None = None) -> None:
        self.path = path
        self.cache = ConvertedCache(cache_dir, path) if cache_dir is not None else None
        self.from_cache = False
        self.reader = None
        config = self.cache.read_config() if self.cache is not None else None
        if config is not None and self.cache.tensor_types is not None:
            self.hf_config = config
            self._types = self.cache.tensor_types
            return
        self._open()
        if self.cache is not None:
            self.cache.write_config(self.hf_config, self._types)

    def _open(self) -> None:
        """Parse the file's metadata and tensor index (seconds for a real model)."""
        path = self.path
        self.reader = GGUFReader(path)
        self.metadata = {key: self._field(key) for key in self.reader.fields
                         if not key.startswith("tokenizer.ggml.")}
        arch = self.metadata.get("general.architecture")
        if arch not in _GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {arch!r} is not supported; supported GGUF "
                             f"architectures: {sorted(_GGUF_ARCHITECTURES)}")
        self.arch = arch
        self._tensors = {}
        self._types: dict[str, str] = {}  # HF name -> GGML type name
        mapped = (_mapped_names(arch, int(self.metadata[f"{arch}.block_count"]))
                  if arch in _MAPPED_ARCHES else {})
        for tensor in self.reader.tensors:
            name = mapped.get(tensor.name) if mapped else _hf_name(tensor.name)
            if name is not None:
                self._tensors[name] = tensor
                self._types[name] = tensor.tensor_type.name
            elif tensor.name == "rope_freqs.weight" or tensor.name.startswith("rope_factors"):
                raise ValueError(f"{path}: GGUF rope frequency factors ({tensor.name}) are not supported")
        self.hf_config = self._hf_config()

    def _field(self, key: str):
        try:
            return self.reader.fields[key].contents()
        except Exception:  # fields of exotic types are not needed
            return None

    def _hf_config(self) -> dict:
        m, a = self.metadata, self.arch
        scaling = m.get(f"{a}.rope.scaling.type")
        if scaling not in (None, "none") and not (scaling == "linear" and a == "gemma3"):
            raise ValueError(f"{self.path}: GGUF rope scaling {scaling!r} is not supported"
                             + (" (gemma3: linear only)" if a == "gemma3" else ""))
        embed = self._tensors["model.embed_tokens.weight"]
        num_heads = int(m[f"{a}.attention.head_count"])
        hidden = int(m[f"{a}.embedding_length"])
        tokenizer_fields = self.reader.fields
        eos = tokenizer_fields.get("tokenizer.ggml.eos_token_id")
        return {
            "architectures": [_GGUF_ARCHITECTURES[a]],
            "vocab_size": int(embed.shape[1]) if len(embed.shape) > 1 else int(embed.shape[0]),
            "hidden_size": hidden,
            "intermediate_size": int(m[f"{a}.feed_forward_length"]),
            "num_hidden_layers": int(m[f"{a}.block_count"]),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(m.get(f"{a}.attention.head_count_kv") or num_heads),
            "head_dim": int(m.get(f"{a}.attention.key_length") or hidden // num_heads),
            "rms_norm_eps": float(m.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(m.get(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(m.get(f"{a}.context_length", 2048)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "sliding_window": m.get(f"{a}.attention.sliding_window"),
            "use_sliding_window": m.get(f"{a}.attention.sliding_window") is not None,
            "eos_token_id": int(eos.contents()) if eos is not None else None,
            **self._family_config(),
        }

    def _family_config(self) -> dict:
        """The HF config keys of the newer families, from their GGUF metadata."""
        m, a = self.metadata, self.arch
        config: dict = {}
        if m.get(f"{a}.expert_count"):
            config.update(
                num_experts=int(m[f"{a}.expert_count"]),
                num_experts_per_tok=int(m[f"{a}.expert_used_count"]),
                moe_intermediate_size=int(m.get(f"{a}.expert_feed_forward_length")
                                          or m[f"{a}.feed_forward_length"]),
                shared_expert_intermediate_size=int(
                    m.get(f"{a}.expert_shared_feed_forward_length") or 0),
                norm_topk_prob=bool(m.get(f"{a}.expert_weights_norm", a == "qwen3moe")))
            if a == "llama":  # Mixtral is stored as llama with experts
                config["architectures"] = ["MixtralForCausalLM"]
        if a in ("gemma2", "gemma3"):
            heads = int(m[f"{a}.attention.head_count"])
            hidden = int(m[f"{a}.embedding_length"])
            head_dim = int(m.get(f"{a}.attention.key_length") or hidden // heads)
            # GGUF has no query_pre_attn_scalar; llama.cpp uses hidden / heads for the
            # 27B models (46 / 62 layers) and head_dim otherwise
            big = int(m[f"{a}.block_count"]) == {"gemma2": 46, "gemma3": 62}[a]
            config.update(query_pre_attn_scalar=hidden // heads if big else head_dim,
                          attn_logit_softcapping=m.get(f"{a}.attn_logit_softcapping"),
                          final_logit_softcapping=m.get(f"{a}.final_logit_softcapping"))
            pattern = m.get(f"{a}.attention.sliding_window_pattern")
            if isinstance(pattern, (list, tuple)):  # per layer, True = sliding
                config["layer_types"] = ["sliding_attention" if p else "full_attention"
                                         for p in pattern]
            elif pattern:
                config["sliding_window_pattern"] = int(pattern)
        if a == "gemma3":
            config["rope_local_base_freq"] = float(m.get(f"{a}.rope.freq_base_swa", 10000.0))
            if m.get(f"{a}.rope.scaling.type") == "linear":
                config["rope_scaling"] = {"rope_type": "linear",
                                          "factor": float(m[f"{a}.rope.scaling.factor"])}
        if a == "phi3":
            rotary = m.get(f"{a}.rope.dimension_count")
            head_dim = int(m.get(f"{a}.attention.key_length") or int(
                m[f"{a}.embedding_length"]) // int(m[f"{a}.attention.head_count"]))
            if rotary:
                config["partial_rotary_factor"] = int(rotary) / head_dim
        return config

    def read_params(self, arch: ArchConfig, run_arch: ArchConfig, template: dict[str, Any],
                    placement: Placement, dtype: Any) -> dict[str, Any]:
        """As ``HFTensorSource.read_params``, from the converted cache when it holds them
        (checked as read: a stale or corrupted entry is converted again and replaced)."""
        if self.cache is None:
            return super().read_params(arch, run_arch, template, placement, dtype)
        variant = self._cache_variant()
        try:
            cached = self.cache.load(dtype, arch, variant)
            if cached is not None:
                pure = self.place(self.repeat_kv(cached, arch, run_arch), placement, dtype)
                self.from_cache = True
                return pure
        except StaleEntry as error:
            logger.warning("%s; converting %s again", error, self.path)
            self.cache.discard(dtype, arch, variant)
        nbytes = sum(int(np.prod(leaf.shape)) * np.dtype(dtype).itemsize
                     for leaf in jax.tree.leaves(template))
        converted = self.cache.save(dtype, arch, loading_bar(self.layout_arrays(arch), template),
                                    nbytes, variant)
        return self.place(self.repeat_kv(converted, arch, run_arch), placement, dtype)

    def _cache_variant(self) -> str:
        """The converted-cache entry's variant: "" for floats; with kept blocks, named by
        which parameters keep which format (their parts are what the entry holds)."""
        if not self.keeps_blocks:
            return ""
        plan = json.dumps(plan_to_json(self.quant_plan), sort_keys=True)
        return "blocks-" + hashlib.sha256(plan.encode()).hexdigest()[:8]

    @property
    def keeps_blocks(self) -> bool:
        """Whether some tensors are read as their quantized blocks (``quantization="gguf"``,
        or float32 on the CPU: ``loader._lossless_blocks``); the converted cache then keeps
        their parts in an entry of its own."""
        return any(name in self._kept for name in self.quant_plan)

    _kept: frozenset[str] | set[str] = frozenset()  # parameters read as blocks (gguf_plan)

    def gguf_plan(self, arch: ArchConfig) -> dict[str, QuantFormat]:
        """Which of our parameters stay in their GGUF blocks: those stored as Q8_0, Q4_0 or
        Q4_1 in every layer (one type across layers); the rest are dequantized."""
        names = {"embed": ["model.embed_tokens.weight"]}
        if not arch.tie_word_embeddings:
            names["lm_head"] = ["lm_head.weight"]
        for name, (suffix, _) in LAYER_TENSORS.items():
            tensors = [f"model.layers.{i}.{suffix}" for i in range(arch.num_layers)]
            if suffix.endswith("proj.weight") and all(t in self._types for t in tensors):
                names[name] = tensors  # (absent: fused (Phi-3) or experts (MoE) there)
        plan: dict[str, QuantFormat] = {}
        for name, tensors in names.items():
            types = {self._types.get(t) for t in tensors}
            if len(types) == 1 and next(iter(types)) in GGUF_KEPT:
                plan[name] = GGUF_KEPT[next(iter(types))]
        self._kept = set(plan)
        return plan

    def tensor(self, name: str, hf_name: str, transpose: bool) -> Any:
        """Kept parameters as their parts (already in our layout), others as floats."""
        if name in self._kept and name in self.quant_plan:
            return self.get_kept(hf_name)
        return super().tensor(name, hf_name, transpose)

    def get_kept(self, name: str) -> dict[str, np.ndarray]:
        """A kept tensor's parts in our [in, out] layout (``quantize.gguf_parts``)."""
        if self.reader is None:
            self._open()
        tensor = self._tensors[name]
        out_features, in_features = (int(d) for d in reversed(tensor.shape))
        parts = gguf_parts(np.asarray(tensor.data), tensor.tensor_type.name, out_features,
                           in_features)
        if self.arch in _PERMUTED_ARCHES and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self._heads(name)
            parts = {k: np.ascontiguousarray(_unpermute_rows(v.T, heads).T)
                     for k, v in parts.items()}
        return parts

    def _heads(self, name: str) -> int:
        key = "head_count" if "q_proj" in name else "head_count_kv"
        return int(self.metadata.get(f"{self.arch}.attention.{key}")
                   or self.metadata[f"{self.arch}.attention.head_count"])

    def names(self) -> set[str]:
        if self.reader is None:
            self._open()
        return set(self._tensors)

    def get(self, name: str) -> np.ndarray:
        """float32 tensor in Hugging Face layout ([out, in] for linear weights)."""
        if self.reader is None:
            self._open()
        if name not in self._tensors:
            raise ValueError(f"GGUF file has no tensor for {name!r}")
        tensor = self._tensors[name]
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                  GGMLQuantizationType.BF16):
            data = np.asarray(tensor.data)
            if tensor.tensor_type == GGMLQuantizationType.BF16:
                data = dequantize(data, tensor.tensor_type)
            array = data.astype(np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))
        else:
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if self.arch in _PERMUTED_ARCHES and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = _unpermute_rows(array, self._heads(name))
        if self.arch in _NORM_PLUS_ONE_ARCHES and name.endswith("norm.weight"):
            array = array - 1.0
        return array

    def expert_stack(self, experts: str, name: str, count: int) -> np.ndarray:
        """GGUF stores each expert projection stacked, [E, out, in]: -> [E, in, out]."""
        stacked = f"{experts}.{_STACKED.get(name, name)}.weight"
        if stacked not in self._tensors:
            return super().expert_stack(experts, name, count)
        array = self.get(stacked)
        if array.shape[0] != count:
            raise ValueError(f"{stacked} holds {array.shape[0]} experts, expected {count}")
        return np.ascontiguousarray(array.transpose(0, 2, 1))


_STACKED = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral -> stacked names


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q/k projections. weight: [out, in]."""
    out_features, in_features = weight.shape
    head_dim = out_features // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, in_features)
            .swapaxes(1, 2).reshape(out_features, in_features))
