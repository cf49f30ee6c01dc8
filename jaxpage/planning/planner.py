"""``plan``: compile the engine's programs for a target without the hardware, and size it.

Steps, per ``plan(model, target, **engine_options)``:

1. Build the replica's programs as abstract arrays (``AbstractEngine``) on the target's
   devices (``jaxpage.parallel.targets``).
2. Probe memory (unless ``num_kv_blocks`` is given): compile the largest step bucket
   with a KV cache of 1 block and of a quarter of the memory the weights leave (or of
   the most blocks ``max_num_seqs`` sequences can use, when fewer: the cache then
   planned, whose compiled step is reused); the compiler's memory analysis
   gives its temporaries per device at both, fitted as ``fixed + per_block x blocks``.
   A per-block term means the compiled step copies the cache (XLA:TPU does when its
   default layout of the cache differs from the layout a kernel or scatter needs); the
   sizing counts it and the report says so.
3. Size the KV cache the way the engine does on a live device: what is left of
   ``memory_utilization`` x the chip's memory after the weights (their shards), the
   penalty table and the largest temporary, in blocks (``num_kv_blocks`` overrides).
4. Compile every program of every bucket with that cache. A TPU compiler refuses a
   program that does not fit its HBM (``RESOURCE_EXHAUSTED``); for GPUs, which have no
   such compile-time check, each program's arguments + outputs - aliases + temporaries
   are compared with the device's memory here. Each is compiled again with half the
   cache: temporaries that grow with it (a copy of the cache) are reported as GROW; a
   cache under ``GROWTH_PROBE_BYTES`` that seems to grow is measured again at that
   size (XLA:TPU moves a cache of a few hundred KiB whole into VMEM within a step).
5. Estimate decode tokens/s per batch bucket (an estimate, never a measurement): a step
   takes at least max(bytes / bandwidth, FLOPs / peak) with the chip's published
   figures. Two byte counts are shown: the compiler's own cost analysis of the compiled
   all-decode step (the attention kernels declare their cost to it: every sequence at
   the bucket's full context), where the compiler gives one (libtpu does; the CUDA
   plugin's deviceless compiler does not), and the floor every decode step must move:
   the device's weight shards plus every sequence's K/V at ``context`` tokens.
"""

from __future__ import annotations

import time
from typing import Any

import jax.numpy as jnp

from jaxpage.config import EngineConfig
from jaxpage.models.hub import resolve_hub_models
from jaxpage.parallel.targets import parse_target, target_devices
from jaxpage.planning.abstract_engine import AbstractEngine
from jaxpage.planning.report import (GROWTH_PROBE_BYTES, GROWTH_TOLERANCE, PlanReport,
                                     ProgramResult, RooflineRow)

GiB = 2**30
# Memory the sizing never plans for: the compiler's own bookkeeping, which its memory
# analysis does not show (libtpu refused a Llama-3-8B step on one v5e chip by 7.2 MB when
# the cache was sized to the last byte at memory_utilization 1.0).
RESERVE_FRACTION = 0.005


