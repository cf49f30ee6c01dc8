"""LLMEngine: add requests, step the batch, abort. One model, one scheduler, one runner."""

from __future__ import annotations

import itertools
import os
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpage.config import EngineConfig
from jaxpage.core.batch import BatchBuilder
from jaxpage.core.block_pool import BlockPool
from jaxpage.core.kv_cache_manager import KVCacheManager
from jaxpage.core.request import Request, RequestStatus
from jaxpage.core.scheduler import PreemptionCostModel, Scheduler, SchedulerOutput
from jaxpage.beam_search import BeamSearchParams
from jaxpage.engine.beam_search_driver import BeamSearchDriver
from jaxpage.engine.input_processor import InputProcessor, PromptInput
from jaxpage.engine.logprobs import LogprobsRecorder
from jaxpage.engine.output_processor import OutputProcessor
from jaxpage.engine.tokenizer import cache_dir, load_tokenizer
from jaxpage.models.loader import load_model
from jaxpage.outputs import CompletionOutput, RequestOutput
from jaxpage.parallel.placement import default_mesh
from jaxpage.runtime.kv_cache import (blocks_from_device_memory, bytes_per_block,
                                      device_memory_stats, num_blocks_for_budget)
from jaxpage.runtime.model_runner import ModelRunner, PendingMultiStep, PendingStep
from jaxpage.sampling_params import SamplingParams
from pallas_kernels.ragged_paged_attention import resolve_backend as resolve_attention_backend

logger = logging.getLogger("jaxpage")


@dataclass
class _Call:
    """A device call on its way: what was scheduled, and its pending results."""

    out: SchedulerOutput
    num_steps: int
    pending: PendingStep | PendingMultiStep
    dispatched_at: float



def jax_backend() -> str:
    import jax

    return jax.default_backend()


