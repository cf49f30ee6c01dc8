"""Orbax checkpoints of converted params, for a fast restart.

Loading a Hugging Face or GGUF checkpoint converts every tensor on the host (transposing,
dequantizing, repeating KV heads). ``save`` writes the result, as it sits in its shards,
with ``orbax-checkpoint``; ``restore`` reads each shard straight onto its device. A checkpoint directory holds:

* ``jaxpage_checkpoint.json``: format, the HF config, the architecture as run (KV heads
  after repetition), the dtype and the tensor-parallel size it was saved from;
* ``params/``: the orbax tree (``nnx`` pure dict of the model state);
* the tokenizer files (so ``load_tokenizer`` finds them as in an HF directory).

Restoring needs a ``tensor_parallel_size`` that divides both the query heads and the
saved KV heads; orbax reshards from whatever layout the checkpoint was saved in.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
from flax import nnx

MARKER = "jaxpage_checkpoint.json"
FORMAT = 2  # 2: one array per layer (1 stacked the layers)


def is_sharded_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MARKER))


def _checkpointer():
    """Uncompressed tensors: zstd halves the size on disk but doubles the restore time
    (measured by ``scripts/bench_checkpoint_restore.py``), and a fast restart is the point."""
    import orbax.checkpoint as ocp

    return ocp.PyTreeCheckpointer(use_compression=False)


def _text_keys(tree: Any) -> Any:
    """The pure dict with every key a string (orbax writes the layer indices as text)."""
    if isinstance(tree, dict):
        return {str(key): _text_keys(value) for key, value in tree.items()}
    return tree


def _int_keys(tree: Any, like: Any) -> Any:
    """``tree`` (text keys) with the keys of ``like`` (the model's pure dict) put back."""
    if isinstance(like, dict):
        return {key: _int_keys(tree[str(key)], value) for key, value in like.items()}
    return tree


def save_state(runner: Any, path: str, metadata: dict[str, Any]) -> None:
    """Write ``runner.state`` to ``path`` (every process calls this with the same args)."""
    path = os.path.abspath(path)
    checkpointer = _checkpointer()
    checkpointer.save(os.path.join(path, "params"),
                      _text_keys(nnx.to_pure_dict(runner.state)))  # blocking
    if jax.process_index() == 0:
        with open(os.path.join(path, MARKER), "w") as f:
            json.dump(metadata, f, indent=1)


def save(engine: Any, path: str) -> str:
    """Save the converted params of ``engine`` (an LLMEngine; replica 0 of a router)."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and os.listdir(path):
        raise ValueError(f"path={path!r} exists and is not empty; pass a new directory")
    replica = getattr(engine, "engines", [engine])[0]
    runner = replica.runner
    arch = dataclasses.asdict(runner.arch)
    metadata = {"format": FORMAT, "hf_config": runner.hf_config, "arch": arch,
                "dtype": str(runner.dtype),
                "tensor_parallel_size": runner.placement.tp_size}
    os.makedirs(path, exist_ok=True)
    if hasattr(runner, "mirror_call"):  # several processes: every one writes its shards
        runner.mirror_call(f"{__name__}:save_state", path, metadata)
    else:
        save_state(runner, path, metadata)
    if replica.tokenizer is not None and jax.process_index() == 0:
        replica.tokenizer.save_pretrained(path)
    return path


def restore(path: str, *, dtype: str, attention_backend: str, mesh: Any = None):
    """A ``LoadedModel`` from a checkpoint written by ``save``, placed on ``mesh``."""
    from jaxpage.models.arch_config import ArchConfig
    from jaxpage.models.loader import LoadedModel, resolve_dtype
    from jaxpage.models.registry import resolve_architecture
    from jaxpage.parallel.placement import Placement
    from jaxpage.parallel.sharding_rules import kv_heads_for

    path = os.path.abspath(path)
    with open(os.path.join(path, MARKER)) as f:
        metadata = json.load(f)
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {metadata.get('format')!r} is not "
                         f"{FORMAT}; convert the original checkpoint again")
    fields = dict(metadata["arch"])
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = tuple(tuple(pair) for pair in fields["rope_scaling"])
    arch = ArchConfig(**fields)
    model_cls, _ = resolve_architecture(metadata["hf_config"])
    placement = Placement(mesh)
    if kv_heads_for(arch, placement.tp_size) != arch.num_kv_heads:
        raise ValueError(f"{path} holds {arch.num_kv_heads} KV heads (saved with "
                         f"tensor_parallel_size={metadata['tensor_parallel_size']}); "
                         f"tensor_parallel_size={placement.tp_size} must divide it: use a "
                         "divisor, or load the original checkpoint")
    jdtype = resolve_dtype(dtype) if dtype != "auto" else metadata["dtype"]
    abstract = nnx.eval_shape(lambda: model_cls(arch, dtype=jdtype,
                                                attention_backend=attention_backend,
                                                rngs=nnx.Rngs(0), mesh=mesh))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, pure)
    else:
        shardings = placement.state_shardings(pure)
    target = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, sharding=sharding), pure, shardings)
    import orbax.checkpoint as ocp

    target = _text_keys(target)
    restored = _checkpointer().restore(
        os.path.join(path, "params"),
        restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    nnx.replace_by_pure_dict(state, _int_keys(restored, pure))
    return LoadedModel(nnx.merge(graphdef, state), arch, metadata["hf_config"], path, mesh)
