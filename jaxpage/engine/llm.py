"""LLM: the offline entry point, with vLLM's names (generate, chat, get_tokenizer)."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm.auto import tqdm

from jaxpage.beam_search import BeamSearchOutput, BeamSearchParams
from jaxpage.config import EngineConfig
from jaxpage.engine.llm_engine import PromptInput
from jaxpage.lora_request import LoRARequest
from jaxpage.outputs import RequestOutput
from jaxpage.engine.startup.replicas import build_engine
from jaxpage.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """Loads a model once and generates for batches of prompts with continuous batching.

    ``model`` is a Hugging Face checkpoint directory, a ``.gguf`` file, or None for the
    embedded default (SmolLM2-135M-Instruct). Every other keyword is an engine option
    (see ``jaxpage.config``); unknown ones raise ``ValueError``.

    ``tensor_parallel_size`` / ``data_parallel_size`` / ``num_processes`` spread the
    model over devices and processes (``docs/parallel.md``). With several processes, the
    constructor on processes other than 0 serves process 0's device calls and then exits
    the process; only process 0 returns an ``LLM`` to generate with.
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 dtype: str = "auto", block_size: int = 16, max_model_len: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 num_kv_blocks: int | None = None, seed: int = 0, **engine_options: Any) -> None:
        config = EngineConfig.from_kwargs(
            model=model, tokenizer=tokenizer, dtype=dtype, block_size=block_size,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
            seed=seed, **engine_options)
        self.llm_engine = build_engine(config)  # LLMEngine, or a router over replicas

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of the requests that name it (see ``LLMEngine.add_lora``)."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        return self.llm_engine.remove_lora(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.llm_engine.list_loras()

    def get_stats(self) -> dict[str, Any]:
        return self.llm_engine.get_stats()

    def save_sharded_checkpoint(self, path: str) -> str:
        """Save the converted (and sharded) params with orbax; ``LLM(model=path)`` restores.

        Restoring skips the conversion from safetensors / GGUF and loads every shard
        straight onto its device. Returns the absolute path.
        """
        from jaxpage.engine.startup.save_checkpoint import save_checkpoint

        return save_checkpoint(self.llm_engine, path)

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's generation-config defaults (vLLM's
        method; ``generation_config="vllm"``: none): what ``generate`` uses without params."""
        defaults = getattr(self.llm_engine, "generation_defaults", None) or {}
        return SamplingParams(**defaults)

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True,
                 priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``.

        ``priority`` (with ``scheduling_policy="priority"``): one integer per prompt, lower
        first. ``lora_request`` (with ``enable_lora=True``): one adapter for every prompt,
        or one per prompt (None: the base model). All prompts are validated before any is
        queued, so a bad one raises ``ValueError`` and leaves the engine untouched.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _one_per_prompt(sampling_params, SamplingParams, len(prompts),
                                      "sampling_params")
        for params in params_list:
            if isinstance(params, SamplingParams) and params.output_kind != "final":
                raise ValueError(f"output_kind={params.output_kind!r}: LLM.generate returns "
                                 "whole outputs; stream with LLMEngine or AsyncLLMEngine")
        if priority is None:
            priority = [0] * len(prompts)
        elif len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = _one_per_prompt(lora_request, LoRARequest, len(prompts), "lora_request")
        return self._run(prompts, params_list, list(priority), use_tqdm, loras)

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams,
                    *, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt, run inside the engine (batched with each other).

        Returns one ``BeamSearchOutput`` per prompt, its sequences best first.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        ids = [engine.next_request_id() for _ in prompts]
        try:
            for search_id, prompt in zip(ids, prompts):
                engine.add_beam_search(search_id, prompt, params)
            with tqdm(total=len(ids), desc="Beam search", disable=not use_tqdm) as bar:
                done = 0
                while engine.has_unfinished_requests():
                    engine.step()
                    now = sum(i in engine.beam_search.results for i in ids)
                    bar.update(now - done)
                    done = now
            return [engine.beam_search.results.pop(i) for i in ids]
        finally:
            for search_id in ids:
                engine.abort_request(search_id)
                engine.beam_search.results.pop(search_id, None)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation and generate."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer, and this model has none")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages={messages!r} must be a non-empty list of messages "
                             "or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            if not conversation or any(not isinstance(m, dict) or "role" not in m
                                       for m in conversation):
                raise ValueError(f"conversation {conversation!r} must be a non-empty list of "
                                 "{'role': ..., 'content': ...} messages")
            ids = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=True, return_dict=True,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message)["input_ids"]
            prompts.append({"prompt_token_ids": list(ids),
                            "prompt": tokenizer.decode(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts: list[PromptInput], params_list: list[SamplingParams],
             priorities: list[int], use_tqdm: bool,
             loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        engine = self.llm_engine
        loras = loras or [None] * len(prompts)
        # Request ids come from the engine's counter, so unseeded sampling (keyed by the
        # engine seed and the request id) replays identically in a new process.
        requests = [engine.make_request(engine.next_request_id(), p, sp, pr,
                                        **({"lora_request": lr} if lr is not None else {}))
                    for p, sp, pr, lr in zip(prompts, params_list, priorities, loras)]
        results: dict[str, RequestOutput] = {}
        try:
            for request in requests:
                engine.add_validated_request(request)
            with tqdm(total=len(requests), desc="Generating", disable=not use_tqdm,
                      dynamic_ncols=True) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        results[output.request_id] = output
                        bar.update(1)
        finally:
            for request in requests:
                if request.request_id not in results:
                    engine.abort_request(request.request_id)
        return [results[r.request_id] for r in requests]


def _one_per_prompt(value: Any, kind: type, count: int, name: str) -> list:
    """``value`` for every prompt: one ``kind`` (or None) for all, or a sequence of one each."""
    if value is None or isinstance(value, kind):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"got {len(values)} {name} for {count} prompts; pass one "
                         f"{kind.__name__} or one per prompt")
    return values
