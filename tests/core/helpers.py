"""Builders for host-core tests (no jax)."""

from jaxpage.config import SchedulerConfig
from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.core.request import Request
from jaxpage.core.sched.scheduler import Scheduler
from jaxpage.core.sched.step_result import StepResult
from jaxpage.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 16,
                 max_model_len: int = 1024, prompt: list[int] | None = None, priority: int = 0,
                 **params) -> Request:
    offset = sum(map(ord, request_id))  # distinct prompts per id unless asked otherwise
    if prompt is None:
        prompt = [(7 * i + 3 + offset) % 100 + 10 for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **{"temperature": 0, **params}),
                   max_model_len=max_model_len, eos_token_ids=frozenset({2}), priority=priority)


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, enable_caching: bool = True,
                   num_host_blocks: int = 0, lora_slots=None, **config) -> Scheduler:
    manager = KVCacheManager(BlockPool(num_blocks, enable_caching=enable_caching), block_size,
                             num_host_blocks=num_host_blocks)
    config.setdefault("preemption_mode", "recompute")
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens, **config),
                     manager, lora_slots=lora_slots)


def verify(scheduler: Scheduler, out, rows: list[list[int]]) -> list[Request]:
    """Apply a verify step of ``out`` in which row ``i`` emitted the tokens ``rows[i]``
    (its accepted proposals, then the correction or bonus token); the touched requests."""
    sizes = [item.num_new_tokens for item in out.scheduled]
    result, cu_q_lens = StepResult.verified(rows, sizes)
    return scheduler.apply(out, result, cu_q_lens=cu_q_lens)
