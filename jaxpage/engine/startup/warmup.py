"""Warm-up: the programs an engine builds before its first request.

Four modes (``resolve_warmup``):

* ``"ready"`` (the default on accelerators): the *ready set* of ``core.batch.program_set`` (the
  largest step, the largest decode call, the largest block move, the penalty fill: enough
  to run any batch, padded) is built before the engine returns; every other program of
  the set is built afterwards on the background thread, largest first, and until one
  exists its batches run padded in the smallest built program that holds them
  (``runtime.program_fallback``), so no request waits for a compile.
* ``"all"`` (``warmup=True``): every program of the set (and a draft model's and LoRA's)
  before the first request.
* ``"core"`` (the default on the CPU) compiles the few programs nearly every workload
  runs, a full prefill step and the decode programs of every seat rung, unless they are
  already saved (so a warm start still loads nothing up front), and runs each one it
  compiled once (``first_run``); the rest are built when a batch first needs them.
* ``"none"`` (``warmup=False``) builds every program when a batch first needs it.

Built means loaded from the executable cache when saved there, else compiled.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from jaxpage.core.batch.program_set import MODEL_KINDS, ProgramKey, ProgramSet, program_set
from jaxpage.runtime import background_compile
from jaxpage.runtime.penalty_filler import PENALTY_FILL_WIDTH
from jaxpage.runtime.program_fallback import ProgramFallback

logger = logging.getLogger("jaxpage")

WARMUP_MODES = ("all", "ready", "core", "none")
# Overrides the platform default of ``warmup=None`` (an explicit ``warmup`` wins).
WARMUP_ENV = "JAXPAGE_WARMUP"


def resolve_warmup(option: bool | str | None, backend: str) -> str:
    """The warm-up mode of an engine: ``warmup`` as given (True: "all", False: "none",
    "ready", "core"), else ``$JAXPAGE_WARMUP``, else "ready" on accelerators and "core"
    on the CPU."""
    if option is True:
        return "all"
    if option is False:
        return "none"
    if option is not None:
        return option
    mode = os.environ.get(WARMUP_ENV, "").strip().lower()
    if mode:
        if mode not in WARMUP_MODES:
            raise ValueError(f"{WARMUP_ENV}={mode!r} must be one of {WARMUP_MODES}")
        return mode
    return "ready" if backend != "cpu" else "core"


def engine_program_set(engine: Any) -> ProgramSet:
    """The program set (``core.batch.program_set``) of ``engine`` (an ``LLMEngine``)."""
    builder, runner = engine.batch_builder, engine.runner
    speculation = engine.config.scheduler.speculative
    verifies = (builder.verify_shapes(speculation.disable_by_batch_size,
                                      speculation.num_speculative_tokens)
                if speculation is not None else None)
    return program_set(builder, num_steps=engine.config.scheduler.num_scheduler_steps,
                       host_decides=runner.programs.host_decides_branches,
                       move_sizes=runner.block_mover.sizes, penalty_width=PENALTY_FILL_WIDTH,
                       verify_shapes=verifies,
                       masked_steps=not runner.programs.mask_in_device_step,
                       fixed_decode=runner.programs.fixed_decode_length,
                       draft_rows=runner.draft_rows)


def _holds_programs(runner: Any) -> bool:
    """The runner keeps built programs itself (an ``ExecutableCache``), so a program can be
    built without running it; a mesh's plain jit dispatch builds a program by running it."""
    return hasattr(runner.executables, "holds")


def build_program(engine: Any, key: ProgramKey) -> None:
    """Build (load or compile) the program ``key`` names and hold it, without running it
    where the runner can (else by running it once on a batch holding nothing)."""
    runner, builder = engine.runner, engine.batch_builder
    if _holds_programs(runner):
        runner.executables.get(*runner.program_spec(key, builder.empty))
    else:
        runner.run_program(key, builder.empty(*key.bucket) if key.kind in MODEL_KINDS else None)


def _build_with_progress(engine: Any, keys: tuple[ProgramKey, ...], description: str) -> float:
    """Build ``keys`` one after another under a progress bar; the seconds taken."""
    from tqdm.auto import tqdm

    began = time.perf_counter()
    for key in tqdm(keys, desc=description, dynamic_ncols=True, disable=not keys):
        build_program(engine, key)
    return time.perf_counter() - began


def compile_ready_programs(engine: Any) -> int:
    """Build the ready set now and queue every other program of the set on the background
    thread, largest first, with the runner's fallback on until they are all built (see
    the module docstring); the number of programs built now."""
    programs = engine_program_set(engine)
    runner = engine.runner
    if not _holds_programs(runner):  # a mesh: programs are built by running them
        logger.info("warm-up 'ready' on a device mesh builds every program first")
        return compile_every_program(engine)
    seconds = _build_with_progress(engine, programs.ready, "Compiling the ready set")
    _build_feature_programs(engine)  # a request of those features must not wait either
    executables = runner.executables
    empty = engine.batch_builder.empty
    runner.fallback = ProgramFallback(
        programs.all, executables, empty,
        request=lambda key: executables.prefetch(*runner.program_spec(key, empty), urgent=True))
    runner.block_mover.built = lambda size: executables.holds(ProgramKey("move_blocks", (size,)))
    logger.info("ready after %d programs (%.1f s); building %d more in the background",
                len(programs.ready), seconds, len(programs.background))
    began = time.perf_counter()
    for key in programs.background:
        executables.prefetch(*runner.program_spec(key, engine.batch_builder.empty))
    background_compile.submit(lambda: _background_done(runner, programs, began))
    return len(programs.ready)


