"""Logits of every prompt position, computed by the paged model (a diagnostic path).

Used to compare the model against a reference token by token. It runs the ordinary
schedule (batched, chunked, preemptible) outside ``LLMEngine.step``, so it first drains
the in-flight device call, and it removes its requests afterwards, also on error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpage.core.sched.step_result import StepResult
from jaxpage.core.request import RequestStatus
from jaxpage.engine.input_processor import PromptInput
from jaxpage.sampling_params import SamplingParams


def prompt_logits(engine: Any, prompts: list[PromptInput]) -> list[np.ndarray]:
    """float32 logits [num_prompt_tokens, vocab] of each prompt, through ``engine``.

    The prompts bypass the prefix cache (a unique extra hash key), since every position
    must be computed, and the penalty table does not count their tokens.
    """
    engine.device_calls.drain()
    greedy_one = SamplingParams(temperature=0, max_tokens=1)
    requests = [engine.make_request(engine.next_request_id(), p, greedy_one) for p in prompts]
    rows: dict[str, list[np.ndarray]] = {r.request_id: [] for r in requests}
    scheduler, builder, runner = engine.scheduler, engine.batch_builder, engine.runner
    try:
        for request in requests:
            request.extra_keys = ("prompt_logits", request.request_id)
            engine.add_validated_request(request)
        while engine.has_unfinished_requests():
            out = scheduler.schedule()
            for request in out.preempted:
                if request.status is RequestStatus.PREEMPTED:  # recomputed from scratch
                    rows[request.request_id].clear()
            if out.is_empty:
                continue
            runner.apply_block_ops(*engine.kv_cache_manager.take_pending_block_ops())
            if scheduler.lora is not None:  # adapters of other requests seated here
                for slot, adapter in scheduler.lora.slots.take_loads():
                    runner.write_lora_slot(slot, adapter.weights)
            batch = builder.build(out).metadata
            builder.penalty_slots.forget([s.request for s in out.scheduled])
            logits = runner.logits(batch)                                   # [T, V]
            for i, item in enumerate(out.scheduled):
                start = int(batch.cu_q_lens[i])
                rows[item.request.request_id].append(logits[start:start + item.num_new_tokens])
            scheduler.apply(out, StepResult(logits[batch.logits_indices].argmax(-1)))
    finally:
        for request in requests:
            engine.abort_request(request.request_id)
    return [np.concatenate(rows[r.request_id]) for r in requests]
