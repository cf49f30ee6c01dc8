"""ModelRunner: owns the params, the KV cache, the penalty table and the compiled step on
the device."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np
from flax import nnx

from jaxpage.runtime import block_ops
from jaxpage.core.batch.batch_metadata import BatchMetadata
from jaxpage.core.batch.program_set import MODEL_KINDS, ProgramKey
from jaxpage.runtime.program_fallback import ProgramFallback
from jaxpage.models import lora
from jaxpage.models.loader import LoadedModel
from jaxpage.models.registry import resolve_architecture
from jaxpage.parallel.placement import Placement
from jaxpage.runtime.executable_cache import (ExecutableCache, JitPrograms, fingerprint,
                                              kernel_backends)
from jaxpage.runtime.kv_cache import allocate_kv_cache
from jaxpage.core.sched.step_result import StepResult
from jaxpage.runtime.pending_calls import PendingMultiStep, PendingStep
from jaxpage.core.batch.penalty_slots import PenaltyFill
from jaxpage.runtime.penalty_filler import PenaltyFiller
from jaxpage.runtime.step import make_forward_logits
from jaxpage.runtime.step_inputs import StepInputs
from jaxpage.runtime.step_programs import StepPrograms
from pallas_kernels import kv_layout, kv_token_scale

class ModelRunner:
    """Executes BatchMetadata on the device. ``num_blocks`` includes the null block.

    The penalty table (int32 [max_num_seqs, vocab], see ``jaxpage.core.batch.penalty_slots``)
    travels with the KV cache through every step and decode loop, donated both ways.

    With ``loaded.mesh`` (tensor parallelism) the params are already sharded, the KV cache
    is allocated split by KV head, and every program is jitted by the replica's
    ``Placement`` (the cache keeps its sharding; small outputs come back replicated).
    """

    def __init__(self, loaded: LoadedModel, *, num_blocks: int, block_size: int,
                 max_num_seqs: int, num_host_blocks: int = 0,
                 executable_dir: str | None = None, layout: str | None = None) -> None:
        """``layout``: the KV cache's (``pallas_kernels.kv_layout``); None: the platform's."""
        self.arch = loaded.arch
        self.hf_config = loaded.hf_config
        self.quantization = loaded.quantization  # how the weights are stored (None: floats)
        self.quant_plan = loaded.quant_plan or {}
        self.placement = Placement(loaded.mesh)
        self.run_arch = loaded.model.cfg  # as the model runs (KV heads repeated under TP)
        # (max_loras, max_lora_rank) when the model has LoRA slots (``models.lora``)
        self.lora_shape = getattr(loaded.model, "lora_shape", None)
        graphdef, self.state = nnx.split(loaded.model)
        # What every program takes: the params as a plain dict of arrays. jax flattens it
        # in C++ on each call; an nnx.State's Variables flatten in Python, per leaf per
        # call (``docs/benchmarks/design_measurements.md``). Same arrays, no copy.
        self.params = nnx.to_pure_dict(self.state)
        self.dtype = loaded.model.final_norm[...].dtype
        # a byte KV cache (int8 / fp8, pallas_kernels.kv_quant) is uint8 whatever its format
        self.kv_format = getattr(loaded, "kv_format", None)
        dtype = np.uint8 if self.kv_format else self.dtype
        if layout is None:
            devices = (jax.devices() if loaded.mesh is None else loaded.mesh.devices.flat)
            layout = kv_layout.for_platform(devices[0].platform)
        self.kv_layout = layout
        self.kv_cache = allocate_kv_cache(
            self.arch, num_blocks, block_size, dtype, self.placement.kv_sharding, layout,
            kv_token_scale.applies(self.kv_format, layout))
        self.host_pool = block_ops.HostKVPool(
            num_host_blocks, [(c.shape[0],) + c.shape[2:] for c in self.kv_cache],
            np.dtype(dtype))
        self.penalty_table = self.placement.zeros_replicated(
            (max_num_seqs, self.arch.vocab_size), jax.numpy.int32)
        caches_jit = functools.partial(
            self.placement.jit, carry_sharding=(self.placement.kv_sharding,
                                                self.placement.replicated)
            if self.placement.mesh is not None else None)
        # The step, verify and decode functions, one per sampling-feature choice
        self.programs = StepPrograms(graphdef, block_size, caches_jit,
                                     self.placement_platform())
        self._forward_logits = make_forward_logits(graphdef, jit=self.placement.jit)
        # The carry of a multi-step call that continues nothing: one row per possible sequence.
        self._no_carry = (jax.numpy.zeros(max_num_seqs, jax.numpy.int32),
                          jax.numpy.ones(max_num_seqs, bool))
        self._all_live = jax.numpy.zeros(max_num_seqs, bool)
        # A verify step's draft distributions when none are given (point-mass proposals);
        # ``use_draft_rows`` sizes it for a draft model's (one shape per engine).
        self._no_draft = jax.numpy.zeros((1, self.arch.vocab_size), jax.numpy.float32)
        self._last_call: PendingStep | PendingMultiStep | None = None  # for chained calls
        # Runs a batch whose program is not built yet in a larger built one
        # (``ProgramFallback``; set by a warm-up that builds the rest in the background).
        self.fallback: ProgramFallback | None = None
        self._all_allowed_masks: dict[int, jax.Array] = {}  # rows -> ``_all_allowed``
        # Start each call's outputs on their way to the host as soon as it is dispatched.
        # A CPU device's arrays already live in host memory: there the request would only
        # cost the dispatching thread time for nothing.
        self._copy_outputs_early = self.placement_platform() != "cpu"
        if self.placement.mesh is not None:  # sharded programs: plain jit dispatch
            self.executables = JitPrograms()
        else:
            kernels = kernel_backends(self.dtype, quantized=bool(self.quant_plan))
            self.executables = ExecutableCache(executable_dir, fingerprint(
                self.params, self.kv_cache, self.penalty_table, self._no_carry,
                extra=f"{graphdef}|{self.arch}|block_size={block_size}|{kernels}"),
                devices=sorted(self.kv_cache[0].devices(), key=lambda d: d.id))
        # Copies and swaps of whole blocks, through the executable cache
        self.block_mover = block_ops.BlockMover(self.host_pool, self.executables,
                                                num_blocks=num_blocks)
        self.penalty_filler = PenaltyFiller(self.executables, functools.partial(
            self.placement.jit, carry_sharding=self.placement.replicated
            if self.placement.mesh is not None else None))

    @property
    def mask_words(self) -> int:
        """Words of a row's packed grammar mask: ceil(vocab / 32)."""
        return -(-self.arch.vocab_size // 32)

    def placement_platform(self) -> str:
        """The platform of the devices the KV cache lives on ("cpu", "gpu", "tpu")."""
        # devices() may be the sharding's own cached set: iterate, never pop.
        return next(iter(self.kv_cache[0].devices())).platform

    def apply_block_ops(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                        copies: list[tuple[int, int]]) -> None:
        """Run the KV manager's pending block moves, in the only safe order.

        Swap-outs first (their device blocks may be reused by this very step), then
        swap-ins, then copy-on-write copies (a copy may read a block just swapped in).
        """
        mover = self.block_mover
        self.kv_cache = mover.swap_out(self.kv_cache, swap_out)
        self.kv_cache = mover.swap_in(self.kv_cache, swap_in)
        self.kv_cache = mover.copy(self.kv_cache, copies)

    def write_lora_slot(self, slot: int, weights: "LoRAWeights | None") -> None:
        """Write an adapter (None: zeros) into LoRA slot ``slot`` (1..max_loras). Calls
        already dispatched keep the weights they were given."""
        lora.write_adapter(self.params, slot, weights, lora_shape=self.lora_shape,
                           saved_arch=resolve_architecture(self.hf_config)[1],
                           run_arch=self.run_arch)

    def fill_penalty_rows(self, fills: list[PenaltyFill]) -> None:
        """Write rows of the penalty table (queued before the step that reads them)."""
        self.penalty_table = self.penalty_filler.fill(self.penalty_table, fills)

    def compile_penalty_fill(self) -> int:
        """Compile the penalty-fill program (it writes nothing: every token id is padding)."""
        self.penalty_table = self.penalty_filler.compile(self.penalty_table)
        return 1

    def compile_block_ops(self, sizes: list[int] | None = None) -> int:
        """Build the block-move program (``block_ops.move_blocks``) for ``sizes`` (default:
        every size it can take); the number of sizes."""
        self.kv_cache, count = self.block_mover.compile_all(self.kv_cache, sizes)
        return count

    def measure_host_bandwidth(self) -> float:
        """Bytes/s of a device-to-host copy, for the preemption cost model."""
        return block_ops.measure_host_bandwidth()

    def use_draft_rows(self, rows: int) -> None:
        """Verify steps take ``rows`` draft distributions (a draft model's ``propose``
        output, ``[rows, V]``); 1 means point-mass proposals only."""
        self._no_draft = jax.numpy.zeros((rows, self.arch.vocab_size), jax.numpy.float32)

    @property
    def draft_rows(self) -> int:
        """Q of this runner's verify steps: the rows of draft distributions they take."""
        return self._no_draft.shape[0]

    def dispatch(self, batch: BatchMetadata, kind: str = "step",
                 inputs: StepInputs | None = None, chain: bool = False) -> PendingStep:
        """Launch one step without waiting; its outputs start moving to the host at once.

        ``kind``: "step", or "verify": the batch carries speculative proposals; every
        token is sampled and checked (``step.verify_tokens``), and the result is per
        token, with ``emitted``. ``inputs`` (``StepInputs``): a step's structured-output
        grammar masks (the device-decided step takes them on accelerators, a program of
        its own on the CPU: "step-masked"), a verify step's draft distributions.

        ``chain``: the batch continues the call dispatched just before (not yet fetched):
        tokens whose ``input_src`` names one of its rows read that row's sampled token on
        the device. The runner keeps its last call itself, so a mirrored runner on another
        process continues its own (``parallel.distributed``).
        """
        if kind not in ("step", "verify"):
            raise ValueError(f"dispatch runs a 'step' or a 'verify' step, not {kind!r}")
        if kind == "verify" and chain:
            raise ValueError("a verify step cannot continue a call on the device")
        if inputs is not None:
            inputs.check(kind, batch.block_tables.shape[0], self.mask_words)
        key = self._call_key(batch, kind, inputs)
        if self.fallback is not None:  # not every program built yet
            batch, key = self.fallback.fit(batch, key)
        return self._launch_step(batch, key, inputs, chain)

    def _call_key(self, batch: BatchMetadata, kind: str, inputs: StepInputs | None = None,
                  num_steps: int = 1) -> ProgramKey:
        """The key of the program a call of ``batch`` runs (before any fallback): ``kind``
        "step", "verify" or "decode" (``num_steps`` iterations), with the batch's sampling
        features. A step with grammar masks runs the device-decided step where that takes
        the mask (``StepPrograms.mask_in_device_step``), else "step-masked"; a verify
        step's program depends on Q, its draft distributions' rows."""
        programs = self.programs
        features = programs.features(batch)
        if kind == "decode":
            return programs.key(kind, batch.shape_key, features, steps=num_steps)
        if kind == "verify":
            draft = self._no_draft if inputs is None or inputs.draft_probs is None \
                else inputs.draft_probs
            return programs.key(kind, batch.shape_key, features, draft_rows=draft.shape[0])
        if inputs is not None and inputs.token_mask is not None:
            if programs.mask_in_device_step:
                features = None  # only the device-decided step takes a mask there
            else:
                kind = "step-masked"
        return programs.key(kind, batch.shape_key, features)

    def _launch_step(self, batch: BatchMetadata, key: ProgramKey, inputs: StepInputs | None,
                     chain: bool) -> PendingStep:
        """Run the single or verify step ``key`` names on ``batch`` (of its bucket)."""
        prev_tokens = self._carry_of_last_call()[0] if chain else self._no_carry[0]
        # Numpy goes straight to the program: its C++ call path transfers the arrays for
        # less than a separate jax.device_put of them costs (design_measurements.md).
        args = (self.params, (self.kv_cache, self.penalty_table), batch.packed(), prev_tokens,
                *self._extra_args(key, batch, inputs))
        program = self.executables.get(key, self.programs.jitted(key), args)
        (self.kv_cache, self.penalty_table), outputs, last_tokens = program(*args)
        if not batch.want_logprobs.any():
            outputs = outputs.without_logprobs()
        if self._copy_outputs_early:
            for array in outputs.arrays():
                array.copy_to_host_async()
        self._last_call = PendingStep(last_tokens, outputs)
        return self._last_call

    def _extra_args(self, key: ProgramKey, batch: BatchMetadata, inputs: StepInputs | None,
                    abstract: bool = False) -> tuple:
        """The arguments ``key``'s single or verify step takes after ``prev_tokens``, for
        ``batch`` (``inputs`` padded to its bucket): a verify step's draft distributions and
        ``q_src`` (none: point-mass proposals); a masked step's grammar masks (none: every
        token allowed; ``abstract``: then shapes only)."""
        rows, tokens = batch.block_tables.shape[0], batch.input_ids.shape[0]
        if key.kind == "verify":
            draft_probs, q_src = self._no_draft, np.full(tokens, -1, np.int32)
            if inputs is not None and inputs.draft_probs is not None:
                draft_probs, q_src = inputs.draft_probs, inputs.q_src
            if draft_probs.shape[0] != key.draft_rows:
                raise ValueError(f"{key.name} takes {key.draft_rows} draft rows, "
                                 f"not {draft_probs.shape[0]}")
            if q_src.shape[0] != tokens:  # padded into a larger bucket
                q_src = np.pad(q_src, (0, tokens - q_src.shape[0]), constant_values=-1)
            return draft_probs, q_src
        if not self.programs.takes_mask(key):
            return ()
        mask = inputs.token_mask if inputs is not None else None
        if mask is None:
            return (jax.ShapeDtypeStruct((rows, self.mask_words), np.int32) if abstract
                    else self._all_allowed(rows),)
        if mask.shape[0] != rows:  # padded: allow all
            mask = np.pad(mask, ((0, rows - mask.shape[0]), (0, 0)), constant_values=-1)
        return (mask,)

    def _all_allowed(self, rows: int) -> jax.Array:
        """int32 [rows, mask_words] of set bits, on the device (put there once per size:
        no program runs to make it): the grammar mask of a batch without grammars."""
        mask = self._all_allowed_masks.get(rows)
        if mask is None:
            mask = self._all_allowed_masks[rows] = self.placement.put_replicated(
                np.full((rows, self.mask_words), -1, np.int32))
        return mask

    def _carry_of_last_call(self) -> tuple[jax.Array, jax.Array]:
        """(last tokens int32 [R], done bool [R]) of the call dispatched last; after a
        single step every row is live (a stop is the host's to find)."""
        last = self._last_call
        if isinstance(last, PendingMultiStep):
            return last.carry
        return last.last_tokens, self._all_live

    def execute(self, batch: BatchMetadata, token_mask: np.ndarray | None = None) -> StepResult:
        """Run one step (with grammar masks when given) and wait for it. Rows past
        ``num_seqs`` are junk."""
        return self.dispatch(batch, "step", StepInputs.of(token_mask)).fetch()

    def dispatch_multi_step(self, batch: BatchMetadata, num_steps: int,
                            row_map: np.ndarray | None = None) -> PendingMultiStep:
        """Launch up to ``num_steps`` decode iterations without waiting.

        With ``row_map`` the batch continues the call dispatched just before (not yet
        fetched): row ``i`` continues its row ``row_map[i]`` (-1: none), taking its first
        input token and done flag from the device; the host built ``batch`` as far ahead
        as that call goes.
        """
        key = self._call_key(batch, "decode", num_steps=num_steps)
        if self.fallback is not None:  # not every program built yet
            batch, key = self.fallback.fit(batch, key)
        return self._launch_decode(batch, key, row_map)

    def _launch_decode(self, batch: BatchMetadata, key: ProgramKey,
                       row_map: np.ndarray | None) -> PendingMultiStep:
        """Run the decode loop ``key`` names on ``batch`` (of its bucket)."""
        num_rows = batch.block_tables.shape[0]
        if row_map is None:
            prev_tokens, prev_done = self._no_carry
            row_map = np.full(num_rows, -1, np.int32)
        else:
            prev_tokens, prev_done = self._carry_of_last_call()
            row_map = np.pad(np.asarray(row_map, np.int32), (0, num_rows - len(row_map)),
                             constant_values=-1)
        args = (self.params, (self.kv_cache, self.penalty_table), batch.packed(),
                prev_tokens, prev_done, row_map)
        program = self.executables.get(key, self.programs.jitted(key), args)
        (self.kv_cache, self.penalty_table), outputs, carry = program(*args)
        if not batch.want_logprobs.any():
            outputs = outputs.without_logprobs()
        if self._copy_outputs_early:
            for array in outputs.arrays():
                array.copy_to_host_async()
        self._last_call = PendingMultiStep(outputs, carry)
        return self._last_call

    def run_program(self, key: ProgramKey, batch: BatchMetadata | None = None) -> None:
        """Run the program ``key`` names once and wait: how a runner that holds no programs
        itself (a mesh's plain jit dispatch) builds one. ``batch``: for the model's kinds,
        a batch of the key's bucket holding nothing (``BatchBuilder.empty``); a
        "step-masked" step allows every token, a verify step has point-mass proposals."""
        if key.kind == "move_blocks":
            self.compile_block_ops([key.bucket[0]])
        elif key.kind == "penalty_fill":
            self.compile_penalty_fill()
        elif key.kind == "decode":
            self._launch_decode(batch, key, None).fetch()
        else:
            self._launch_step(batch, key, None, chain=False).fetch()

    def prefetch(self, batch: BatchMetadata, num_steps: int) -> bool:
        """Start building, in the background, the program a plain step (``num_steps`` 1) or
        a multi-step decode call of ``batch``'s shape runs (``ExecutableCache.prefetch``);
        ``batch``'s values do not matter. True when a build was queued."""
        prefetch = getattr(self.executables, "prefetch", None)
        if prefetch is None:  # plain jit dispatch on a mesh: nothing to build ahead
            return False
        return prefetch(*self._spec(self._shape_key(batch, num_steps), batch))

    def ensure_program(self, batch: BatchMetadata, num_steps: int) -> bool:
        """Compile now, without running it, the program of ``batch``'s shape (a plain step
        for ``num_steps`` 1, else the multi-step decode loop) unless it is held or saved
        (``ExecutableCache.ensure``); ``batch``'s values do not matter. True when it was
        compiled."""
        ensure = getattr(self.executables, "ensure", None)
        if ensure is None:  # plain jit dispatch on a mesh: programs are built when run
            return False
        return ensure(*self._spec(self._shape_key(batch, num_steps), batch))

    def _shape_key(self, batch: BatchMetadata, num_steps: int) -> ProgramKey:
        """The key a plain step (``num_steps`` 1) or a decode call of ``batch`` runs."""
        return self._call_key(batch, "step" if num_steps == 1 else "decode",
                              num_steps=num_steps)

    def _fixed_args(self) -> tuple:
        """The params and caches as shapes only (the live caches are donated by every call)."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            (self.params, (self.kv_cache, self.penalty_table)))

    def _spec(self, key: ProgramKey, batch: BatchMetadata) -> tuple:
        """(key, jitted, args) of the model program ``key`` names for ``batch`` (of its
        bucket), with the params and caches as shapes only."""
        fixed = self._fixed_args()
        if key.kind == "decode":
            row_map = np.full(batch.block_tables.shape[0], -1, np.int32)
            args = (*fixed, batch.packed(), *self._no_carry, row_map)
        else:
            args = (*fixed, batch.packed(), self._no_carry[0],
                    *self._extra_args(key, batch, None, abstract=True))
        return key, self.programs.jitted(key), args

    def program_spec(self, key: ProgramKey, empty: Callable[..., BatchMetadata]) -> tuple:
        """(key, jitted, args) of the program ``key`` names (``core.batch.program_set``;
        ``ExecutableCache``'s arguments); ``empty(T, S, M)`` makes a batch of a bucket
        (``BatchBuilder.empty``)."""
        if key.kind in MODEL_KINDS:
            return self._spec(key, empty(*key.bucket))
        if key.kind == "move_blocks":
            return self.block_mover.spec(self._fixed_args()[1][0], key.bucket[0])
        if key.kind == "penalty_fill":
            return self.penalty_filler.spec(key, self._fixed_args()[1][1])
        raise ValueError(f"unknown program kind {key.kind!r}")

    def execute_multi_step(self, batch: BatchMetadata, num_steps: int) -> np.ndarray:
        """Run ``num_steps`` decode iterations; int32 [num_steps, S], -1 after a row stops."""
        return self.dispatch_multi_step(batch, num_steps).fetch().tokens

    def logits(self, batch: BatchMetadata) -> np.ndarray:
        """Run one step and return float32 logits [T, V] for every token (the cache is updated)."""
        self.kv_cache, logits = self._forward_logits(self.params, self.kv_cache,
                                                     jax.device_put(batch.packed()))
        return np.asarray(logits)

