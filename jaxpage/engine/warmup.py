"""Warm-up: every program an engine can run, compiled (or loaded from the persistent
compilation cache) before the first request, for ``warmup=True``."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("jaxpage")


def compile_every_program(engine: Any) -> int:
    """Compile every program ``engine`` (an ``LLMEngine``) can run, so that no workload
    compiles later; the number of programs.

    Steps for every (tokens, sequences, blocks) bucket, the multi-step decode loop for
    every all-decode bucket, verify steps when speculation is on
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
    for shape, steps in tqdm(jobs, desc="Compiling buckets", dynamic_ncols=True):
        batch = builder.empty(*shape)
        if steps > 1:
            engine.runner.execute_multi_step(batch, steps)
        else:
            engine.runner.dispatch(batch, verify=steps == 0).fetch()
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
