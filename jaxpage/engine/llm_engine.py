"""LLMEngine: the engine's facade. add_request, step, abort, stats, the tokenizer.

One model, one scheduler, one runner. Construction wires the parts together (model
loading, KV sizing in ``kv_sizing``, the block manager, the runner, the scheduler and
batch builder); a ``step()`` is one device call, driven by ``device_calls.DeviceCalls``
(dispatch, chaining, the in-flight call, results into requests); ``request_groups``
turns moved sequences into ``RequestOutput``s. Nothing here waits on the device.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

import numpy as np

from jaxpage.beam_search import BeamSearchParams
from jaxpage.config import EngineConfig
from jaxpage.core.batch.builder import BatchBuilder
from jaxpage.core.batch.batch_shapes import ladder_policy
from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.core.request import Request, RequestStatus
from jaxpage.core.sched.preemption import PreemptionCostModel
from jaxpage.core.sched.scheduler import Scheduler
from jaxpage.engine.features.beam_search_driver import BeamSearchDriver
from jaxpage.engine.device_calls import DeviceCalls
from jaxpage.engine.features import kv_handoff
from jaxpage.engine.input_processor import InputProcessor, PromptInput
from jaxpage.engine.startup.kv_calibration import calibrate_kv_scales
from jaxpage.engine.startup.generation_config import generation_defaults
from jaxpage.engine.startup.kv_sizing import choose_num_kv_blocks, droppable_window
from jaxpage.engine.features.logprobs import LogprobsRecorder
from jaxpage.engine.features.lora_manager import LoRAAdapters
from jaxpage.engine.output_processor import OutputProcessor
from jaxpage.engine.features.prompt_logits import prompt_logits
from jaxpage.engine.request_groups import RequestGroups
from jaxpage.engine.features.structured_outputs import CompiledGrammar, GrammarCompiler
from jaxpage.engine.tokenizer import cache_dir, load_tokenizer
from jaxpage.engine.startup.xla_cache import jax_backend, use_xla_cache
from jaxpage.engine.startup.warmup import (compile_core_programs, compile_ready_programs,
                                    resolve_warmup)
from jaxpage.models.quantize import stored_bytes
from jaxpage.lora_request import LoRARequest
from jaxpage.models.hub import resolve_hub_models
from jaxpage.models.loader import load_model, resolve_model_path
from jaxpage.outputs import RequestOutput
from jaxpage.parallel.placement import default_mesh
from jaxpage.runtime.cpu_threads import lower_compute_threads
from jaxpage.runtime.kv_cache import bytes_per_block
from jaxpage.runtime.model_runner import ModelRunner
from jaxpage.sampling_params import SamplingParams, StructuredOutputsParams
from pallas_kernels import kv_layout, kv_token_scale
from pallas_kernels.ragged_paged_attention import resolve_backend as resolve_attention_backend

logger = logging.getLogger("jaxpage")


def _in_background(fn: Any, *args: Any) -> Future:
    """``fn(*args)`` on a thread of its own; ``.result()`` returns or raises its outcome."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="jaxpage-start")
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)


