"""ModelRunner: owns the params, the KV cache, the penalty table and the compiled step on
the device."""

from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import numpy as np
from flax import nnx

from jaxpage.runtime import block_ops
from jaxpage.core.batch_metadata import BatchMetadata
from jaxpage.core.program_set import ProgramKey
from jaxpage.runtime.program_fallback import ProgramFallback
from jaxpage.models.loader import LoadedModel
from jaxpage.parallel.placement import JitDispatch, Placement
from jaxpage.runtime.executable_cache import ExecutableCache, fingerprint
from jaxpage.runtime.kv_cache import allocate_kv_cache
from jaxpage.runtime.pending_calls import PendingMultiStep, PendingStep, StepResult
from jaxpage.core.penalty_slots import PenaltyFill
from jaxpage.runtime.step import make_forward_logits, make_penalty_fill
from jaxpage.runtime.step_programs import StepPrograms
from pallas_kernels import kv_layout
from pallas_kernels.dense_matmul import resolve_backend as resolve_dense_backend
from pallas_kernels.quantized_matmul import resolve_backend as resolve_quantized_backend
from pallas_kernels.sampling import resolve_backend as resolve_sampling_backend

# Tokens per call of the penalty-fill program (one compiled shape; long rows take several).
PENALTY_FILL_WIDTH = 512