def _device_bytes(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
    return {"temp": int(m.temp_size_in_bytes), "total": int(total)}


def _cost(compiled) -> dict[str, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    return {"bytes": float(cost.get("bytes accessed", 0.0)), "flops": float(cost.get("flops", 0.0))}


def _error_text(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:400] if text else type(error).__name__


def plan(model: str | None = None, target: str = "v5e:1x1", *, buckets: str = "largest",
         context: int | None = None, progress: bool = False, **engine_options: Any) -> PlanReport:
    """Compile the engine's programs for ``target`` and report what fits; see the module doc.

    ``model``: a checkpoint directory, a .gguf file or ``preset:<name>`` (only its config
    is read). ``engine_options``: ``LLM``'s keyword arguments (``tensor_parallel_size``,
    ``max_num_seqs``, ``max_model_len``, ``block_size``, ``memory_utilization``,
    ``num_kv_blocks``, ``dtype`` ("auto": the checkpoint's, bfloat16 when it names none),
    ...). ``model`` may be a Hub id (only its config is fetched with the weights' files). ``buckets``: ``"largest"``
    (the ready set and the largest all-decode step, which bound the memory; the default),
    ``"warmup"`` (exactly the ready set: what ``LLM(...)`` builds on this target before it
    takes requests, ``engine.startup.warmup``) or ``"all"`` (every program it builds eventually,
    the rest in the background: ``core.batch.program_set``).
    ``context``: tokens per sequence for the roofline (default ``max_model_len``).
    """
    if buckets not in ("all", "warmup", "largest"):
        raise ValueError(f"buckets={buckets!r} must be 'all', 'warmup' or 'largest'")
    options = dict(engine_options)
    options["model"] = model
    config = resolve_hub_models(EngineConfig.from_kwargs(**options))
    parsed = parse_target(target)
    devices = target_devices(target)
    chip = parsed.chip
    say = print if progress else (lambda *a, **k: None)

    probe = AbstractEngine(config, devices, num_kv_blocks=1)
    weights = probe.weight_bytes_per_device()
    per_block = probe.bytes_per_block()
    penalty = probe.max_num_seqs * probe.arch.vocab_size * 4
    budget = int(config.cache.memory_utilization * chip.hbm_bytes)

    largest_step = probe.program_set().ready[0]  # the largest step, as warm-up builds it
    blocks_per_seq = -(-probe.max_model_len // probe.block_size)
    max_useful = probe.max_num_seqs * blocks_per_seq
    peak_temp, temp_per_block, probe_errors = 0, 0.0, []
    probed_programs: dict[int, Any] = {}  # blocks -> the largest step compiled by the probe
    if weights + penalty <= budget and config.cache.num_kv_blocks is None:
        # (else nothing to size: the weights alone do not fit, or the cache is given, and
        # the temporaries come from the compiled programs below)
        say(f"probing memory: the largest step of {config.model.model or 'default'} on "
            f"{target}")
        temps = []
        # the second size: a quarter of what the weights leave, so that the slope is
        # measured near the sizes planned (it is not linear at small caches), or the most
        # blocks the sequences can use when that is less: the cache planned then, whose
        # compiled step is reused below
        second = int(max(2, min((chip.hbm_bytes - weights - penalty) // 4 // per_block,
                                max_useful)))
        for blocks in (1, second):
            program = probe.program(largest_step, num_blocks=blocks)
            try:
                compiled = probe.compile(program)
            except Exception as error:  # noqa: BLE001 - reported, not raised
                probe_errors.append(f"{program.label}: {_error_text(error)}")
                break
            temps.append(_device_bytes(compiled)["temp"])
            probed_programs[blocks] = compiled
        if len(temps) == 2:
            temp_per_block = max(0.0, (temps[1] - temps[0]) / (second - 1))
            peak_temp = temps[0]
    probed = peak_temp > 0

    report = PlanReport(
        model=config.model.model or "default (SmolLM2-135M-Instruct)", target=target,
        chip=chip.description, num_devices=len(devices), tensor_parallel_size=probe.tp_size,
        dtype=jnp.dtype(probe.dtype).name, hbm_bytes=chip.hbm_bytes,
        memory_utilization=config.cache.memory_utilization, weight_bytes=weights,
        penalty_bytes=penalty, peak_temp_bytes=peak_temp, temp_bytes_per_block=temp_per_block,
        bytes_per_block=per_block,
        block_size=probe.block_size, num_kv_blocks=0, max_model_len=probe.max_model_len,
        max_num_seqs=probe.max_num_seqs, probe_errors=probe_errors, platform=chip.platform,
        kv_layout=probe.kv_layout)
    _size(report)
    requested = config.cache.num_kv_blocks
    report.num_kv_blocks = (requested if requested is not None
                            else int(min(max(report.fitting_kv_blocks, 0), max_useful)))
    _size(report)
    num_blocks = report.num_kv_blocks
    if num_blocks < 1:
        return report  # nothing can be compiled: the weights alone do not leave a block

    engine = AbstractEngine(config, devices, num_kv_blocks=num_blocks)
    # every program is compiled again at a smaller cache: its temporaries must not change
    smaller = max(1, num_blocks // 2)
    programs = list(engine.programs(buckets))
    report.num_ladder_programs = len(engine.program_set().all)
    report.num_ready_programs = len(engine.program_set().ready)
    report.buckets = buckets
    say(f"compiling {len(programs)} programs with a {num_blocks}-block KV cache")
    model_temp = 0
    for i, program in enumerate(programs):
        began = time.perf_counter()
        reuse = probed_programs.get(num_blocks) if program.key == largest_step else None
        try:
            compiled = reuse if reuse is not None else engine.compile(program)
        except Exception as error:  # noqa: BLE001 - reported per program
            result = ProgramResult(program.label, False, error=_error_text(error),
                                   seconds=time.perf_counter() - began)
        else:
            sizes, cost = _device_bytes(compiled), _cost(compiled)
            if program.name.startswith(("step", "decode")):  # the model's programs; block
                # ops never run beside them, so their temporaries do not add up
                model_temp = max(model_temp, sizes["temp"])
            over = chip.platform == "cuda" and sizes["total"] > chip.hbm_bytes
            result = ProgramResult(
                program.label, not over, seconds=time.perf_counter() - began,
                device_bytes=sizes["total"], temp_bytes=sizes["temp"],
                bytes_accessed=cost["bytes"], flops=cost["flops"],
                error=(f"needs {sizes['total'] / GiB:.2f} GiB per device, more than the "
                       f"{chip.hbm_bytes / GiB:.2f} GiB of an {chip.description}")
                if over else None)
            if program.name == "step" and program.bucket[0] == program.bucket[1]:
                report.roofline_inputs.append((program.bucket, cost))
            if smaller < num_blocks:
                _measure_growth(result, engine, program, smaller, num_blocks, per_block)
        report.programs.append(result)
        say(f"  [{i + 1}/{len(programs)}] {result.line()}")
    if not probed:  # the cache was given: judge it by the compiled model programs' own
        report.peak_temp_bytes = model_temp
        _size(report)
    report.roofline = _roofline(report, engine, chip, context)
    return report


def _temp_at(engine: AbstractEngine, program: Any, num_blocks: int) -> int | None:
    """``program``'s temporaries compiled with a ``num_blocks``-block cache (None: it
    did not compile)."""
    try:
        return _device_bytes(engine.compile(engine.program(program.key,
                                                           num_blocks=num_blocks)))["temp"]
    except Exception:  # noqa: BLE001 - the full-size compile is the one that counts
        return None


def _measure_growth(result: ProgramResult, engine: AbstractEngine, program: Any,
                    smaller: int, num_blocks: int, per_block: int) -> None:
    """Compile ``program`` again with a ``smaller``-block cache and record how its
    temporaries change per block (a compile error there leaves it unmeasured).

    A cache of a few MiB may be moved whole into on-chip memory within a step (XLA:TPU
    does so with VMEM: temporaries that grow with the cache and copy nothing in HBM); so
    when a cache under ``GROWTH_PROBE_BYTES`` appears to grow, the slope is measured
    again between caches of that size and half of it, and that one counts."""
    temp = _temp_at(engine, program, smaller)
    if temp is None:
        return
    slope = (result.temp_bytes - temp) / (num_blocks - smaller)
    if slope > GROWTH_TOLERANCE * per_block and num_blocks * per_block < GROWTH_PROBE_BYTES:
        large = -(-GROWTH_PROBE_BYTES // per_block)
        temps = [_temp_at(engine, program, blocks) for blocks in (large, large // 2)]
        if None not in temps:
            slope = (temps[0] - temps[1]) / (large - large // 2)
    result.temp_bytes_per_block = slope
    result.grows_with_cache = slope > GROWTH_TOLERANCE * per_block


def _size(report: PlanReport) -> None:
    """Fill the report's fit: KV blocks that fit at memory_utilization, what is left at
    full memory, and whether the planned cache fits (and by how much it does not)."""
    fixed = report.weight_bytes + report.penalty_bytes + report.peak_temp_bytes
    budget = int(min(report.memory_utilization, 1.0 - RESERVE_FRACTION) * report.hbm_bytes)
    # each block costs its bytes, plus the temporaries a step holds per block (if it copies)
    per_block = report.bytes_per_block + report.temp_bytes_per_block
    report.fitting_kv_blocks = int((budget - fixed - report.bytes_per_block) // per_block)
    report.kv_free_bytes_at_full_memory = int(report.hbm_bytes - fixed)
    blocks = max(report.num_kv_blocks, 1)
    needed = fixed + report.bytes_per_block + blocks * per_block
    report.shortfall_bytes = int(max(0, needed - budget))
    report.fits = 1 <= report.num_kv_blocks <= report.fitting_kv_blocks


def _roofline(report: PlanReport, engine: AbstractEngine, chip, context: int | None
              ) -> list[RooflineRow]:
    """Decode tokens/s per compiled all-decode step bucket; see the module docstring."""
    context = min(context or engine.max_model_len, engine.max_model_len)
    wanted = engine.builder.block_ladder.fit(-(-context // engine.block_size))
    by_batch: dict[int, tuple] = {}
    for (tokens, seqs, blocks), cost in report.roofline_inputs:
        best = by_batch.get(seqs)
        # the block bucket that covers ``context``, else the largest compiled one
        if best is None or (best[0] != wanted and (blocks == wanted or blocks > best[0])):
            by_batch[seqs] = (blocks, cost)
    rows = []
    for seqs, (blocks, cost) in sorted(by_batch.items()):
        floor = engine.weight_bytes_per_device() + seqs * context * engine.kv_bytes_per_token()
        compiler = cost["bytes"] or None
        flops = cost["flops"]
        step_s = max((compiler or floor) / chip.hbm_bandwidth, flops / chip.peak_flops)
        floor_s = max(floor / chip.hbm_bandwidth, flops / chip.peak_flops)
        rows.append(RooflineRow(
            batch=seqs, context=context, compiled_context=blocks * engine.block_size,
            compiler_bytes=compiler, floor_bytes=float(floor), flops=flops,
            tokens_per_s=seqs / step_s, floor_tokens_per_s=seqs / floor_s,
            bound="memory" if (compiler or floor) / chip.hbm_bandwidth
            >= flops / chip.peak_flops else "compute"))
    return rows


__all__ = ["plan", "PlanReport"]