class LLMEngine(LoRAAdapters, kv_handoff.KVHandoff):
    """Requests in, ``RequestOutput``s out, one device call per ``step()``.

    Invariants: a request id is in the engine from ``add_request`` until its final output
    is returned or it is aborted; every KV block of a request is free once it is
    finished or aborted; ``step()`` returns each token exactly once (as a delta, or in the
    final output).
    """

    def __init__(self, config: EngineConfig, *, mesh: Any = None) -> None:
        """``mesh``: this replica's devices (``jaxpage.engine.startup.replicas.build_engine`` picks
        them); None means replica 0's under ``tensor_parallel_size > 1``, else one device."""
        config = resolve_hub_models(config)  # Hub ids -> local snapshots (models.hub)
        self.config = config
        mc, cc = config.model, config.cache
        resolve_attention_backend(mc.attention_backend)  # a backend this platform lacks fails now
        if mesh is None:
            mesh = default_mesh(config.parallel)
        num_shards = 1 if mesh is None else mesh.size  # KV sizes are per device
        platform = jax_backend() if mesh is None else mesh.devices.flat[0].platform
        layout = kv_layout.for_platform(platform)  # split K and V, or fused rows (TPU)
        # The tokenizer (importing transformers: ~1 s) loads on a thread while the weights
        # load and the KV cache is zeroed, which mostly run outside the GIL.
        tokenizer = _in_background(load_tokenizer, resolve_model_path(mc.model), mc.tokenizer)
        loaded = load_model(mc.model, dtype=mc.dtype, attention_backend=mc.attention_backend,
                            mesh=mesh, hf_overrides=mc.hf_overrides,
                            cache_dir=(os.path.join(cache_dir(), "weights")
                                       if mc.weight_cache else None),
                            quantization=mc.quantization,
                            quantization_group_size=mc.quantization_group_size,
                            kv_format=cc.kv_format, load_format=mc.load_format)
        self.arch = loaded.arch
        # Sampling defaults of requests that set none (the server applies them)
        self.generation_defaults = generation_defaults(
            None if mc.model is None or mc.model.startswith("preset:") else mc.model,
            mc.generation_config)
        self.loras = self._enable_lora(loaded, mesh) if mc.enable_lora else None
        limit = self.arch.max_position_embeddings
        if mc.max_model_len is not None and mc.max_model_len > limit:
            raise ValueError(f"max_model_len={mc.max_model_len} exceeds the model's context "
                             f"length {limit}")
        self.max_model_len = mc.max_model_len or limit

        block_size = cc.block_size
        # what the KV cache holds: the model dtype, or bytes (int8 / fp8 KV)
        dtype = np.uint8 if cc.kv_format else loaded.model.final_norm[...].dtype
        token_scales = kv_token_scale.applies(cc.kv_format, layout)
        kv_token_scale.check_cache(cc.kv_format, layout, self.arch.head_dim)
        if cc.kv_format and not kv_token_scale.per_token(cc.kv_format):  # per-token
            # scales (int8, in every layout) need no calibration
            calibrate_kv_scales(loaded.model, cc.kv_format, tokenizer.result(),
                                self.max_model_len)
        speculation = config.scheduler.speculative
        draft = None
        if speculation is not None and speculation.method == "draft_model":
            if mesh is not None:
                raise ValueError("speculative_config method='draft_model' is not supported "
                                 "on a device mesh (tensor_parallel_size > 1, "
                                 "data_parallel_size > 1 or several processes); use one "
                                 "device, or method='ngram'")
            draft = load_model(speculation.model, dtype=mc.dtype,
                               attention_backend=mc.attention_backend)
        draft_per_block = 0 if draft is None else bytes_per_block(
            draft.arch, cc.block_size, draft.model.final_norm[...].dtype, layout=layout)
        num_kv_blocks = choose_num_kv_blocks(config, loaded, self.max_model_len, dtype,
                                             num_shards, extra_bytes_per_block=draft_per_block,
                                             layout=layout)
        self.num_kv_blocks = num_kv_blocks
        per_block = bytes_per_block(self.arch, block_size, dtype, layout=layout,
                                    token_scales=token_scales)
        num_host_blocks = int(cc.swap_space * 2**30) // per_block
        self.block_pool = BlockPool(num_kv_blocks + 1, enable_caching=cc.enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(
            self.block_pool, block_size, num_host_blocks=num_host_blocks,
            sliding_window=droppable_window(self.arch, None if draft is None else draft.arch))
        if mc.compilation_cache:
            use_xla_cache(os.path.join(cache_dir(), "xla"))
        self.runner = ModelRunner(loaded, num_blocks=num_kv_blocks + 1, block_size=block_size,
                                  max_num_seqs=config.scheduler.max_num_seqs,
                                  executable_dir=(os.path.join(cache_dir(), "executables")
                                                  if mc.compilation_cache else None),
                                  num_host_blocks=num_host_blocks, layout=layout)
        if jax_backend() == "cpu":  # the runner's first computations started XLA's threads
            lower_compute_threads(config.scheduler.cpu_compute_niceness)
        self.cost_model = PreemptionCostModel(
            bytes_per_block=per_block, host_bandwidth=self.runner.measure_host_bandwidth())
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.cost_model,
                                   lora_slots=self._lora_slots())
        self.batch_builder = BatchBuilder(
            self.kv_cache_manager, max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_num_seqs=config.scheduler.max_num_seqs, max_model_len=self.max_model_len,
            num_penalty_slots=self.runner.penalty_table.shape[0],
            bucket_growth=config.scheduler.bucket_growth, sync_requests=self.scheduler.sync_tokens,
            **ladder_policy(self.runner.placement_platform(), resolve_attention_backend(
                mc.attention_backend, dtype=loaded.model.final_norm[...].dtype)))
        self.quantization = loaded.quantization
        self.kv_cache_dtype = cc.kv_cache_dtype
        self.weight_bytes = stored_bytes(self.runner.params)  # every device's share together
        self.kv_bytes_per_block = per_block
        logger.info("weights: %.1f MiB (quantization=%s)", self.weight_bytes / 2**20,
                    self.quantization)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %d bytes a block)",
                    num_kv_blocks, block_size, num_kv_blocks * block_size,
                    num_kv_blocks * self.kv_bytes_per_block / 2**20, self.kv_bytes_per_block)
        self.tokenizer = tokenizer.result()
        self.draft_proposer = None  # a draft model's (``runtime.draft_model``), else None
        if draft is not None:
            self._attach_draft(loaded, draft, speculation, num_kv_blocks)
        eos_token_ids = self._eos_token_ids(loaded.hf_config)
        warmup = resolve_warmup(mc.warmup, jax_backend())
        if warmup == "all":
            self.warmup()
        elif warmup == "ready":
            compile_ready_programs(self)
        elif warmup == "core":
            compile_core_programs(self)
        self.input_processor = InputProcessor(
            tokenizer=self.tokenizer, vocab_size=self.arch.vocab_size,
            max_model_len=self.max_model_len, eos_token_ids=eos_token_ids,
            engine_seed=mc.seed, max_num_seqs=config.scheduler.max_num_seqs,
            num_blocks_for=functools.partial(
                self.kv_cache_manager.most_blocks_held,
                max_step_tokens=config.scheduler.max_num_batched_tokens),
            num_kv_blocks=num_kv_blocks)
        self.beam_search = BeamSearchDriver(self.scheduler, eos_token_ids, self._decode)
        self._ids = itertools.count()
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.logprobs = LogprobsRecorder(lambda token: self._decode([token]))
        self.groups = RequestGroups(self.output_processor, self.logprobs)
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size)
        self.kv_transfer = kv_handoff.start_kv_transfer(cc.kv_role, self.runner, config.parallel,
                                                        cc.kv_transfer_timeout)
        self.device_calls = DeviceCalls(
            config.scheduler, scheduler=self.scheduler,
            kv_cache_manager=self.kv_cache_manager, block_pool=self.block_pool,
            batch_builder=self.batch_builder, runner=self.runner, cost_model=self.cost_model,
            beam_search=self.beam_search, logprobs=self.logprobs,
            output_processor=self.output_processor, collect=self.groups.collect,
            grammars=self.grammars,
            kv_transfer=self.kv_transfer if cc.kv_role == "prefill" else None,
            draft_proposer=self.draft_proposer)

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        """Replacing the runner (``parallel.distributed`` wraps it to mirror every device
        call to the other processes) replaces it where device calls are made too."""
        self._runner = runner
        if hasattr(self, "device_calls"):
            self.device_calls.runner = runner

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
                     priority: int = 0, grammar: CompiledGrammar | None = None,
                     kv_transfer: dict | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        """Validate a prompt into a Request (nothing is queued); see InputProcessor.

        With ``params.structured_outputs`` each sequence gets its own grammar state, from
        ``grammar`` (compiled beforehand by ``compile_grammar``, off this thread) or
        compiled here; a spec llguidance rejects is a ``ValueError``. ``lora_request``
        runs it with that adapter (loaded now if it is not: ``add_lora``)."""
        ticket = self.check_kv_transfer(kv_transfer)
        if ticket is not None:  # the prompt is the one the prefill instance ran
            prompt = {"prompt_token_ids": list(kv_transfer["prompt_token_ids"])}
        adapter = self._adapter(lora_request)
        request = self.input_processor.make_request(request_id, prompt, params, priority)
        self._run_with_adapter(request, adapter)
        request.kv_export = kv_transfer is not None and ticket is None
        spec = params.structured_outputs
        if spec is not None:
            if grammar is None or grammar.spec.key != spec.key:
                grammar = self.compile_grammar(spec)
            for sequence in (request, *request.fork_children):
                sequence.grammar = grammar.new_state()
        return request

    def compile_grammar(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of a structured-outputs spec (cached; thread-safe)."""
        return self.grammars.compile(spec)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str | None, prompt: PromptInput,
                    params: SamplingParams, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        request_id = self.next_request_id() if request_id is None else str(request_id)
        if request_id in self.groups:
            raise ValueError(f"request_id={request_id!r} is already in the engine")
        self.add_validated_request(self.make_request(request_id, prompt, params, priority,
                                                     lora_request=lora_request))
        return request_id

    def add_validated_request(self, request: Request) -> None:
        if request.request_id in self.groups:
            raise ValueError(f"request_id={request.request_id!r} is already in the engine")
        self.scheduler.add_request(request)
        self.groups.add(request)

    def add_beam_search(self, search_id: str, prompt: PromptInput,
                        params: BeamSearchParams) -> None:
        """Start a beam search; its result appears in ``beam_search.results[search_id]``."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params={params!r} must be a BeamSearchParams")
        if search_id in self.groups or search_id in self.beam_search.searches:
            raise ValueError(f"request_id={search_id!r} is already in the engine")
        leader = self.make_request(search_id, prompt, SamplingParams(
            temperature=0, max_tokens=params.max_tokens, ignore_eos=True))
        if params.beam_width > self.config.scheduler.max_num_seqs:
            raise ValueError(f"beam_width={params.beam_width} exceeds max_num_seqs="
                             f"{self.config.scheduler.max_num_seqs}")
        self.beam_search.start(search_id, leader, params)

    def _attach_draft(self, loaded: Any, draft: Any, speculation: Any,
                      num_kv_blocks: int) -> None:
        """The draft model's proposer, on the target's blocks (``runtime.draft_model``)."""
        from jaxpage.runtime.draft_model import DraftModelProposer, check_same_vocabulary

        draft_tokenizer = load_tokenizer(draft.path) if draft.path != loaded.path \
            else self.tokenizer
        check_same_vocabulary(loaded, draft, self.tokenizer, draft_tokenizer)
        builder = self.batch_builder
        proposer = DraftModelProposer(
            draft, speculation, self.kv_cache_manager, num_blocks=num_kv_blocks + 1,
            layout=self.runner.kv_layout, token_ladder=builder.token_ladder, seq_ladder=builder.seq_ladder,
            block_ladder=builder.block_ladder)
        self.draft_proposer = proposer
        self.runner.use_draft_rows(proposer.q_rows)

    def warmup(self) -> int:
        """Compile every program the engine can run, so that no workload compiles later;
        the number of programs (``engine.startup.warmup``)."""
        from jaxpage.engine.startup.warmup import compile_every_program

        return compile_every_program(self)

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop a request (all its sequences, or all beams of a search) at any stage.

        ``request_id``: one id or several (as vLLM). Their blocks are freed at once.
        Unknown or finished ids are ignored.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for one in ids:
            self.beam_search.abort(one)
            for sequence in self.groups.pop(one):
                self.scheduler.finish_request(sequence.request_id,
                                              RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting, running or swapped out (sequences of ``n > 1`` count each)."""
        stats = self.scheduler.stats()
        return stats["num_running"] + stats["num_waiting"] + stats["num_swapped"]

    def get_tokenizer(self):
        """The tokenizer (a ``transformers`` tokenizer), as ``LLM.get_tokenizer``."""
        return self.tokenizer

    def num_used_blocks(self) -> int:
        return self.num_kv_blocks - self.block_pool.num_free_blocks

    # -- one iteration ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advance every request by one device call and return what users should see.

        Returns the final output of each request that finished, and for requests with
        ``output_kind="delta"`` the new part of every sequence that moved. When every
        scheduled request is a plain decode, one call runs up to ``num_scheduler_steps``
        decode iterations on the device, and the next such call is dispatched before this
        one's tokens are processed: the host's bookkeeping and detokenization then overlap
        the device's work (``device_calls`` states when a call may chain).
        """
        return self.device_calls.step()

    @property
    def step_profile(self) -> dict[str, Any]:
        """Wall time split of ``step()`` (see ``device_calls``)."""
        return self.device_calls.step_profile

    def prompt_logits(self, prompts: list[PromptInput]) -> list[np.ndarray]:
        """float32 logits [num_prompt_tokens, vocab] of each prompt (see ``prompt_logits``)."""
        return prompt_logits(self, prompts)

    # -- introspection ----------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        free = self.block_pool.num_free_blocks
        return {"num_kv_blocks": self.num_kv_blocks, "num_free_blocks": free,
                "quantization": self.quantization, "weight_bytes": self.weight_bytes,
                "kv_cache_dtype": self.kv_cache_dtype,
                "kv_bytes_per_block": self.kv_bytes_per_block,
                **self.scheduler.stats(), "kv_usage": 1.0 - free / self.num_kv_blocks,
                **self.kv_transfer_stats()}

