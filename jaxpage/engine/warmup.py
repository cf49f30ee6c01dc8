"""Warm-up: the programs an engine compiles before its first request.

Three modes (``resolve_warmup``): ``"all"`` (``warmup=True``, the default on
accelerators) compiles or loads every program an engine can run; ``"core"`` (the default
on the CPU) compiles the few programs nearly every workload runs, a full prefill step and
the decode programs of every seat rung, unless they are already saved (so a warm start
still loads nothing up front), and runs each one it compiled once (``first_run``);
``"none"`` (``warmup=False``) builds every program when a batch first needs it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("jaxpage")

WARMUP_MODES = ("all", "core", "none")
# Overrides the platform default of ``warmup=None`` (an explicit ``warmup`` wins).
WARMUP_ENV = "JAXPAGE_WARMUP"


def resolve_warmup(option: bool | str | None, backend: str) -> str:
    """The warm-up mode of an engine: ``warmup`` as given (True: "all", False: "none",
    "core"), else ``$JAXPAGE_WARMUP``, else "all" on accelerators and "core" on the CPU."""
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
    return "all" if backend != "cpu" else "core"


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
    """Compile every program ``engine`` (an ``LLMEngine``) can run, so that no workload
    compiles later; the number of programs.

    Steps for every (tokens, sequences, blocks) bucket, the multi-step decode loop for
    every all-decode bucket (each in both its programs where the host decides the
    sampling features: ``core.step_features.features_of``), verify steps when speculation
    is on
    (``BatchBuilder.verify_shapes``), a draft model's and LoRA's programs, the
    penalty-table fill, and block copies / swaps for every padded size. With the
    persistent compilation cache warm, a second start loads them instead of compiling.
    ``prompt_logits`` (a diagnostic path) is not covered.
    """
    from tqdm.auto import tqdm

    builder = engine.batch_builder
    num_steps = engine.config.scheduler.num_scheduler_steps
    jobs = [(shape, 1) for shape in builder.step_shapes()]
    if num_steps > 1:
        jobs += [(shape, num_steps) for shape in builder.decode_shapes()]
    speculation = engine.scheduler.speculation
    if speculation is not None:  # verify steps: 0 below means "verify"
        jobs += [(shape, 0) for shape in builder.verify_shapes(
            speculation.disable_by_batch_size, speculation.num_speculative_tokens)]
    variants = [False, True] if engine.runner.programs.host_decides_branches else [False]
    jobs = [(shape, steps, device) for device in variants for shape, steps in jobs]
    for shape, steps, device in tqdm(jobs, desc="Compiling buckets", dynamic_ncols=True):
        batch = builder.empty(*shape)
        if steps > 1:
            engine.runner.execute_multi_step(batch, steps, device_decided=device)
        else:
            engine.runner.dispatch(batch, verify=steps == 0, device_decided=device).fetch()
    proposer = engine.scheduler.proposer
    if hasattr(proposer, "warmup"):  # a draft model's fill and propose programs
        jobs += [None] * proposer.warmup()
    if engine.loras is not None:  # the slot-write program: slot 1 written as it is
        holder = engine.scheduler.lora_slots.holder(1)
        engine.runner.write_lora_slot(1, None if holder is None else holder.weights)
        jobs.append(None)
    count = len(jobs) + engine.runner.compile_penalty_fill() + engine.runner.compile_block_ops(
        max_copies=engine.config.scheduler.max_num_seqs, max_swaps=engine.num_kv_blocks)
    logger.info("warm-up compiled %d programs", count)
    return count