def _background_done(runner: Any, programs: ProgramSet, began: float) -> None:
    """Runs on the background thread after its builds: log, and turn the fallback off when
    every program of the set is built (a failed build keeps it on: its batches stay
    padded into a larger program)."""
    missing = [key for key in programs.background if not runner.executables.holds(key)]
    logger.info("background compiles done: %d programs in %.1f s%s",
                len(programs.background) - len(missing), time.perf_counter() - began,
                f" ({len(missing)} failed: their batches run padded)" if missing else "")
    if not missing:
        runner.fallback = None
        runner.block_mover.built = None


def core_program_shapes(engine: Any) -> list[tuple[tuple[int, int, int], int]]:
    """((T, S, M), steps) of the core programs, each at every block-table width:

    * a step at the largest token rung with its seats (every long prompt's chunks run it);
    * a step of a full batch (the most seats) at every token rung that holds one token a
      seat: a loaded engine's steps of decodes plus a prompt chunk (the last chunk of a
      burst of prompts lands on one of these rungs);
    * the decode call (``steps`` iterations, or a plain step when ``num_scheduler_steps``
      is 1) at every decode seat rung a batch drains through, largest first; not when
      speculation is on (its decodes are verify steps).
    """
    builder = engine.batch_builder
    top = builder.token_ladder.rungs[-1]
    most = builder.seq_ladder.rungs[-1]
    steps_of = {(top, builder.seats(top, 1, decodes_only=False))}
    steps_of |= {(rung, builder.seats(rung, most, decodes_only=False))
                 for rung in builder.token_ladder.rungs if rung >= most}
    shapes = [((*pair, width), 1) for pair in sorted(steps_of, reverse=True)
              for width in builder.block_ladder.rungs]
    if engine.scheduler.speculation is None:
        steps = engine.config.scheduler.num_scheduler_steps
        shapes += [(shape, steps) for shape in reversed(builder.decode_shapes())]
    return shapes


def compile_core_programs(engine: Any) -> int:
    """Compile the core programs (``core_program_shapes``) that are neither held nor
    saved, and run each one compiled here once on a throwaway batch (``first_run``); the
    number compiled. Programs already saved are not loaded: a warm start stays fast."""
    builder, runner = engine.batch_builder, engine.runner
    compiled = 0
    for shape, steps in core_program_shapes(engine):
        if runner.ensure_program(builder.empty(*shape), steps):
            compiled += 1
            first_run(engine, shape, steps)
    if compiled:
        logger.info("warm-up compiled %d core programs", compiled)
    return compiled


def first_run(engine: Any, shape: tuple[int, int, int], steps: int) -> None:
    """Run the program of ``shape`` (a step for ``steps`` 1, else the multi-step decode
    call) once, before any request is admitted.

    XLA:CPU sets up each library fusion (YNNPACK's dots) on a program's first run: ~0.6
    ms a fusion, ~0.15 s for a SmolLM2 program, that the first batch would otherwise
    pay. A step runs on a batch holding nothing. A decode call runs one throwaway row
    for one iteration (with no live row its loop would not run at all): it writes one
    slot of block 0, which no request holds yet, and no penalty row (slot -1)."""
    batch = engine.batch_builder.empty(*shape)
    if steps == 1:
        engine.runner.dispatch(batch).fetch()
        return
    batch.num_seqs[0] = 1
    batch.kv_lens[0] = 1
    batch.cu_q_lens[1:] = 1
    batch.max_output[0] = 1  # done after its first token
    engine.runner.execute_multi_step(batch, steps)


def compile_every_program(engine: Any) -> int:
    """Build every program ``engine`` (an ``LLMEngine``) can run, so that no workload
    compiles later; the number of programs.

    The program set (``engine_program_set``: steps, multi-step decode calls and verify
    steps of every bucket, in both variants where the host decides the sampling features,
    block moves of every size, the penalty fill), then a draft model's and LoRA's
    programs. With the executable cache warm, a second start loads them instead of
    compiling. ``prompt_logits`` (a diagnostic path) is not covered.
    """
    programs = engine_program_set(engine)
    _build_with_progress(engine, programs.all, "Compiling buckets")
    count = len(programs.all) + _build_feature_programs(engine)
    logger.info("warm-up built %d programs", count)
    return count


def _build_feature_programs(engine: Any) -> int:
    """A draft model's and LoRA's programs (outside the program set: only engines with
    those features have them); the number built."""
    count = 0
    if engine.draft_proposer is not None:  # a draft model's fill and propose programs
        count += engine.draft_proposer.warmup()
    if engine.loras is not None:  # the slot-write program: slot 1 written as it is
        holder = engine.scheduler.lora.slots.holder(1)
        engine.runner.write_lora_slot(1, None if holder is None else holder.weights)
        count += 1
    return count
