"""The engine's device programs for a target that is not there, as abstract arrays.

``AbstractEngine`` builds what ``ModelRunner`` runs (the step for every (T, S, M)
bucket, the multi-step decode loop for every all-decode bucket, block copies and swaps,
the penalty-table fill) from the same runtime functions (``make_step``,
``make_decode_loop``, ``block_ops``), but with the parameters, the KV cache and the
batch as ``jax.ShapeDtypeStruct``s carrying their shardings on the target's mesh.
Nothing is allocated: a Llama-3-8B on an 8-chip slice is planned on a laptop.

Every program is jitted by the replica's ``Placement`` exactly as the engine does, and
traced under ``jax.default_device(first target device)``, so the attention kernels'
``"auto"`` backend picks the target's Pallas kernel and Mosaic knows the TPU generation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxpage.config import EngineConfig
from jaxpage.core.batch.builder import BatchBuilder
from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.core.batch.batch_shapes import ladder_policy
from jaxpage.core.batch.program_set import ProgramKey, ProgramSet, program_set
from jaxpage.core.batch.step_features import BASE_FEATURES, StepFeatures
from jaxpage.arch_config import ArchConfig
from jaxpage.models.loader import DTYPES, auto_dtype
from jaxpage.models.presets import PREFIX as PRESET_PREFIX
from jaxpage.models.presets import preset_config
from jaxpage.models.registry import resolve_architecture
from jaxpage.models.lora import attach_lora
from jaxpage.parallel.placement import Placement
from jaxpage.parallel.sharding_rules import TP, replicated_arch
from jaxpage.runtime import block_ops
from jaxpage.runtime.compiler_options import decode_jit
from jaxpage.runtime.decode_loop import make_decode_loop
from jaxpage.runtime.kv_cache import bytes_per_block, cache_shapes
from jaxpage.runtime.penalty_filler import PENALTY_FILL_WIDTH
from jaxpage.runtime.step import make_penalty_fill, make_step
from pallas_kernels import kv_layout, kv_token_scale
from pallas_kernels._backend import branches_wait_for_device

# The attention kernel ``attention_backend="auto"`` runs on each target platform.
_TARGET_KERNELS = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "cpu": "cpu"}


def open_checkpoint(model: str | None, weight_cache: bool = True) -> Any:
    """The weight source of a checkpoint directory or GGUF file (None: the default model),
    opened as a live engine opens it: through the converted-weight cache when
    ``weight_cache`` (a GGUF file's config and tensor types are then read from the cache a
    start or an earlier plan wrote, not parsed again: seconds for a real model)."""
    import os

    from jaxpage.config import cache_dir
    from jaxpage.models.loader import default_model_path
    from jaxpage.models.weight_sources import open_source

    return open_source(default_model_path() if model is None else model,
                       os.path.join(cache_dir(), "weights") if weight_cache else None)


def _quant_plan(mc: Any, source: Any, arch: ArchConfig, device: Any) -> dict:
    """The stored formats of ``quantization`` for ``arch`` (``jaxpage.models.quantize``);
    a pre-quantized checkpoint's own (``jaxpage.models.prequantized``). ``source``: the
    checkpoint's (``open_checkpoint``), None for a preset."""
    from jaxpage.models.loader import quantizable_dims
    from jaxpage.models.quantize import mode_plan

    if source is not None:
        stored = getattr(source, "stored", None)
        if stored is not None:  # a pre-quantized checkpoint: its stored formats
            from jaxpage.models.prequantized import canonical_method, for_device

            if mc.quantization is not None and canonical_method(mc.quantization) != stored.method:
                raise ValueError(f"quantization={mc.quantization!r}, but {mc.model!r} is "
                                 f"quantized with {stored.method!r}")
            return for_device(stored.plan(arch, source.names()), device)
    if mc.quantization is None:
        return {}
    if mc.quantization == "gguf":
        if not hasattr(source, "gguf_plan"):
            raise ValueError(f"quantization='gguf' needs a GGUF file, not {mc.model!r}")
        return source.gguf_plan(arch)
    from jaxpage.models.prequantized import for_device

    return for_device(mode_plan(mc.quantization, quantizable_dims(arch),
                                mc.quantization_group_size), device)


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled-to-be program: its name, bucket, jitted function and abstract args."""

    name: str           # "step", "decode8", "verify", "move_blocks", "penalty_fill"
    bucket: tuple       # (T, S, M) for steps and decode loops, (P,) for block moves
    jitted: Callable    # a jax.jit-wrapped function
    args: tuple         # ShapeDtypeStructs with shardings
    key: ProgramKey | None = None  # the engine's name for it (``core.batch.program_set``)

    @property
    def label(self) -> str:
        return self.key.label if self.key is not None else f"{self.name}{list(self.bucket)}"


class AbstractEngine:
    """The programs of one model replica on ``devices`` (``tensor_parallel_size`` of them)."""

    def __init__(self, config: EngineConfig, devices: list, *, num_kv_blocks: int) -> None:
        mc, cc, sc = config.model, config.cache, config.scheduler
        tp = config.parallel.tensor_parallel_size
        if tp > len(devices):
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; the target has "
                             f"{len(devices)}")
        self.config = config
        self.device = devices[0]
        # Where the host decides the sampling features (a GPU: ``step_features``), every
        # bucket has two programs: the host-decided one (``BASE_FEATURES``) and the one
        # deciding on the device (any batch), as ``StepPrograms`` makes them.
        self.platform = self.device.platform
        self.host_decides = self.platform == "cpu" or branches_wait_for_device(self.platform)
        self.mesh = Mesh(np.array(devices[:tp]), (TP,))
        self.placement = Placement(self.mesh)
        # the checkpoint, opened once (None: a preset, which has no file)
        preset = mc.model is not None and mc.model.startswith(PRESET_PREFIX)
        source = None if preset else open_checkpoint(mc.model, mc.weight_cache)
        self.hf_config = {**(preset_config(mc.model) if preset else source.hf_config),
                          **(mc.hf_overrides or {})}
        model_cls, arch = resolve_architecture(self.hf_config)
        self.arch: ArchConfig = replicated_arch(arch, tp)
        self.dtype = DTYPES[auto_dtype(None, self.hf_config, self.platform)
                            if mc.dtype == "auto" else mc.dtype]
        # what the KV cache holds: the model dtype, or bytes (int8 / fp8 KV, kv_quant)
        self.kv_dtype = jnp.uint8 if cc.kv_format else self.dtype
        self.kv_layout = kv_layout.for_platform(self.platform)  # fused rows on TPUs
        self.token_scales = kv_token_scale.applies(cc.kv_format, self.kv_layout)
        kv_token_scale.check_cache(cc.kv_format, self.kv_layout, self.arch.head_dim)
        limit = self.arch.max_position_embeddings
        if mc.max_model_len is not None and mc.max_model_len > limit:
            raise ValueError(f"max_model_len={mc.max_model_len} exceeds the model's context "
                             f"length {limit}")
        self.max_model_len = mc.max_model_len or limit
        self.block_size = cc.block_size
        self.max_num_seqs = sc.max_num_seqs
        self.num_kv_blocks = num_kv_blocks  # usable blocks; the cache has one more (null)
        # rngs=None: parameter shapes only (quantized weights as their stored parts)
        abstract = model_cls(self.arch, dtype=self.dtype, attention_backend=mc.attention_backend,
                             rngs=None, mesh=self.mesh,
                             quant_plan=_quant_plan(mc, source, self.arch, self.device), kv_format=cc.kv_format)
        if mc.enable_lora:  # the adapter slots every program then takes (models.lora)
            attach_lora(abstract, mc.max_loras, mc.max_lora_rank, abstract=True)
        self.graphdef, state = nnx.split(abstract)
        self.state = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                        sharding=sharding),
            state, self.placement.state_shardings(state))
        # the attention kernel the target runs: its own Pallas kernel under "auto"
        attention = (_TARGET_KERNELS.get(self.platform, "reference")
                     if mc.attention_backend == "auto" else mc.attention_backend)
        self.builder = BatchBuilder(
            KVCacheManager(BlockPool(2), self.block_size),
            max_num_batched_tokens=sc.max_num_batched_tokens, max_num_seqs=sc.max_num_seqs,
            max_model_len=self.max_model_len, bucket_growth=sc.bucket_growth,
            **ladder_policy(self.platform, attention))
        self.num_steps = sc.num_scheduler_steps
        self.swap_blocks = int(cc.swap_space * 2**30) // self.bytes_per_block(per_device=False)
        self.move_sizes = block_ops.move_sizes(block_ops.move_chunk(
            self.bytes_per_block(per_device=False), num_kv_blocks + 1))

    # -- sizes ------------------------------------------------------------------------

    @property
    def tp_size(self) -> int:
        return self.placement.tp_size

    def weight_bytes_per_device(self) -> int:
        """Bytes of parameters each device holds (its shards)."""
        total = 0
        for leaf in jax.tree.leaves(self.state):
            shard = leaf.sharding.shard_shape(leaf.shape)
            total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize
        return total

    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token, all layers, per device."""
        return self.bytes_per_block() // self.block_size

    def bytes_per_block(self, per_device: bool = True) -> int:
        return bytes_per_block(self.arch, self.block_size, self.kv_dtype,
                               self.tp_size if per_device else 1, self.kv_layout,
                               self.token_scales)

    # -- abstract arguments -----------------------------------------------------------

    def _replicated(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=self.placement.replicated)

    def kv_cache(self, num_blocks: int | None = None) -> tuple:
        """The cache's arrays in the target's layout (``kv_layout``), abstract."""
        blocks = (self.num_kv_blocks if num_blocks is None else num_blocks) + 1
        return tuple(jax.ShapeDtypeStruct(shape, self.kv_dtype,
                                          sharding=self.placement.kv_sharding)
                     for shape in cache_shapes(self.arch, blocks, self.block_size,
                                               self.kv_layout, self.token_scales))

    def caches(self, num_blocks: int | None = None) -> tuple:
        penalty = self._replicated((self.max_num_seqs, self.arch.vocab_size), jnp.int32)
        return self.kv_cache(num_blocks), penalty

    def batch(self, shape: tuple[int, int, int]) -> tuple:
        """The packed batch (``BatchMetadata.packed``) of that shape, abstract."""
        arrays = self.builder.empty(*shape).packed()
        return tuple(self._replicated(v.shape, v.dtype) for v in arrays)

    # -- programs ---------------------------------------------------------------------

    @functools.cached_property
    def _jit_with_caches(self) -> Callable:
        placement = self.placement
        return functools.partial(placement.jit, carry_sharding=(placement.kv_sharding,
                                                                placement.replicated))

    def _features(self, device_decided: bool) -> StepFeatures | None:
        """The features a program variant is made with (None: decided on the device)."""
        return BASE_FEATURES if self.host_decides and not device_decided else None

    def _key(self, kind: str, shape, device_decided: bool) -> ProgramKey:
        """The engine's key of a model program variant, as ``core.batch.program_set`` makes it
        (a verify step takes one draft row: point-mass proposals)."""
        return ProgramKey.of(kind, shape, self._features(device_decided),
                             host_decides=self.host_decides, steps=self.num_steps,
                             draft_rows=1,
                             fixed_length=branches_wait_for_device(self.platform))

    def step_program(self, shape, num_blocks: int | None = None,
                     device_decided: bool = False) -> Program:
        features = self._features(device_decided)
        run = make_step(self.graphdef, jit=self._jit_with_caches, features=features)
        args = (self.state, self.caches(num_blocks), self.batch(shape),
                self._replicated((self.max_num_seqs,), jnp.int32))
        if features is None and self.platform != "cpu":  # it takes the grammar mask
            args += (self._replicated((shape[1], -(-self.arch.vocab_size // 32)), jnp.int32),)
        return Program("step", tuple(shape), run.jitted, args,
                       self._key("step", shape, device_decided))

    def verify_program(self, shape, num_blocks: int | None = None,
                       device_decided: bool = False) -> Program:
        """The speculative-decoding verify step (``make_step(verify=True)``)."""
        run = make_step(self.graphdef, jit=self._jit_with_caches, verify=True,
                        features=self._features(device_decided))
        return Program("verify", tuple(shape), run.jitted,
                       (self.state, self.caches(num_blocks), self.batch(shape),
                        self._replicated((self.max_num_seqs,), jnp.int32),
                        self._replicated((1, self.arch.vocab_size), jnp.float32),
                        self._replicated((shape[0],), jnp.int32)),
                       self._key("verify", shape, device_decided))

    def decode_program(self, shape, num_blocks: int | None = None,
                       device_decided: bool = False) -> Program:
        run = make_decode_loop(self.graphdef, self.num_steps, self.block_size,
                               jit=decode_jit(self._jit_with_caches, self.platform),
                               features=self._features(device_decided),
                               fixed_length=branches_wait_for_device(self.platform))
        rows = self.max_num_seqs
        args = (self.state, self.caches(num_blocks), self.batch(shape),
                self._replicated((rows,), jnp.int32), self._replicated((rows,), jnp.bool_),
                self._replicated((shape[1],), jnp.int32))
        return Program(f"decode{self.num_steps}", tuple(shape), run.jitted, args,
                       self._key("decode", shape, device_decided))

    def program_set(self) -> ProgramSet:
        """The engine's program set on this target (``core.batch.program_set``), as
        ``engine.startup.warmup.engine_program_set`` makes it for a live engine."""
        speculation = self.config.scheduler.speculative
        verifies = (self.builder.verify_shapes(speculation.disable_by_batch_size,
                                               speculation.num_speculative_tokens)
                    if speculation is not None else None)
        return program_set(self.builder, num_steps=self.num_steps,
                           host_decides=self.host_decides, move_sizes=self.move_sizes,
                           penalty_width=PENALTY_FILL_WIDTH, verify_shapes=verifies,
                           fixed_decode=branches_wait_for_device(self.platform))

    def program(self, key: ProgramKey, num_blocks: int | None = None) -> Program:
        """The program ``key`` names, with abstract arguments."""
        if key.kind == "step":
            return self.step_program(key.bucket, num_blocks, key.device_decided)
        if key.kind == "decode":
            return self.decode_program(key.bucket, num_blocks, key.device_decided)
        if key.kind == "verify":
            return self.verify_program(key.bucket, num_blocks, key.device_decided)
        kv = self.kv_cache(num_blocks)
        if key.kind == "move_blocks":
            n = key.bucket[0]
            index = self._replicated((n,), jnp.int32)
            blocks = tuple(jax.ShapeDtypeStruct((c.shape[0], n, *c.shape[2:]), c.dtype,
                                                sharding=c.sharding) for c in kv)
            return Program("move_blocks", (n,), block_ops.move_blocks,
                           (kv, index, index, blocks, self._replicated((), jnp.bool_)), key)
        fill = make_penalty_fill(jit=functools.partial(
            self.placement.jit, carry_sharding=self.placement.replicated))
        width = key.bucket[0]
        index = self._replicated((width,), jnp.int32)
        return Program("penalty_fill", (width,), fill.jitted, (
            (), self.caches(num_blocks)[1], self._replicated((), jnp.int32), index, index,
            self._replicated((), jnp.bool_)), key)

    def programs(self, buckets: str = "all") -> Iterator[Program]:
        """The engine's programs: ``"all"`` every one it can run; ``"warmup"`` the ready set
        (what ``LLM(...)`` builds before it takes requests on an accelerator); ``"largest"``
        the ready set and the largest all-decode step (the roofline's), which bound the
        memory but prove less."""
        programs = self.program_set()
        if buckets == "all":
            keys = list(programs.all)
        elif buckets == "warmup":
            keys = list(programs.ready)
        elif buckets == "largest":
            decodes = self.builder.decode_shapes()
            keys = list(programs.ready)
            largest_decode = self._key("step", decodes[-1], False)
            if largest_decode not in keys:
                keys.insert(1, largest_decode)
        else:
            raise ValueError(f"buckets={buckets!r} must be 'all', 'warmup' or 'largest'")
        for key in keys:
            yield self.program(key)

    def compile(self, program: Program):
        """Lower and compile ``program`` for the target; compiler errors propagate."""
        with jax.default_device(self.device):
            return program.jitted.lower(*program.args).compile()

