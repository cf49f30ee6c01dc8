"""Device calls between "schedule" and "tokens back": dispatch, chain, wait, apply.

One ``DeviceCalls.step()`` takes one device call through its life:

1. **schedule and dispatch**: the scheduler picks the requests; pending block copies and
   swaps run first; the batch is built; the runner launches the step without waiting.
   A call is a *single step* (any mix of prefill chunks and decodes, one token each) or a
   *multi-step* decode call (``num_scheduler_steps`` iterations on the device) when
   ``AheadOfHost.reserve_multi_step`` allows it.
2. **overlap** (``async_scheduling``, the default): before the host reads the call's
   tokens, the next call is dispatched behind it. Behind a multi-step call it is the same
   decodes again, continuing each row from the device-side carry
   (``AheadOfHost.chain_multi_step``); behind a single step it is the next schedule made
   from what the host knows (``AheadOfHost.schedule_ahead``): every row of the running call
   counted as done, its sampled token read on the device (``input_src``); that schedule
   may itself be a multi-step call. The new call is then *in flight*: the next ``step()``
   processes it instead of scheduling, so the host's bookkeeping overlaps the device's work.
3. **wait and apply**: the host waits for the call's tokens (the only place it waits on
   the device) and applies them to the requests: scheduler updates, logprobs, beam
   search expansions, stop strings. Outputs are collected by ``collect``.

Invariants:

* At most one call is in flight, always dispatched right behind the call being
  processed (the runner continues its own last call: ``chain=True`` / ``row_map``).
* A call dispatched ahead never preempts and never fills a penalty row of a request
  whose token is still on the device (``core.sched.ahead_of_host``). Its rows count the
  previous call's tokens as known; rows the host later finds finished (stop token, stop
  string, abort) are skipped when their tokens are applied, so no request returns a
  token past its stop. When the host's view is needed first (beam search, a fork due,
  swapped-out requests, blocks short), nothing is dispatched ahead: the host waits and
  schedules normally.
* The host waits for a call only in ``_process`` and ``drain``; everything the
  scheduler does happens between calls or while one is in flight.
* Before anything that schedules outside ``step()`` (``prompt_logits``), ``drain()``
  applies the in-flight call; its outputs come back on the next ``step()``.
* Structured outputs: while a request with a grammar is in the scheduler, every call is
  a single step dispatched after the call before it was processed (the scheduler refuses
  multi-step, ahead and speculative calls: ``Scheduler.has_constrained``). Its rows'
  masks are filled just before dispatch from the grammars' states, and each grammar
  consumes its request's new tokens when the step is processed
  (``engine.features.structured_outputs``); a request whose grammar has ended is finished then.

``step_profile`` splits ``step()``'s wall time (``grammar_s``: the part of the host's
spent filling grammar masks and advancing grammars): ``device_s`` (waiting for results),
``host_s`` (the host's own work), ``idle_s`` (the device had nothing dispatched, counted
from the last moment the host saw it busy: when the last results arrived, or after they
were applied if the call queued behind them was still running then; an upper bound),
``chained`` (calls dispatched before the previous call's tokens were processed) and
``steady`` (those of them scheduled and built in the steady state of decoding, from the
call before alone: ``AheadOfHost.schedule_ahead``, ``BatchBuilder.build``). After each dispatch,
``compile_ahead`` asks for the programs the batch will drain into (``engine.startup.compile_ahead``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from jaxpage.config import SchedulerConfig
from jaxpage.core.batch.builder import BatchBuilder
from jaxpage.core.batch.batch_metadata import BatchMetadata
from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.core.request import Request, RequestStatus
from jaxpage.core.sched.preemption import PreemptionCostModel
from jaxpage.core.sched.scheduler import Scheduler
from jaxpage.core.sched.schedule_output import SchedulerOutput
from jaxpage.engine.features.beam_search_driver import BeamSearchDriver
from jaxpage.engine.startup.compile_ahead import DrainPrograms
from jaxpage.engine.features.kv_handoff import offer_pages
from jaxpage.engine.features.logprobs import LogprobsRecorder
from jaxpage.engine.output_processor import OutputProcessor
from jaxpage.engine.features.structured_outputs import GrammarCompiler, advance
from jaxpage.outputs import RequestOutput
from jaxpage.runtime.model_runner import ModelRunner
from jaxpage.runtime.step_inputs import StepInputs
from jaxpage.runtime.pending_calls import PendingMultiStep, PendingStep


# The host's work per call, by phase (seconds in ``step_profile["phases"]``): scheduling
# and the block manager, building the batch metadata, moving it to the device and
# launching the program, applying the tokens to the requests (stop checks included), and
# turning moved requests into outputs (detokenization, stop strings, deltas).
PHASES = ("schedule", "batch", "dispatch", "process", "outputs")


@dataclass
class DeviceCall:
    """A device call on its way: what was scheduled, its batch (and whether it is all
    decodes, ``BuiltBatch.all_decodes``), and its pending results."""

    out: SchedulerOutput
    num_steps: int
    pending: PendingStep | PendingMultiStep
    dispatched_at: float
    batch: BatchMetadata
    all_decodes: bool


class DeviceCalls:
    """Drives the scheduler, the runner and the result handlers (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, *, scheduler: Scheduler,
                 kv_cache_manager: KVCacheManager, block_pool: BlockPool,
                 batch_builder: BatchBuilder, runner: ModelRunner,
                 cost_model: PreemptionCostModel, beam_search: BeamSearchDriver,
                 logprobs: LogprobsRecorder, output_processor: OutputProcessor,
                 collect: Callable[[list[Request]], list[RequestOutput]],
                 grammars: GrammarCompiler | None = None, kv_transfer=None,
                 draft_proposer=None) -> None:
        self.config = config
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.block_pool = block_pool
        self.batch_builder = batch_builder
        self.runner = runner
        self.cost_model = cost_model
        self.beam_search = beam_search
        self.logprobs = logprobs
        self.output_processor = output_processor
        self.collect = collect  # touched requests -> the outputs users should see
        self.grammars = grammars  # structured outputs' masks (None: no tokenizer)
        self.kv_transfer = kv_transfer  # a prefill instance's transfer server (else None)
        # A draft model's proposer (``runtime.draft_model``; None: none), run here between
        # scheduling and building the batch: the scheduler never calls the device.
        self.draft_proposer = draft_proposer
        self.step_profile = {"calls": 0, "device_s": 0.0, "host_s": 0.0, "idle_s": 0.0,
                             "chained": 0, "steady": 0, "phases": dict.fromkeys(PHASES, 0.0),
                             "grammar_s": 0.0}
        self._phases = self.step_profile["phases"]
        self.inflight: DeviceCall | None = None  # a chained call whose tokens wait
        self._idle_since: float | None = None
        self._results_at = 0.0
        self._pending_outputs: list[RequestOutput] = []  # collected by drain()
        self._empty_steps = 0  # consecutive empty schedules (see _check_not_stalled)
        self.drain_programs = DrainPrograms.for_config(config, batch_builder, runner)

    def step(self) -> list[RequestOutput]:
        """Process one device call (the in-flight one, else a new one); its outputs."""
        began = time.perf_counter()
        call, self.inflight = self.inflight, None
        if call is None:
            call = self._schedule_and_dispatch()
            if call is None:
                outputs, self._pending_outputs = self._pending_outputs, []
                return outputs
        if self.config.async_scheduling:
            self.inflight = (self._dispatch_chained(call) if call.num_steps > 1
                             else self._dispatch_ahead(call))
        waited = time.perf_counter()
        touched = self._process(call)
        processed = time.perf_counter()
        queued = self.inflight
        # The last moment the device was seen busy: when this call's results arrived, or
        # after they were applied if the queued call was still running then.
        seen_busy = (processed if queued is not None and not queued.pending.is_ready()
                     else self._results_at)
        outputs, self._pending_outputs = self._pending_outputs + self.collect(touched), []
        ended = time.perf_counter()
        self._phases["process"] += processed - self._results_at
        self._phases["outputs"] += ended - processed
        if queued is not None and queued.pending.is_ready():
            # The queued call finished while the host was busy: count the device as idle
            # from the last moment it was seen busy (an upper bound).
            self._idle_since = seen_busy
        profile = self.step_profile
        profile["calls"] += 1
        profile["device_s"] += self._results_at - waited
        profile["host_s"] += ended - began - (self._results_at - waited)
        return outputs

    def drain(self) -> None:
        """Apply the in-flight call now (its outputs wait for the next ``step``)."""
        call, self.inflight = self.inflight, None
        if call is not None:
            self._pending_outputs += self.collect(self._process(call))

    # -- dispatch ---------------------------------------------------------------------

    def _mark_dispatch(self) -> float:
        now = time.perf_counter()
        if self._idle_since is not None:
            self.step_profile["idle_s"] += now - self._idle_since
            self._idle_since = None
        return now

    def _schedule_and_dispatch(self) -> DeviceCall | None:
        began = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            self._check_not_stalled(out)
            return None
        self._empty_steps = 0
        if self.draft_proposer is not None and self.scheduler.speculating():
            self._draft_proposals(out)
        num_steps = self.scheduler.ahead.reserve_multi_step(out, self.config.num_scheduler_steps)
        return self._launch(out, num_steps, began)

    def _draft_proposals(self, out: SchedulerOutput) -> None:
        """Run the draft model for the rows of ``out`` that may carry proposals
        (``Speculation.reserve_draft_rows``) and give them its tokens."""
        speculation = self.scheduler.speculation
        wanted = speculation.reserve_draft_rows(out)
        if wanted:
            proposals = self.draft_proposer.propose_batch([(item.request, k)
                                                           for item, k in wanted])
            speculation.give(out, wanted, proposals)

    def _dispatch_chained(self, call: DeviceCall) -> DeviceCall | None:
        """Queue the next multi-step call behind ``call`` before its tokens are known."""
        began = time.perf_counter()
        out = self.scheduler.ahead.chain_multi_step(call.out, call.num_steps)
        if out is None:
            return None
        row_of = {id(item.request): row for row, item in enumerate(call.out.scheduled)}
        row_map = np.array([row_of[id(item.request)] for item in out.scheduled], np.int32)
        return self._launch(out, call.num_steps, began, row_map=row_map,
                            built_ahead=call.num_steps)

    def _dispatch_ahead(self, call: DeviceCall) -> DeviceCall | None:
        """Queue the next schedule behind the single step ``call`` before its tokens are
        known (``AheadOfHost.schedule_ahead``): rows continuing ``call``'s rows read their
        first token on the device. None when the scheduler needs the host's view first."""
        began = time.perf_counter()
        out = self.scheduler.ahead.schedule_ahead(call.out, call.all_decodes)
        if out is None:
            return None
        num_steps = self.scheduler.ahead.reserve_multi_step(out, self.config.num_scheduler_steps)
        if out.continues is not None:  # the steady state: row i continues row i
            self.step_profile["steady"] += 1
            row_map = np.arange(len(out.scheduled), dtype=np.int32)
        else:
            row_map = np.fromiter((item.source_row for item in out.scheduled), np.int32,
                                  len(out.scheduled))
        return self._launch(out, num_steps, began, row_map=row_map)

    def _launch(self, out: SchedulerOutput, num_steps: int, began: float, *,
                row_map: np.ndarray | None = None, built_ahead: int = 0) -> DeviceCall:
        """Run pending block moves, build the batch, fill penalty rows and dispatch.

        ``row_map`` (int32 [n]): the call continues the one dispatched just before, row
        ``i`` from that call's row ``row_map[i]`` (-1: none); ``built_ahead``: every row is
        that many tokens past the host's view (a chained multi-step call)."""
        scheduled = time.perf_counter()
        self.runner.apply_block_ops(*self.kv_cache_manager.take_pending_block_ops())
        if self.scheduler.lora is not None:  # adapters seated for this call
            for slot, adapter in self.scheduler.lora.slots.take_loads():
                self.runner.write_lora_slot(slot, adapter.weights)
        built = self.batch_builder.build(out, ahead=built_ahead)
        batch = built.metadata
        # A fill copies the host's tokens: only rows with none on the device get one.
        self.runner.fill_penalty_rows(self.batch_builder.take_penalty_fills())
        dispatched_at = self._mark_dispatch()
        if row_map is not None:
            self.step_profile["chained"] += 1
        if num_steps > 1:
            pending = self.runner.dispatch_multi_step(batch, num_steps, row_map=row_map)
        else:
            pending = self.runner.dispatch(
                batch, "verify" if out.num_draft_tokens > 0 else "step",
                StepInputs.of(self._grammar_masks(out, batch),
                              self._draft_distributions(out, batch)),
                chain=row_map is not None)
        self._phases["schedule"] += scheduled - began
        self._phases["batch"] += dispatched_at - scheduled
        self._phases["dispatch"] += time.perf_counter() - dispatched_at
        if self.drain_programs is not None:  # compile_ahead
            self.drain_programs.after_dispatch(batch, self.scheduler, self.runner)
        return DeviceCall(out, num_steps, pending, dispatched_at, batch, built.all_decodes)

    def _grammar_masks(self, out: SchedulerOutput, batch: BatchMetadata) -> np.ndarray | None:
        """The step's packed grammar masks (int32 [S, ceil(V / 32)]) when some row has a
        grammar, else None (the plain step program runs)."""
        if not self.scheduler.has_constrained:
            return None
        rows = [(row, item.request.grammar) for row, item in enumerate(out.scheduled)
                if item.request.grammar is not None]
        if not rows:
            return None
        began = time.perf_counter()
        mask = self.grammars.fill_masks(rows, batch.block_tables.shape[0])
        self.step_profile["grammar_s"] += time.perf_counter() - began
        return mask

    def _draft_distributions(self, out: SchedulerOutput, batch) -> tuple | None:
        """A verify step's (q, q_src) when a draft model sampled some of its proposals
        (``StepInputs``' ``draft_probs`` and ``q_src``), else None."""
        if not out.num_draft_tokens or self.draft_proposer is None:
            return None
        q = self.draft_proposer.last_q
        if q is None:
            return None
        k = self.scheduler.speculation.config.num_speculative_tokens
        q_src = np.full(batch.input_ids.shape[0], -1, np.int32)
        for i, item in enumerate(out.scheduled):
            if item.draft_q_row >= 0 and item.request.sampling_params.temperature > 0:
                start = int(batch.cu_q_lens[i])
                count = len(item.draft_token_ids)
                q_src[start:start + count] = item.draft_q_row * k + np.arange(count)
        return q, q_src

    def _check_not_stalled(self, out: SchedulerOutput) -> None:
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

    # -- results ----------------------------------------------------------------------

    def _process(self, call: DeviceCall) -> list[Request]:
        """Wait for ``call``'s tokens and apply them to the requests; returns those touched
        (in the steady state of decoding only those ``collect`` reports on: see
        ``StepApplier.apply``)."""
        touched = self._apply_results(call)
        if self.scheduler.has_constrained:
            began = time.perf_counter()
            for request in advance(touched):  # grammars that have ended finish their request
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            self.step_profile["grammar_s"] += time.perf_counter() - began
        if self.kv_transfer is not None:
            offer_pages(self.kv_transfer, self.runner, touched)
        return touched

    def _apply_results(self, call: DeviceCall) -> list[Request]:
        """Wait for ``call``'s results and apply them (``Scheduler.apply``, which picks the
        steady or the per-row path), with the engine's per-token work as callbacks:
        log-probabilities, first-token times, stop strings, beam-search distributions."""
        result = call.pending.fetch()  # a multi-step call's arrays lead with [K]
        self._results_arrived()
        if call.num_steps == 1 and not call.all_decodes and not call.out.num_draft_tokens:
            self._observe_step(call.out, self._results_at - call.dispatched_at)
        with_logprobs = result.top_ids is not None
        record, after_tokens = self.logprobs.record, self._after_tokens

        def on_token(request: Request, index: int, step: int | None) -> None:
            if with_logprobs:
                record(request, result, index, step)
            if request.first_token_time is None or request.has_stop_strings:
                after_tokens(request)  # tokens after a stop string are dropped

        def on_distribution(request: Request, row: int) -> None:
            self.beam_search.on_distribution(request, result.top_ids[row],
                                             result.top_logprobs[row])

        return self.scheduler.apply(
            call.out, result, all_decodes=call.all_decodes,
            engine_sees_tokens=with_logprobs or self.kv_transfer is not None,
            cu_q_lens=call.batch.cu_q_lens, on_token=on_token, on_distribution=on_distribution)

    def _results_arrived(self) -> None:
        self._results_at = time.perf_counter()
        if self.inflight is None:
            self._idle_since = self._results_at  # nothing queued: the device idles from now

    def _after_tokens(self, request: Request) -> None:
        if request.first_token_time is None and request.num_output_tokens:
            request.first_token_time = time.monotonic()
        if not request.is_finished and request.sampling_params.stop:
            self.output_processor.check_stop_strings(request)

    def _observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Feed the preemption cost model with the measured prefill speed (moving average)."""
        num_prefill = out.num_batched_tokens - len(out.scheduled)  # tokens beyond one a row
        if num_prefill < 16:
            return
        num_prefill = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        if num_prefill >= 16 and seconds > 0:
            model = self.cost_model
            model.prefill_tokens_per_s = (0.8 * model.prefill_tokens_per_s
                                          + 0.2 * num_prefill / seconds)