class LLMEngine:
    def __init__(self, config: EngineConfig, *, mesh: Any = None) -> None:
        """``mesh``: this replica's devices (``jaxpage.parallel.launch.build_engine`` picks
        them); None means replica 0's under ``tensor_parallel_size > 1``, else one device."""
        self.config = config
        mc, cc = config.model, config.cache
        resolve_attention_backend(mc.attention_backend)  # a backend this platform lacks fails now
        if mesh is None:
            mesh = default_mesh(config.parallel)
        num_shards = 1 if mesh is None else mesh.size  # KV sizes are per device
        loaded = load_model(mc.model, dtype=mc.dtype, attention_backend=mc.attention_backend,
                            mesh=mesh)
        self.arch = loaded.arch
        self.tokenizer = load_tokenizer(loaded.path, mc.tokenizer)
        limit = self.arch.max_position_embeddings
        if mc.max_model_len is not None and mc.max_model_len > limit:
            raise ValueError(f"max_model_len={mc.max_model_len} exceeds the model's context "
                             f"length {limit}")
        self.max_model_len = mc.max_model_len or limit
        eos_token_ids = self._eos_token_ids(loaded.hf_config)

        block_size = cc.block_size
        blocks_per_seq = -(-self.max_model_len // block_size)
        dtype = loaded.model.embed[...].dtype
        max_useful = config.scheduler.max_num_seqs * blocks_per_seq
        if cc.num_kv_blocks is not None:
            num_kv_blocks = cc.num_kv_blocks
        elif device_memory_stats() is not None:
            num_kv_blocks = self._profile_num_blocks(loaded, block_size, dtype, max_useful,
                                                     num_shards)
        else:
            num_kv_blocks = num_blocks_for_budget(
                self.arch, block_size, dtype, cc.kv_cache_memory, max_useful_blocks=max_useful,
                num_shards=num_shards)
        self.num_kv_blocks = num_kv_blocks
        per_block = bytes_per_block(self.arch, block_size, dtype)
        num_host_blocks = int(cc.swap_space * 2**30) // per_block
        self.block_pool = BlockPool(num_kv_blocks + 1, enable_caching=cc.enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(self.block_pool, block_size,
                                               num_host_blocks=num_host_blocks)
        self.runner = ModelRunner(loaded, num_blocks=num_kv_blocks + 1, block_size=block_size,
                                  max_num_seqs=config.scheduler.max_num_seqs,
                                  executable_dir=(os.path.join(cache_dir(), "executables")
                                                  if mc.compilation_cache else None),
                                  num_host_blocks=num_host_blocks)
        self.cost_model = PreemptionCostModel(
            bytes_per_block=per_block, host_bandwidth=self.runner.measure_host_bandwidth())
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.cost_model)
        self.batch_builder = BatchBuilder(
            self.kv_cache_manager, max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_num_seqs=config.scheduler.max_num_seqs, max_model_len=self.max_model_len,
            num_penalty_slots=self.runner.penalty_table.shape[0])
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB)", num_kv_blocks,
                    block_size, num_kv_blocks * block_size,
                    num_kv_blocks * bytes_per_block(self.arch, block_size, dtype) / 2**20)
        warmup = mc.warmup if mc.warmup is not None else jax_backend() != "cpu"
        if warmup:
            self.warmup()
        self.input_processor = InputProcessor(
            tokenizer=self.tokenizer, vocab_size=self.arch.vocab_size,
            max_model_len=self.max_model_len, eos_token_ids=eos_token_ids,
            engine_seed=mc.seed, max_num_seqs=config.scheduler.max_num_seqs,
            num_blocks_for=self.kv_cache_manager.num_blocks_for, num_kv_blocks=num_kv_blocks)
        self.beam_search = BeamSearchDriver(self.scheduler, eos_token_ids, self._decode)
        self._ids = itertools.count()
        self._groups: dict[str, list[Request]] = {}  # request id -> its n sequences
        self._group_of: dict[str, str] = {}           # sequence id -> request id
        # Wall time split of step(): device calls (dispatch to results on the host) vs the
        # host's own work (scheduling, batch building, updates), during which the device idles.
        # ``idle_s`` is the device's idle time (nothing dispatched), counted from when the
        # host saw the last results arrive: an upper bound when results arrived unobserved.
        # ``chained``: calls dispatched before the previous call's tokens were processed.
        self.step_profile = {"calls": 0, "device_s": 0.0, "host_s": 0.0, "idle_s": 0.0,
                             "chained": 0}
        self._idle_since: float | None = None
        self._results_at = 0.0
        self._inflight: _Call | None = None    # a dispatched call whose tokens wait
        self._pending_outputs: list[RequestOutput] = []
        self._empty_steps = 0  # consecutive empty schedules (see _check_not_stalled)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.logprobs = LogprobsRecorder(lambda token: self._decode([token]))

    def _profile_num_blocks(self, loaded, block_size: int, dtype, max_useful: int,
                            num_shards: int = 1) -> int:
        """Run the largest bucket with a 2-block cache, read peak memory, size the cache."""
        sched = self.config.scheduler
        probe = ModelRunner(loaded, num_blocks=2, block_size=block_size,
                            max_num_seqs=sched.max_num_seqs)
        builder = BatchBuilder(KVCacheManager(BlockPool(2), block_size),
                               max_num_batched_tokens=sched.max_num_batched_tokens,
                               max_num_seqs=sched.max_num_seqs, max_model_len=self.max_model_len)
        probe.execute(builder.empty(*max(builder.step_shapes())))
        stats = device_memory_stats()
        del probe
        return blocks_from_device_memory(
            stats["bytes_limit"], stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)),
            self.config.cache.memory_utilization,
            bytes_per_block(self.arch, block_size, dtype, num_shards), max_useful)

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

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.input_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.input_processor.eos_token_ids = frozenset(ids)

    def make_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                     priority: int = 0) -> Request:
        """Validate a prompt into a Request (nothing is queued); see InputProcessor."""
        return self.input_processor.make_request(request_id, prompt, params, priority)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str | None, prompt: PromptInput,
                    params: SamplingParams, priority: int = 0) -> str:
        request_id = self.next_request_id() if request_id is None else str(request_id)
        if request_id in self._groups:
            raise ValueError(f"request_id={request_id!r} is already in the engine")
        self.add_validated_request(self.make_request(request_id, prompt, params, priority))
        return request_id

    def add_validated_request(self, request: Request) -> None:
        if request.request_id in self._groups:
            raise ValueError(f"request_id={request.request_id!r} is already in the engine")
        self.scheduler.add_request(request)
        group = [request, *request.fork_children]
        self._groups[request.request_id] = group
        self._group_of.update((seq.request_id, request.request_id) for seq in group)

    def add_beam_search(self, search_id: str, prompt: PromptInput,
                        params: BeamSearchParams) -> None:
        """Start a beam search; its result appears in ``beam_search.results[search_id]``."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params={params!r} must be a BeamSearchParams")
        if search_id in self._groups or search_id in self.beam_search.searches:
            raise ValueError(f"request_id={search_id!r} is already in the engine")
        leader = self.make_request(search_id, prompt, SamplingParams(
            temperature=0, max_tokens=params.max_tokens, ignore_eos=True))
        if params.beam_width > self.config.scheduler.max_num_seqs:
            raise ValueError(f"beam_width={params.beam_width} exceeds max_num_seqs="
                             f"{self.config.scheduler.max_num_seqs}")
        self.beam_search.start(search_id, leader, params)

    def warmup(self) -> int:
        """Compile every program the engine can run, so that no workload compiles later.

        Steps for every (tokens, sequences, blocks) bucket, the multi-step decode loop for
        every all-decode bucket, the penalty-table fill, and block copies / swaps for
        every padded size. Returns
        the number of programs; with the persistent compilation cache warm, a second start
        loads them instead of compiling. ``prompt_logits`` (a diagnostic path) is not covered.
        """
        from tqdm.auto import tqdm

        builder = self.batch_builder
        num_steps = self.config.scheduler.num_scheduler_steps
        jobs = [(shape, 1) for shape in builder.step_shapes()]
        if num_steps > 1:
            jobs += [(shape, num_steps) for shape in builder.decode_shapes()]
        for shape, steps in tqdm(jobs, desc="Compiling buckets", dynamic_ncols=True):
            batch = builder.empty(*shape)
            if steps > 1:
                self.runner.execute_multi_step(batch, steps)
            else:
                self.runner.execute(batch)
        count = len(jobs) + self.runner.compile_penalty_fill() + self.runner.compile_block_ops(
            max_copies=self.config.scheduler.max_num_seqs, max_swaps=self.num_kv_blocks)
        logger.info("warm-up compiled %d programs", count)
        return count

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all its sequences, or all beams of a search) at any stage.

        Its blocks are freed at once. Unknown or finished ids are ignored.
        """
        self.beam_search.abort(request_id)
        for sequence in self._groups.pop(request_id, []):
            self.scheduler.finish_request(sequence.request_id, RequestStatus.FINISHED_ABORTED)
            self.output_processor.forget(sequence.request_id)
            self.logprobs.forget(sequence.request_id)
            self._group_of.pop(sequence.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def num_used_blocks(self) -> int:
        return self.num_kv_blocks - self.block_pool.num_free_blocks

    # -- one iteration ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advance every request by one device call and return what users should see.

        Returns the final output of each request that finished, and for requests with
        ``output_kind="delta"`` the new part of every sequence that moved. When every
        scheduled request is a plain decode, one call runs up to ``num_scheduler_steps``
        decode iterations on the device, and the next such call is dispatched before this
        one's tokens are processed (see ``Scheduler.chain_multi_step``): the host's
        bookkeeping and detokenization then overlap the device's work.
        """
        began = time.perf_counter()
        call, self._inflight = self._inflight, None
        if call is None:
            call = self._schedule_and_dispatch()
            if call is None:
                outputs, self._pending_outputs = self._pending_outputs, []
                return outputs
        if call.num_steps > 1 and self.config.scheduler.async_scheduling:
            self._inflight = self._dispatch_chained(call)
        waited = time.perf_counter()
        touched = self._process(call)
        outputs, self._pending_outputs = self._pending_outputs + self._collect(touched), []
        ended = time.perf_counter()
        if self._inflight is not None and self._inflight.pending.is_ready():
            # The queued call finished while the host was busy: count the device as idle
            # from when this call's results arrived (an upper bound).
            self._idle_since = self._results_at
        profile = self.step_profile
        profile["calls"] += 1
        profile["device_s"] += self._results_at - waited
        profile["host_s"] += ended - began - (self._results_at - waited)
        return outputs

    def _mark_dispatch(self) -> float:
        now = time.perf_counter()
        if self._idle_since is not None:
            self.step_profile["idle_s"] += now - self._idle_since
            self._idle_since = None
        return now

    def _schedule_and_dispatch(self) -> "_Call | None":
        out = self.scheduler.schedule()
        if out.is_empty:
            self._check_not_stalled(out)
            return None
        self._empty_steps = 0
        num_steps = self.scheduler.reserve_multi_step(
            out, self.config.scheduler.num_scheduler_steps)
        self.runner.apply_block_ops(*self.kv_cache_manager.take_pending_block_ops())
        batch = self.batch_builder.build(out)
        self.runner.fill_penalty_rows(self.batch_builder.take_penalty_fills())
        dispatched_at = self._mark_dispatch()
        if num_steps > 1:
            pending = self.runner.dispatch_multi_step(batch, num_steps)
        else:
            pending = self.runner.dispatch(batch)
        return _Call(out, num_steps, pending, dispatched_at)

    def _dispatch_chained(self, call: "_Call") -> "_Call | None":
        """Queue the next multi-step call behind ``call`` before its tokens are known."""
        out = self.scheduler.chain_multi_step(call.out, call.num_steps)
        if out is None:
            return None
        self.runner.apply_block_ops(*self.kv_cache_manager.take_pending_block_ops())
        row_of = {id(item.request): row for row, item in enumerate(call.out.scheduled)}
        row_map = np.array([row_of[id(item.request)] for item in out.scheduled], np.int32)
        batch = self.batch_builder.build(out, ahead=call.num_steps)  # never fills penalty rows
        dispatched_at = self._mark_dispatch()
        self.step_profile["chained"] += 1
        pending = self.runner.dispatch_multi_step(batch, call.num_steps, after=call.pending,
                                                  row_map=row_map)
        return _Call(out, call.num_steps, pending, dispatched_at)

    def _process(self, call: "_Call") -> list[Request]:
        """Wait for ``call``'s tokens and apply them to the requests; returns those touched."""
        if call.num_steps > 1:
            result = call.pending.fetch_result()                            # [K, S]
            self._results_arrived()
            return self._accept_multi_step(call.out, result)
        result = call.pending.fetch()
        self._results_arrived()
        self._observe_step(call.out, self._results_at - call.dispatched_at)
        touched = []
        for request, row in self.scheduler.update_from_output(call.out, result.tokens):
            if request.external_sampling:
                self.beam_search.on_distribution(request, result.top_ids[row],
                                                 result.top_logprobs[row])
                continue
            self.logprobs.record(request, result, row)
            self._after_tokens(request)
            touched.append(request)
        return touched

    def _results_arrived(self) -> None:
        self._results_at = time.perf_counter()
        if self._inflight is None:
            self._idle_since = self._results_at  # nothing queued: the device idles from now

    def _after_tokens(self, request: Request) -> None:
        if request.first_token_time is None and request.num_output_tokens:
            request.first_token_time = time.monotonic()
        if not request.is_finished and request.sampling_params.stop:
            self.output_processor.check_stop_strings(request)

    def _check_not_stalled(self, out) -> None:
        """An empty schedule can happen once (a fork due at admission, a self-preemption);
        several in a row with requests left would be a hang, so fail loudly instead."""
        if out.preempted or not self.scheduler.has_unfinished_requests():
            self._empty_steps = 0
            return
        self._empty_steps += 1
        if self._empty_steps > 3:
            self._empty_steps = 0
            raise RuntimeError(f"scheduler made no progress: {self.scheduler.stats()}, "
                               f"{self.block_pool.num_free_blocks} free blocks")

    def _accept_multi_step(self, out, result) -> list[Request]:
        touched = []
        for row, item in enumerate(out.scheduled):
            request = item.request
            if request.is_finished:
                continue  # finished (or aborted) while this call was queued or running
            for k, token in enumerate(result.tokens[:, row].tolist()):
                if token < 0 or request.is_finished:
                    break  # the device stopped this row; the host agrees (same rules)
                self.scheduler.accept_token(request, token)
                self.logprobs.record(request, result, row, k)
                self._after_tokens(request)  # tokens after a stop string are dropped
            touched.append(request)
        return touched

    def _collect(self, requests: list[Request]) -> list[RequestOutput]:
        """Outputs for the groups of ``requests``: deltas, and finals of finished groups."""
        outputs = []
        seen: set[str] = set()
        moved = {seq.request_id for seq in requests}
        for request in requests:
            group_id = self._group_of.get(request.request_id)
            if group_id is None or group_id in seen:
                continue
            seen.add(group_id)
            group = self._groups[group_id]
            finished = all(seq.is_finished for seq in group)
            if group[0].sampling_params.output_kind == "delta":
                parts = [self.logprobs.attach(self.output_processor.delta(i, seq), seq)
                         for i, seq in enumerate(group) if seq.request_id in moved]
                completions = [part for part in parts if part is not None]
                if completions or finished:
                    outputs.append(self._request_output(group, completions, finished))
            elif finished:
                completions = [self.logprobs.attach(self.output_processor.final(i, seq), seq)
                               for i, seq in enumerate(group)]
                outputs.append(self._request_output(group, completions, True))
            if finished:
                del self._groups[group_id]
                for seq in group:
                    self._group_of.pop(seq.request_id, None)
                    self.output_processor.forget(seq.request_id)
                    self.logprobs.forget(seq.request_id)
        return outputs

    def _observe_step(self, out, seconds: float) -> None:
        """Feed the preemption cost model with the measured prefill speed (moving average)."""
        num_prefill = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        if num_prefill >= 16 and seconds > 0:
            model = self.cost_model
            model.prefill_tokens_per_s = 0.8 * model.prefill_tokens_per_s + 0.2 * num_prefill / seconds

    def _request_output(self, group: list[Request], completions: list[CompletionOutput],
                        finished: bool) -> RequestOutput:
        leader = group[0]
        metrics = {"arrival_time": leader.arrival_time,
                   "first_token_time": min((s.first_token_time for s in group
                                            if s.first_token_time is not None), default=None),
                   "num_preemptions": sum(seq.num_preemptions for seq in group)}
        if finished:
            metrics["finished_time"] = time.monotonic()
        return RequestOutput(
            request_id=leader.request_id, prompt=leader.prompt,
            prompt_token_ids=list(leader.prompt_token_ids), outputs=completions,
            finished=finished, num_cached_tokens=leader.num_cached_tokens or 0, metrics=metrics)

    def _drain(self) -> None:
        """Process a queued call now (its outputs wait for the next ``step``)."""
        call, self._inflight = self._inflight, None
        if call is not None:
            self._pending_outputs += self._collect(self._process(call))

    def prompt_logits(self, prompts: list[PromptInput]) -> list[np.ndarray]:
        """float32 logits [num_prompt_tokens, vocab] of each prompt, computed by the paged model.

        Runs the ordinary schedule (batched, chunked, preemptible) with the logits of every
        token kept. The prompts bypass the prefix cache (a unique extra hash key), since
        every position must be computed. The requests are removed afterwards.
        """
        self._drain()
        greedy_one = SamplingParams(temperature=0, max_tokens=1)
        requests = [self.make_request(self.next_request_id(), p, greedy_one) for p in prompts]
        rows: dict[str, list[np.ndarray]] = {r.request_id: [] for r in requests}
        try:
            for request in requests:
                request.extra_keys = ("prompt_logits", request.request_id)
                self.add_validated_request(request)
            while self.has_unfinished_requests():
                out = self.scheduler.schedule()
                for request in out.preempted:
                    if request.status is RequestStatus.PREEMPTED:  # recomputed from scratch
                        rows[request.request_id].clear()
                if out.is_empty:
                    continue
                self.runner.apply_block_ops(*self.kv_cache_manager.take_pending_block_ops())
                batch = self.batch_builder.build(out)
                # This path does not count sampled tokens in the penalty table.
                self.batch_builder.penalty_slots.forget([s.request for s in out.scheduled])
                logits = self.runner.logits(batch)                         # [T, V]
                for i, item in enumerate(out.scheduled):
                    start = int(batch.cu_q_lens[i])
                    rows[item.request.request_id].append(logits[start:start + item.num_new_tokens])
                self.scheduler.update_from_output(out, logits[batch.logits_indices].argmax(-1))
        finally:
            for request in requests:
                self.abort_request(request.request_id)
        return [np.concatenate(rows[r.request_id]) for r in requests]

    # -- introspection ----------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        free = self.block_pool.num_free_blocks
        return {"num_kv_blocks": self.num_kv_blocks, "num_free_blocks": free,
                **self.scheduler.stats(), "kv_usage": 1.0 - free / self.num_kv_blocks}
