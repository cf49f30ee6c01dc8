"""Builders for host-core tests (no jax)."""

from jaxpage.config import SchedulerConfig
from jaxpage.core.block_pool import BlockPool
from jaxpage.core.kv_cache_manager import KVCacheManager
from jaxpage.core.request import Request
from jaxpage.core.scheduler import Scheduler
from jaxpage.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 16,
                 max_model_len: int = 1024, **params) -> Request:
    prompt = [(7 * i + 3) % 100 + 10 for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **{"temperature": 0, **params}),
                   max_model_len=max_model_len, eos_token_ids=frozenset({2}))


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64) -> Scheduler:
    manager = KVCacheManager(BlockPool(num_blocks), block_size)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens), manager)
