"""LLMEngine: add requests, step the batch, abort. One model, one scheduler, one runner."""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from typing import Any

import numpy as np

from jaxpage.config import EngineConfig
from jaxpage.core.batch import MAX_SUPPRESSED_TOKENS, BatchBuilder
from jaxpage.core.block_pool import BlockPool
from jaxpage.core.kv_cache_manager import KVCacheManager
from jaxpage.core.request import Request, RequestStatus, derive_sample_seed
from jaxpage.core.scheduler import Scheduler
from jaxpage.engine.stop_strings import decode_output, find_stop_string
from jaxpage.engine.tokenizer import load_tokenizer
from jaxpage.models.loader import load_model
from jaxpage.outputs import CompletionOutput, RequestOutput
from jaxpage.runtime.kv_cache import bytes_per_block, num_blocks_for_budget
from jaxpage.runtime.model_runner import ModelRunner
from jaxpage.sampling_params import SamplingParams

logger = logging.getLogger("jaxpage")

PromptInput = str | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, cc = config.model, config.cache
        loaded = load_model(mc.model, dtype=mc.dtype, attention_backend=mc.attention_backend)
        self.arch = loaded.arch
        self.tokenizer = load_tokenizer(loaded.path, mc.tokenizer)
        limit = self.arch.max_position_embeddings
        if mc.max_model_len is not None and mc.max_model_len > limit:
            raise ValueError(f"max_model_len={mc.max_model_len} exceeds the model's context "
                             f"length {limit}")
        self.max_model_len = mc.max_model_len or limit
        self.eos_token_ids = self._eos_token_ids(loaded.hf_config)

        block_size = cc.block_size
        blocks_per_seq = -(-self.max_model_len // block_size)
        dtype = loaded.model.embed[...].dtype
        if cc.num_kv_blocks is not None:
            num_kv_blocks = cc.num_kv_blocks
        else:
            num_kv_blocks = num_blocks_for_budget(
                self.arch, block_size, dtype, cc.kv_cache_memory,
                max_useful_blocks=config.scheduler.max_num_seqs * blocks_per_seq)
        self.num_kv_blocks = num_kv_blocks
        self.block_pool = BlockPool(num_kv_blocks + 1)
        self.kv_cache_manager = KVCacheManager(self.block_pool, block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.batch_builder = BatchBuilder(
            self.kv_cache_manager, max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_num_seqs=config.scheduler.max_num_seqs, max_model_len=self.max_model_len)
        self.runner = ModelRunner(loaded, num_blocks=num_kv_blocks + 1, block_size=block_size)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB)", num_kv_blocks,
                    block_size, num_kv_blocks * block_size,
                    num_kv_blocks * bytes_per_block(self.arch, block_size, dtype) / 2**20)
        self._ids = itertools.count()
        self._stop_text_searched: dict[str, int] = {}
        self._stop_cut: dict[str, int] = {}

    def _eos_token_ids(self, hf_config: dict[str, Any]) -> frozenset[int]:
        ids: set[int] = set()
        eos = hf_config.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    # -- requests ---------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(prompt text, prompt token ids) for a string, {"prompt": ...} or {"prompt_token_ids": ...}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or any(
                        not isinstance(t, int) or isinstance(t, bool) for t in ids):
                    raise ValueError(f"prompt_token_ids={ids!r} must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt dict {prompt!r} needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt={prompt!r} must be a string or a dict with 'prompt' or "
                             "'prompt_token_ids'")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
        return prompt, list(self.tokenizer(prompt).input_ids)

    def make_request(self, request_id: str, prompt: PromptInput,
                     params: SamplingParams) -> Request:
        """Validate a prompt and its sampling params into a Request (nothing is queued)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r} must be a SamplingParams")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError(f"prompt={prompt!r} is empty (it has no tokens)")
        vocab = self.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len={self.max_model_len}"
                             " (the prompt plus at least one generated token must fit)")
        seed = params.seed
        if seed is None:  # stable across processes (str hashes are salted per process)
            digest = hashlib.sha256(f"{self.config.model.seed}:{request_id}".encode()).digest()
            seed = int.from_bytes(digest[:8], "little")
        request = Request(request_id, ids, params, max_model_len=self.max_model_len,
                          eos_token_ids=self.eos_token_ids, sample_seed=derive_sample_seed(seed),
                          prompt=text)
        if params.min_tokens and len(request.stop_token_ids_to_suppress) > MAX_SUPPRESSED_TOKENS:
            raise ValueError(f"min_tokens={params.min_tokens} with more than "
                             f"{MAX_SUPPRESSED_TOKENS} stop token ids is not supported")
        needed = self.kv_cache_manager.num_blocks_for(request.num_prompt_tokens + request.max_tokens)
        if needed > self.num_kv_blocks:
            raise ValueError(f"request needs up to {needed} KV blocks (prompt {len(ids)} + "
                             f"max_tokens {request.max_tokens}) but the cache has only "
                             f"{self.num_kv_blocks}; lower max_tokens or raise num_kv_blocks")
        return request

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str | None, prompt: PromptInput,
                    params: SamplingParams) -> str:
        request_id = self.next_request_id() if request_id is None else str(request_id)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id={request_id!r} is already in the engine")
        self.add_validated_request(self.make_request(request_id, prompt, params))
        return request_id

    def add_validated_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        """Stop a request at any stage; its blocks are freed at once. Unknown ids are ignored."""
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- one iteration ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one model step; returns the outputs of the requests that finished in it."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        tokens = self.runner.execute(self.batch_builder.build(out))
        finished = []
        for request, _ in self.scheduler.update_from_output(out, tokens):
            if not request.is_finished and request.sampling_params.stop:
                self._check_stop_strings(request)
            if request.is_finished:
                finished.append(self._final_output(request))
        return finished

    def _check_stop_strings(self, request: Request) -> None:
        text = decode_output(self.tokenizer, request)
        searched = self._stop_text_searched.get(request.request_id, 0)
        hit = find_stop_string(request, text, searched)
        self._stop_text_searched[request.request_id] = len(text)
        if hit is not None:
            request.stop_reason, self._stop_cut[request.request_id] = hit
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _final_output(self, request: Request) -> RequestOutput:
        text = decode_output(self.tokenizer, request) if self.tokenizer is not None else ""
        cut = self._stop_cut.get(request.request_id)
        if cut is not None:
            text = text[:cut]
        self._forget(request.request_id)
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason, stop_reason=request.stop_reason)
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids), outputs=[completion],
            finished=True, metrics={"arrival_time": request.arrival_time,
                                    "finished_time": time.monotonic(),
                                    "num_preemptions": request.num_preemptions})

    def _forget(self, request_id: str) -> None:
        self._stop_text_searched.pop(request_id, None)
        self._stop_cut.pop(request_id, None)

    def prompt_logits(self, prompts: list[PromptInput]) -> list[np.ndarray]:
        """float32 logits [num_prompt_tokens, vocab] of each prompt, computed by the paged model.

        Runs the ordinary schedule (batched, chunked, preemptible) with the logits of every
        token kept; the requests are removed afterwards.
        """
        greedy_one = SamplingParams(temperature=0, max_tokens=1)
        ids = [self.add_request(None, p, greedy_one) for p in prompts]
        rows: dict[str, list[np.ndarray]] = {i: [] for i in ids}
        try:
            while self.has_unfinished_requests():
                out = self.scheduler.schedule()
                for request in out.preempted:  # its prompt will be computed again
                    rows[request.request_id].clear()
                batch = self.batch_builder.build(out)
                logits = self.runner.logits(batch)                         # [T, V]
                for i, item in enumerate(out.scheduled):
                    start = int(batch.cu_q_lens[i])
                    rows[item.request.request_id].append(logits[start:start + item.num_new_tokens])
                self.scheduler.update_from_output(out, logits[batch.logits_indices].argmax(-1))
        finally:
            for i in ids:
                self.abort_request(i)
        return [np.concatenate(rows[i]) for i in ids]

    # -- introspection ----------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        free = self.block_pool.num_free_blocks
        return {"num_kv_blocks": self.num_kv_blocks, "num_free_blocks": free,
                **self.scheduler.stats(), "kv_usage": 1.0 - free / self.num_kv_blocks}
