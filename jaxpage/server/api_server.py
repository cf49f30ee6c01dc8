"""The FastAPI app: OpenAI routes over one AsyncLLMEngine, plus health, metrics, tokenize.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` false or true:
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``. With an API key set, every
``/v1`` route needs ``Authorization: Bearer KEY``. A client that disconnects mid-stream
aborts its requests (their KV blocks are freed before the engine's next step).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import time
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from jaxpage.engine.async_llm_engine import AsyncLLMEngine
from jaxpage.lora_request import LoRARequest
from jaxpage.server.errors import APIError, error_response, install_error_handlers
from jaxpage.server.event_stream import event_stream, sse
from jaxpage.server.kv_routes import add_kv_routes
from jaxpage.server.lora_routes import ServedAdapters, add_lora_routes
from jaxpage.server.metrics import ServerMetrics
from jaxpage.server.middleware import APIKeyMiddleware, CountResponsesMiddleware
from jaxpage.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, ErrorResponse, TokenizeRequest)
from jaxpage.server.serving import (GenerationJob, chat_logprobs, completion_logprobs,
                                    context_check, sampling_params)
from jaxpage.server.structured import (structured_outputs_of, template_message, tool_calls_of,
                                       tool_delta)
from jaxpage.server.tool_parsers import StreamingToolCalls, get_parser

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}


def build_app(engine: AsyncLLMEngine, *, served_model_name: str,
              api_key: str | None = None,
              lora_modules: dict[str, str] | None = None,
              chat_template: str | None = None, tool_parser: str | None = None) -> FastAPI:
    """The app serving ``engine`` as the model ``served_model_name``, and each LoRA
    adapter of ``lora_modules`` (name -> PEFT directory, loaded now) under its name.
    ``chat_template``: a Jinja template replacing the tokenizer's; ``tool_parser``: the
    parser (``server.tool_parsers``) that finds tool calls in free output, for
    ``tool_choice: "auto"`` (None: "auto" is refused with a 400)."""
    app = FastAPI(title="jaxpage", version="0.1.0",
                  description="OpenAI-compatible API of a jaxpage engine")
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    metrics = ServerMetrics(served_model_name, lambda: engine.stats)
    core = engine.engine
    max_model_len = core.max_model_len
    app.state.engine, app.state.metrics = engine, metrics
    created = int(time.time())

    if chat_template is not None:
        if core.tokenizer is None:
            raise ValueError("--chat-template: this model has no tokenizer")
        core.tokenizer.chat_template = chat_template
    parser = get_parser(tool_parser) if tool_parser is not None else None
    # the checkpoint's sampling defaults (generation_config.json) for fields a request omits
    defaults = dict(getattr(core, "generation_defaults", {}) or {})

    adapters = ServedAdapters(engine, served_model_name)
    for name, path in (lora_modules or {}).items():
        adapters.add(name, path)
    add_lora_routes(app, adapters, _ERRORS)

    def check_model(name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        if name is None or name == served_model_name:
            return None
        adapter = adapters.get(name)
        if adapter is None:
            served = ", ".join(f"`{n}`" for n in [served_model_name] +
                               [a.lora_name for a in adapters.names()])
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{served}", param="model", code="model_not_found")
        return adapter

    def tokenizer():
        if core.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids")
        return core.tokenizer

    # -- models, health, metrics --------------------------------------------------------

    @app.get("/v1/models")
    async def list_models():
        base = {"id": served_model_name, "object": "model", "created": created,
                "owned_by": "jaxpage", "root": served_model_name, "parent": None,
                "max_model_len": max_model_len}
        return {"object": "list", "data": [base] + [
            {**base, "id": a.lora_name, "root": a.lora_path, "parent": served_model_name}
            for a in adapters.names()]}

    add_kv_routes(app, engine, _ERRORS)

    @app.get("/version")
    async def version():
        return {"version": jaxpage_version()}

    @app.get("/ping")
    @app.post("/ping")
    async def ping():  # load balancers' probe (vLLM's and SageMaker's route)
        return await health()

    @app.get("/health")
    async def health():
        if engine.errored is not None or not engine.alive:
            return error_response(503, "the engine has stopped")
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # -- tokenize ----------------------------------------------------------------------

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` and `messages`", param="prompt")
        tok = tokenizer()
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = await engine.run(lambda: _apply_template(
                tok, messages, add_generation_prompt=body.add_generation_prompt))
        else:
            ids = await engine.run(lambda: list(tok(
                body.prompt, add_special_tokens=body.add_special_tokens).input_ids))
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = core.arch.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                           param="tokens")
        tok = tokenizer()
        return {"prompt": await engine.run(lambda: tok.decode(body.tokens))}

    # -- completions -------------------------------------------------------------------

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest):
        lora = check_model(body.model)
        if body.echo:
            raise APIError(400, "echo=true is not supported", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif all(isinstance(p, int) for p in prompt):
            prompts = [{"prompt_token_ids": list(prompt)}]
        else:
            prompts = [{"prompt_token_ids": list(p)} for p in prompt]
        spec, _ = structured_outputs_of(body)
        params = sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs,
                                 stream=body.stream, structured_outputs=spec,
                                 defaults=defaults)
        job = GenerationJob(engine, metrics, body.n)
        await job.start(prompts, params, context_check(max_model_len, params),
                        kv_transfer=body.kv_transfer_params, lora_request=lora)
        rid = f"cmpl-{job.tracked[0].stream.request_id}"
        name = served_model_name if lora is None else lora.lora_name
        now = int(time.time())

        def logprobs_of(choice, token_ids, entries, offset=0):
            if body.logprobs is None:
                return None
            return completion_logprobs(entries, token_ids, offset)

        if not body.stream:
            await job.run_to_end()
            return {"id": rid, "object": "text_completion", "created": now, "model": name,
                    "choices": [{"index": c.index, "text": c.text,
                                 "logprobs": logprobs_of(c, c.token_ids, c.logprobs),
                                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                                for c in job.choices],
                    "usage": job.usage(), **_kv_ticket(job)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks() -> AsyncIterator[str]:
            offsets = [0] * len(job.choices)
            async for choice, delta, finished in job.events():
                if not (delta.text or delta.token_ids or finished):
                    continue
                lp = logprobs_of(choice, delta.token_ids, delta.logprobs or [],
                                 offsets[choice.index])
                offsets[choice.index] += len(delta.text)
                yield sse({"id": rid, "object": "text_completion", "created": now,
                            "model": name, "choices": [{
                                "index": choice.index, "text": delta.text, "logprobs": lp,
                                "finish_reason": choice.finish_reason if finished else None,
                                "stop_reason": choice.stop_reason if finished else None}]})
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": now,
                            "model": name, "choices": [], "usage": job.usage()})

        return event_stream(job, chunks())

    # -- chat completions --------------------------------------------------------------

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest):
        lora = check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        tok = tokenizer()
        spec, tool_plan = structured_outputs_of(body)
        # tool_choice "auto" (or unset, with tools): the model may call them; a parser finds
        # the calls in its output
        auto_tools = bool(body.tools) and body.tool_choice in (None, "auto") and tool_plan is None
        if auto_tools and parser is None and body.tool_choice == "auto":
            raise APIError(400, 'tool_choice "auto" needs the server started with '
                                "--enable-auto-tool-choice and --tool-call-parser",
                           param="tool_choice")
        auto_parser = parser if auto_tools else None
        messages = [template_message(m) for m in body.messages]
        tools = ([t.model_dump(exclude_none=True) for t in body.tools]
                 if body.tools and body.tool_choice != "none" else None)
        template_kwargs = dict(body.chat_template_kwargs or {})
        try:
            ids = await engine.run(lambda: _apply_template(
                tok, messages, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, tools=tools,
                template_kwargs=template_kwargs))
        except ValueError:
            raise
        except Exception as error:  # a template that rejects the conversation
            raise APIError(400, f"the chat template rejected the messages: {error}",
                           param="messages") from None
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = sampling_params(body, max_tokens=max_tokens, logprobs=num_top,
                                 stream=body.stream, structured_outputs=spec,
                                 defaults=defaults)
        if auto_parser is not None and auto_parser.needs_special_tokens:
            # its markers are special tokens
            params = dataclasses.replace(params, skip_special_tokens=False)
        job = GenerationJob(engine, metrics, body.n)
        await job.start([{"prompt_token_ids": ids}], params, context_check(max_model_len, params),
                        kv_transfer=body.kv_transfer_params, lora_request=lora)
        rid = f"chatcmpl-{job.tracked[0].stream.request_id}"
        name = served_model_name if lora is None else lora.lora_name
        now = int(time.time())

        def logprobs_of(token_ids, entries):
            return None if num_top is None else chat_logprobs(entries, token_ids, num_top)

        def message_of(choice) -> tuple[dict, str | None]:
            """The assistant message and finish reason of a finished choice."""
            if auto_parser is not None:
                content, found = auto_parser.parse(choice.text)
                if not found:
                    return {"role": "assistant", "content": choice.text}, choice.finish_reason
                return ({"role": "assistant", "content": content, "tool_calls": found},
                        "tool_calls")
            calls = tool_calls_of(tool_plan, choice.text) if tool_plan else None
            if calls is None:
                return {"role": "assistant", "content": choice.text}, choice.finish_reason
            # A forced named call finishes with "stop" (as OpenAI and vLLM answer it).
            reason = "tool_calls" if tool_plan.function is None else choice.finish_reason
            return {"role": "assistant", "content": None, "tool_calls": calls}, reason

        if not body.stream:
            await job.run_to_end()
            choices = []
            for c in job.choices:
                message, reason = message_of(c)
                choices.append({"index": c.index, "message": message,
                                "logprobs": logprobs_of(c.token_ids, c.logprobs),
                                "finish_reason": reason, "stop_reason": c.stop_reason})
            return {"id": rid, "object": "chat.completion", "created": now, "model": name,
                    "choices": choices, "usage": job.usage(), **_kv_ticket(job)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[dict], **extra) -> str:
            return sse({"id": rid, "object": "chat.completion.chunk", "created": now,
                         "model": name, "choices": choices, **extra})

        async def chunks() -> AsyncIterator[str]:
            for choice in job.choices:
                yield chunk([{"index": choice.index,
                              "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            call_ids: dict[int, str] = {}
            streams = {c.index: StreamingToolCalls(auto_parser) for c in job.choices} \
                if auto_parser is not None else {}
            async for choice, delta, finished in job.events():
                if not (delta.text or delta.token_ids or finished):
                    continue
                if auto_parser is not None:
                    stream = streams[choice.index]
                    out = stream.delta(delta.text, finished)
                    if out or finished:
                        reason = (("tool_calls" if stream.emitted else choice.finish_reason)
                                  if finished else None)
                        yield chunk([{"index": choice.index, "delta": out,
                                      "logprobs": logprobs_of(delta.token_ids,
                                                              delta.logprobs or []),
                                      "finish_reason": reason,
                                      "stop_reason": choice.stop_reason if finished else None}])
                    continue
                if tool_plan is not None:
                    if tool_plan.function is None and not finished:
                        continue  # "required": the calls are parsed once the array is whole
                    yield chunk([tool_delta(tool_plan, choice, delta, finished, call_ids)])
                    continue
                yield chunk([{"index": choice.index,
                              "delta": {"content": delta.text} if delta.text else {},
                              "logprobs": logprobs_of(delta.token_ids, delta.logprobs or []),
                              "finish_reason": choice.finish_reason if finished else None,
                              "stop_reason": choice.stop_reason if finished else None}])
            if include_usage:
                yield chunk([], usage=job.usage())

        return event_stream(job, chunks())

    # Outermost (added last): counts responses of the key check and of every route.
    app.add_middleware(CountResponsesMiddleware, counter=metrics.http_requests,
                       routes={route.path for route in app.routes})
    return app


def jaxpage_version() -> str:
    """The installed package's version (``GET /version``)."""
    try:
        return importlib.metadata.version("jaxpage")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "0.1.0"


def _kv_ticket(job: GenerationJob) -> dict:
    """A prefill instance's answer carries the ticket for the request's KV pages."""
    return {} if job.kv_transfer_params is None else {"kv_transfer_params": job.kv_transfer_params}


def _apply_template(tok, messages: list[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
    """``template_kwargs``: a request's ``chat_template_kwargs``, variables the template
    reads (e.g. ``enable_thinking``); they cannot replace the arguments above."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=true needs add_generation_prompt=false")
    if getattr(tok, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    template_kwargs = template_kwargs or {}
    reserved = sorted(set(template_kwargs) & {"tokenize", "return_dict", "tools", "messages",
                                              "conversation", "add_generation_prompt",
                                              "continue_final_message", "chat_template"})
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}")
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, tools=tools,
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message,
                                  **template_kwargs)
    return list(out["input_ids"])