class ModelRunner:
    """Executes BatchMetadata on the device. ``num_blocks`` includes the null block.

    The penalty table (int32 [max_num_seqs, vocab], see ``jaxpage.core.penalty_slots``)
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
        # in C++ on each call; an nnx.State's Variables flatten in Python, ~1 us per leaf
        # per call (SmolLM2 has 273 leaves). Same arrays, no copy.
        self.params = nnx.to_pure_dict(self.state)
        self.dtype = loaded.model.final_norm[...].dtype
        # a byte KV cache (int8 / fp8, pallas_kernels.kv_quant) is uint8 whatever its format
        dtype = np.uint8 if getattr(loaded, "kv_format", None) else self.dtype
        if layout is None:
            devices = (jax.devices() if loaded.mesh is None else loaded.mesh.devices.flat)
            layout = kv_layout.for_platform(devices[0].platform)
        self.kv_layout = layout
        self.kv_cache = allocate_kv_cache(self.arch, num_blocks, block_size, dtype,
                                          self.placement.kv_sharding, layout)
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
        self._fill_penalties = make_penalty_fill(jit=functools.partial(
            self.placement.jit, carry_sharding=self.placement.replicated
            if self.placement.mesh is not None else None))
        self._forward_logits = make_forward_logits(graphdef, jit=self.placement.jit)
        self.compiled_shapes: set[tuple[int, int, int]] = set()
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
        # cost the dispatching thread time (~50 us a call) for nothing.
        self._copy_outputs_early = self.placement_platform() != "cpu"
        if self.placement.mesh is not None:  # sharded programs: plain jit dispatch
            self.executables = JitDispatch()
        else:
            # Resolving the C++ CPU kernels builds and registers them (before any saved
            # program that calls them is loaded); whether they could be is part of what the
            # programs depend on.
            kernels = (f"sampling={resolve_sampling_backend()}|dense_matmul="
                       f"{resolve_dense_backend('auto', self.dtype)}")
            if self.quant_plan:
                kernels += f"|quantized_matmul={resolve_quantized_backend('auto', self.dtype)}"
            self.executables = ExecutableCache(executable_dir, fingerprint(
                self.params, self.kv_cache, self.penalty_table, self._no_carry,
                extra=f"{graphdef}|{self.arch}|block_size={block_size}|{kernels}"),
                devices=sorted(self.kv_cache[0].devices(), key=lambda d: d.id))
        # Copies and swaps of whole blocks, through the executable cache
        self.block_mover = block_ops.BlockMover(self.host_pool, self.executables,
                                                num_blocks=num_blocks)

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
        from jaxpage.models import lora
        from jaxpage.models.registry import resolve_architecture

        if self.lora_shape is None:
            raise ValueError("this model has no LoRA slots (enable_lora=False)")
        max_loras, rank = self.lora_shape
        if not 1 <= slot <= max_loras:
            raise ValueError(f"LoRA slot {slot} is outside 1..{max_loras}")
        saved_arch = resolve_architecture(self.hf_config)[1]  # K/V heads as the adapter has them
        arrays = lora.slot_arrays(weights, saved_arch, self.run_arch, rank)
        current = lora.lora_params(self.params)
        lora.set_lora_params(self.params, lora.write_slot(current, arrays, np.int32(slot - 1),
                                                          rank=rank))

    def fill_penalty_rows(self, fills: list[PenaltyFill]) -> None:
        """Write rows of the penalty table (queued before the step that reads them)."""
        width = PENALTY_FILL_WIDTH
        for fill in fills:
            for start in range(0, max(len(fill.token_ids), 1), width):
                ids = np.full(width, -1, np.int32)
                values = np.zeros(width, np.int32)
                chunk = fill.token_ids[start:start + width]
                ids[:len(chunk)] = chunk
                values[:len(chunk)] = fill.values[start:start + width]
                self._run_penalty_fill(fill.slot, ids, values, start == 0)

    def _run_penalty_fill(self, slot: int, ids: np.ndarray, values: np.ndarray,
                          reset: bool) -> None:
        args = ((), self.penalty_table, np.int32(slot), ids, values, np.bool_(reset))
        program = self.executables.get("penalty_fill", (PENALTY_FILL_WIDTH,),
                                       self._fill_penalties, args)
        self.penalty_table, = program(*args)

    def compile_penalty_fill(self) -> int:
        """Compile the penalty-fill program (it writes nothing: every token id is padding)."""
        self._run_penalty_fill(0, np.full(PENALTY_FILL_WIDTH, -1, np.int32),
                               np.zeros(PENALTY_FILL_WIDTH, np.int32), False)
        return 1

    def compile_block_ops(self, sizes: list[int] | None = None) -> int:
        """Build the block-move program (``block_ops.move_blocks``) for ``sizes`` (default:
        every size it can take); the number of sizes."""
        self.kv_cache, count = self.block_mover.compile_all(self.kv_cache, sizes)
        return count

    def measure_host_bandwidth(self, num_bytes: int = 32 * 2**20) -> float:
        """Bytes/s of a device-to-host copy (best of three), for the preemption cost model."""
        data = jax.numpy.ones(num_bytes // 4, jax.numpy.float32).block_until_ready()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            np.array(jax.device_get(data), copy=True)  # on the CPU device_get may alias
            best = min(best, time.perf_counter() - start)
        return num_bytes / best

    def use_draft_rows(self, rows: int) -> None:
        """Verify steps take ``rows`` draft distributions (a draft model's ``propose``
        output, ``[rows, V]``); 1 means point-mass proposals only."""
        self._no_draft = jax.numpy.zeros((rows, self.arch.vocab_size), jax.numpy.float32)

    def dispatch(self, batch: BatchMetadata, chain: bool = False, verify: bool = False,
                 draft: "tuple[jax.Array, np.ndarray] | None" = None,
                 token_mask: np.ndarray | None = None,
                 device_decided: bool = False) -> "PendingStep":
        """Launch one step without waiting; its outputs start moving to the host at once.

        ``chain``: the batch continues the call dispatched just before (not yet fetched):
        tokens whose ``input_src`` names one of its rows read that row's sampled token on
        the device. The runner keeps its last call itself, so a mirrored runner on another
        process continues its own (``parallel.distributed``).

        ``verify``: the batch carries speculative proposals; every token is sampled and
        checked (``step.verify_tokens``), and the result is per token, with ``emitted``.
        ``draft``: (draft distributions float32 [Q, V] on the device, ``q_src`` int32 [T])
        for proposals a draft model sampled (``make_step``'s verify arguments).
        ``token_mask``: int32 [S, ceil(V / 32)], structured outputs' packed grammar masks
        (a separate program, ``step-masked``; see ``mask_words``).
        ``device_decided``: run the program that decides the sampling features on the
        device even where the batch's own would do (warm-up builds both).
        """
        if verify and chain:
            raise ValueError("a verify step cannot continue a call on the device")
        if token_mask is not None and verify:
            raise ValueError("a verify step takes no grammar mask")
        features = self.programs.features(batch, device_decided)
        in_step = self.programs.mask_in_device_step and not verify  # the mask rides along
        if token_mask is not None:
            expected = (batch.block_tables.shape[0], self.mask_words)
            if token_mask.shape != expected or token_mask.dtype != np.int32:
                raise ValueError(f"token_mask has shape {token_mask.shape} "
                                 f"({token_mask.dtype}); expected int32 {expected}")
            if in_step:
                features = None  # only the device-decided step takes a mask there
        if verify:
            name = self._verify_name(draft)  # the program depends on Q
        else:
            name = "step-masked" if token_mask is not None and not in_step else "step"
        if self.fallback is not None:  # not every program built yet
            batch, features = self.fallback.fit("verify" if verify else name, batch,
                                                features, 1, name)
        step = self.programs.step(verify, features)
        rows = batch.block_tables.shape[0]
        if token_mask is not None and token_mask.shape[0] != rows:  # padded: allow all
            token_mask = np.pad(token_mask, ((0, rows - token_mask.shape[0]), (0, 0)),
                                constant_values=-1)
        if in_step and features is None and token_mask is None:
            token_mask = self._all_allowed(rows)
        self.compiled_shapes.add(batch.shape_key + ((name,) if name != "step" else ()))
        prev_tokens = self._carry_of_last_call()[0] if chain else self._no_carry[0]
        # Numpy goes straight to the program: its C++ call path transfers the arrays for
        # less than half what a separate jax.device_put of them costs (~0.3 ms a step).
        args = (self.params, (self.kv_cache, self.penalty_table), batch.packed(), prev_tokens)
        if verify:
            draft_probs, q_src = draft if draft is not None else (
                self._no_draft, np.full(batch.input_ids.shape[0], -1, np.int32))
            if q_src.shape[0] != batch.input_ids.shape[0]:  # padded into a larger bucket
                q_src = np.pad(q_src, (0, batch.input_ids.shape[0] - q_src.shape[0]),
                               constant_values=-1)
            args += (draft_probs, q_src)
        elif token_mask is not None:
            args += (token_mask,)
        program = self.executables.get(self.programs.name(name, features), batch.shape_key,
                                       step, args)
        (self.kv_cache, self.penalty_table), (sampled, *logprobs), last_tokens = program(*args)
        outputs = (sampled, *logprobs) if batch.want_logprobs.any() else (sampled,)
        if self._copy_outputs_early:
            for array in outputs:
                array.copy_to_host_async()
        self._last_call = PendingStep(last_tokens, *outputs)
        return self._last_call

    def _all_allowed(self, rows: int) -> jax.Array:
        """int32 [rows, mask_words] of set bits, on the device (put there once per size:
        no program runs to make it): the grammar mask of a batch without grammars."""
        mask = self._all_allowed_masks.get(rows)
        if mask is None:
            mask = self._all_allowed_masks[rows] = self.placement.put_replicated(
                np.full((rows, self.mask_words), -1, np.int32))
        return mask

    def _verify_name(self, draft: "tuple[jax.Array, np.ndarray] | None") -> str:
        """The verify program's base name: it depends on Q, the draft distributions' rows."""
        return f"verify-q{(self._no_draft if draft is None else draft[0]).shape[0]}"

    def _carry_of_last_call(self) -> tuple[jax.Array, jax.Array]:
        """(last tokens int32 [R], done bool [R]) of the call dispatched last; after a
        single step every row is live (a stop is the host's to find)."""
        last = self._last_call
        if isinstance(last, PendingMultiStep):
            return last.carry
        return last.last_tokens, self._all_live

    def execute(self, batch: BatchMetadata, token_mask: np.ndarray | None = None) -> StepResult:
        """Run one step and wait for it. Rows past ``num_seqs`` are junk."""
        return self.dispatch(batch, token_mask=token_mask).fetch()

    def dispatch_multi_step(self, batch: BatchMetadata, num_steps: int,
                            row_map: np.ndarray | None = None,
                            device_decided: bool = False) -> "PendingMultiStep":
        """Launch up to ``num_steps`` decode iterations without waiting.

        With ``row_map`` the batch continues the call dispatched just before (not yet
        fetched): row ``i`` continues its row ``row_map[i]`` (-1: none), taking its first
        input token and done flag from the device; the host built ``batch`` as far ahead
        as that call goes. ``device_decided``: as in ``dispatch``.
        """
        features = self.programs.features(batch, device_decided)
        if self.fallback is not None:  # not every program built yet
            batch, features = self.fallback.fit("decode", batch, features, num_steps)
        name, loop = self.programs.decode(num_steps, features)
        num_rows = batch.block_tables.shape[0]
        if row_map is None:
            prev_tokens, prev_done = self._no_carry
            row_map = np.full(num_rows, -1, np.int32)
        else:
            prev_tokens, prev_done = self._carry_of_last_call()
            row_map = np.pad(np.asarray(row_map, np.int32), (0, num_rows - len(row_map)),
                             constant_values=-1)
        self.compiled_shapes.add(batch.shape_key + (num_steps,))
        args = (self.params, (self.kv_cache, self.penalty_table), batch.packed(),
                prev_tokens, prev_done, row_map)
        program = self.executables.get(name, batch.shape_key, loop, args)
        (self.kv_cache, self.penalty_table), tokens, carry, logprobs = program(*args)
        if self._copy_outputs_early:
            tokens.copy_to_host_async()
        if not batch.want_logprobs.any():
            logprobs = None
        else:
            for array in logprobs:
                if self._copy_outputs_early:
                    array.copy_to_host_async()
        self._last_call = PendingMultiStep(tokens, carry, logprobs)
        return self._last_call

    def prefetch(self, batch: BatchMetadata, num_steps: int) -> bool:
        """Start building, in the background, the program a plain step (``num_steps`` 1) or
        a multi-step decode call of ``batch``'s shape runs (``ExecutableCache.prefetch``);
        ``batch``'s values do not matter. True when a build was queued."""
        prefetch = getattr(self.executables, "prefetch", None)
        if prefetch is None:  # plain jit dispatch on a mesh: nothing to build ahead
            return False
        return prefetch(*self._program_of(batch, num_steps))

    def ensure_program(self, batch: BatchMetadata, num_steps: int) -> bool:
        """Compile now, without running it, the program of ``batch``'s shape (a plain step
        for ``num_steps`` 1, else the multi-step decode loop) unless it is held or saved
        (``ExecutableCache.ensure``); ``batch``'s values do not matter. True when it was
        compiled."""
        ensure = getattr(self.executables, "ensure", None)
        if ensure is None:  # plain jit dispatch on a mesh: programs are built when run
            return False
        return ensure(*self._program_of(batch, num_steps))

    def _fixed_args(self) -> tuple:
        """The params and caches as shapes only (the live caches are donated by every call)."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            (self.params, (self.kv_cache, self.penalty_table)))

    def _program_of(self, batch: BatchMetadata, num_steps: int,
                    device_decided: bool = False, masked: bool = False) -> tuple:
        """(name, bucket, jitted, args) of the program a call of ``batch``'s shape runs
        (``num_steps`` 0: a verify step; ``masked``: the CPU's grammar-masked step), with
        the params and caches as shapes only."""
        fixed = self._fixed_args()
        features = self.programs.features(batch, device_decided)
        if num_steps == 0:
            args = (*fixed, batch.packed(), self._no_carry[0], self._no_draft,
                    np.full(batch.input_ids.shape[0], -1, np.int32))
            return (self.programs.name(self._verify_name(None), features), batch.shape_key,
                    self.programs.step(True, features), args)
        if num_steps == 1:
            args = (*fixed, batch.packed(), self._no_carry[0])
            if masked or (features is None and self.programs.mask_in_device_step):
                args += (jax.ShapeDtypeStruct((batch.block_tables.shape[0], self.mask_words),
                                              np.int32),)
            name = "step-masked" if masked else "step"
            return (self.programs.name(name, features), batch.shape_key,
                    self.programs.step(False, features), args)
        name, loop = self.programs.decode(num_steps, features)
        row_map = np.full(batch.block_tables.shape[0], -1, np.int32)
        args = (*fixed, batch.packed(), *self._no_carry, row_map)
        return name, batch.shape_key, loop, args

    def program_spec(self, key: ProgramKey, empty: Callable[..., BatchMetadata]) -> tuple:
        """(name, bucket, jitted, args) of the program ``key`` names (``core.program_set``);
        ``empty(T, S, M)`` makes a batch of a bucket (``BatchBuilder.empty``)."""
        if key.kind in ("step", "step-masked", "decode", "verify"):
            steps = {"step": 1, "step-masked": 1, "verify": 0}.get(key.kind, key.steps)
            return self._program_of(empty(*key.bucket), steps, key.device_decided,
                                    masked=key.kind == "step-masked")
        if key.kind == "move_blocks":
            return self.block_mover.spec(self._fixed_args()[1][0], key.bucket[0])
        if key.kind == "penalty_fill":
            width = key.bucket[0]
            args = ((), self._fixed_args()[1][1], np.int32(0), np.full(width, -1, np.int32),
                    np.zeros(width, np.int32), np.bool_(False))
            return "penalty_fill", (width,), self._fill_penalties, args
        raise ValueError(f"unknown program kind {key.kind!r}")

    def execute_multi_step(self, batch: BatchMetadata, num_steps: int,
                           device_decided: bool = False) -> np.ndarray:
        """Run ``num_steps`` decode iterations; int32 [num_steps, S], -1 after a row stops."""
        return self.dispatch_multi_step(batch, num_steps,
                                        device_decided=device_decided).fetch()

    def logits(self, batch: BatchMetadata) -> np.ndarray:
        """Run one step and return float32 logits [T, V] for every token (the cache is updated)."""
        self.kv_cache, logits = self._forward_logits(self.params, self.kv_cache,
                                                     jax.device_put(batch.packed()))
        return np.asarray(logits)

