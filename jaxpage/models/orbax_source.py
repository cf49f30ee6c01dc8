"""Orbax checkpoints of converted params: a weight source that restores into shards.

Loading a Hugging Face or GGUF checkpoint converts every tensor on the host (transposing,
dequantizing, repeating KV heads). ``save_state`` writes the result, as it sits in its
shards, with ``orbax-checkpoint``; ``OrbaxSource.read_params`` reads each shard straight
onto its device. A checkpoint directory holds:

* ``jaxpage_checkpoint.json``: format, the HF config, the architecture as run (KV heads
  after repetition), the dtype and the tensor-parallel size it was saved from;
* ``params/``: the orbax tree (``nnx`` pure dict of the model state, keys as text);
* the tokenizer files (so ``load_tokenizer`` finds them as in an HF directory).

Restoring needs a ``tensor_parallel_size`` that divides both the query heads and the
saved KV heads; orbax reshards from whatever layout the checkpoint was saved in.
``orbax`` itself is imported only when a checkpoint is written or read.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
from flax import nnx

from jaxpage.arch_config import ArchConfig
from jaxpage.models.quantize import plan_from_json, unpack_quantized_panels
from jaxpage.parallel.placement import Placement
from jaxpage.parallel.sharding_rules import kv_heads_for

MARKER = "jaxpage_checkpoint.json"
FORMAT = 2  # 2: one array per layer (1 stacked the layers)


def is_orbax_checkpoint(path: str) -> bool:
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
    # quantized weights as the plain layout (the CPU kernels' packed panels are a layout of
    # the running engine, not of the checkpoint)
    params = unpack_quantized_panels(nnx.to_pure_dict(runner.state))
    params.pop("kv_scale", None)  # a byte KV cache's calibration belongs to the engine run
    for layer in params.get("layers", {}).values():  # LoRA slots: the engine run's too
        for name in [n for n in layer if "_lora_" in n]:
            del layer[name]
    _checkpointer().save(os.path.join(path, "params"), _text_keys(params))  # blocking
    if jax.process_index() == 0:
        with open(os.path.join(path, MARKER), "w") as f:
            json.dump(metadata, f, indent=1)


class OrbaxSource:
    """A checkpoint directory written by ``save_state`` (see the module docstring)."""

    architecture_is_saved = True  # run_arch is the saved one; hf_overrides cannot apply

    @staticmethod
    def accepts(path: str) -> bool:
        return is_orbax_checkpoint(path)

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        with open(os.path.join(self.path, MARKER)) as f:
            metadata = json.load(f)
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{self.path}: checkpoint format {metadata.get('format')!r} is "
                             f"not {FORMAT}; convert the original checkpoint again")
        self.metadata = metadata
        self.hf_config: dict[str, Any] = metadata["hf_config"]
        self.saved_dtype: str | None = metadata["dtype"]  # what dtype="auto" restores as
        # weights saved quantized restore as saved (jaxpage.models.quantize)
        self.saved_quantization: str | None = metadata.get("quantization")
        self.quant_plan = plan_from_json(metadata.get("quant_plan"))

    def run_arch(self, arch: ArchConfig, tp_size: int) -> ArchConfig:
        """The architecture as saved (KV heads already repeated); ``tp_size`` must fit it."""
        fields = dict(self.metadata["arch"])
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = tuple(tuple(pair) for pair in fields["rope_scaling"])
        saved = ArchConfig(**fields)
        if kv_heads_for(saved, tp_size) != saved.num_kv_heads:
            raise ValueError(
                f"{self.path} holds {saved.num_kv_heads} KV heads (saved with "
                f"tensor_parallel_size={self.metadata['tensor_parallel_size']}); "
                f"tensor_parallel_size={tp_size} must divide it: use a divisor, or load the "
                "original checkpoint")
        return saved

    def read_params(self, arch: ArchConfig, run_arch: ArchConfig, template: dict[str, Any],
                    placement: Placement, dtype: Any) -> dict[str, Any]:
        """Restore the pure dict, each shard read straight onto its device."""
        import orbax.checkpoint as ocp

        if placement.mesh is None:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            shardings = jax.tree.map(lambda _: device, template)
        else:
            shardings = placement.state_shardings(template)
        target = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=sharding), template, shardings)
        restored = _checkpointer().restore(
            os.path.join(self.path, "params"),
            restore_args=ocp.checkpoint_utils.construct_restore_args(_text_keys(target)))
        return _int_keys(restored, template)
