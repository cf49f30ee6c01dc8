"""Turning OpenAI requests into engine requests, and engine outputs into OpenAI responses.

``GenerationJob`` runs the engine requests of one HTTP request (one per prompt, each with
``n`` sequences), tracks per-choice text, tokens and logprobs as outputs arrive (whole
final outputs, or deltas when the engine streams them), and records the metrics of each
engine request exactly once, however it ends (finished, aborted by a disconnect, failed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator

from jaxpage.engine.async_llm_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError,
                                             RequestStream)
from jaxpage.outputs import RequestOutput
from jaxpage.sampling_params import SamplingParams, StructuredOutputsParams
from jaxpage.server.errors import APIError, bad_request_from
from jaxpage.server.metrics import ServerMetrics
from jaxpage.server.protocol import ChatCompletionRequest, CompletionRequest

RETRY_AFTER_S = "1"


def sampling_params(body: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
                    logprobs: int | None, stream: bool,
                    structured_outputs: StructuredOutputsParams | None = None,
                    defaults: dict | None = None) -> SamplingParams:
    """SamplingParams from the request's fields: where a field is null, ``defaults`` (the
    checkpoint's generation config: ``engine.startup.generation_config``), else OpenAI's."""
    defaults = defaults or {}

    def pick(value, default, name=None):
        if value is not None:
            return value
        return defaults.get(name, default) if name else default

    logit_bias = None
    if body.logit_bias:
        try:  # JSON keys are strings: token ids
            logit_bias = {int(token): value for token, value in body.logit_bias.items()}
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got "
                                f"{sorted(body.logit_bias)[:5]}", param="logit_bias") from None
    if max_tokens is None and "max_tokens" in defaults:
        max_tokens = defaults["max_tokens"]

    extra = {"output_kind": "delta"} if stream else {}
    try:
        return SamplingParams(
            n=body.n, temperature=pick(body.temperature, 1.0, "temperature"),
            top_p=pick(body.top_p, 1.0, "top_p"), top_k=pick(body.top_k, -1, "top_k") or -1,
            min_p=pick(body.min_p, 0.0, "min_p"), seed=body.seed,
            max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            presence_penalty=pick(body.presence_penalty, 0.0),
            frequency_penalty=pick(body.frequency_penalty, 0.0),
            repetition_penalty=pick(body.repetition_penalty, 1.0, "repetition_penalty"),
            logprobs=logprobs,
            structured_outputs=structured_outputs, logit_bias=logit_bias, **extra)
    except ValueError as error:
        raise bad_request_from(error) from None


def context_check(max_model_len: int, params: SamplingParams):
    """A validation hook: explicit max_tokens must fit the context with the prompt (400)."""
    def check(request) -> None:
        if params.max_tokens is not None and request.max_tokens < params.max_tokens:
            raise ValueError(
                f"max_tokens={params.max_tokens} is too large: the model's maximum context "
                f"length is {max_model_len} tokens and the prompt has "
                f"{request.num_prompt_tokens}")
    return check


@dataclasses.dataclass
class Choice:
    """What one sequence has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class _Tracked:
    stream: RequestStream
    num_prompt_tokens: int
    arrival: float
    first_token: float | None = None
    recorded: bool = False


class GenerationJob:
    """The engine requests behind one HTTP request; see the module docstring."""

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics, n: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.n = n
        self.tracked: list[_Tracked] = []
        self.choices: list[Choice] = []
        self.kv_transfer_params: dict | None = None  # a prefill instance's ticket, once finished

    async def start(self, prompts: list[Any], params: SamplingParams, validate=None,
                    kv_transfer: dict | None = None, lora_request=None) -> None:
        """Queue every prompt; on any failure, abort the ones queued and raise an APIError.
        ``kv_transfer``: disaggregated serving's ``kv_transfer_params`` (one prompt)."""
        if kv_transfer is not None and (len(prompts) != 1 or params.n != 1):
            raise APIError(400, "kv_transfer_params need one prompt and n=1",
                           param="kv_transfer_params")
        extra = {} if kv_transfer is None else {"kv_transfer": kv_transfer}
        # A decode instance says whether it pulled the ticket's pages, also when it fails
        # (the proxy then lets the prefill instance release pages nobody took).
        pulled = lambda error: ({"X-KV-Pulled": str(getattr(error, "kv_pulled", False)).lower()}  # noqa: E731
                                if kv_transfer is not None and "uuid" in kv_transfer else {})
        if lora_request is not None:  # an adapter's name as the model (docs/lora.md)
            extra["lora_request"] = lora_request
        try:
            for prompt in prompts:
                arrival = time.monotonic()
                stream = await self.engine.add_request(prompt, params, validate=validate,
                                                       **extra)
                self.tracked.append(_Tracked(stream, stream.request.num_prompt_tokens, arrival))
        except QueueFullError as error:
            self.close()
            raise APIError(503, str(error), headers={"Retry-After": RETRY_AFTER_S,
                                                     **pulled(error)}) from None
        except TimeoutError as error:  # a decode instance's pages did not arrive
            self.close()
            raise APIError(503, str(error), headers=pulled(error)) from None
        except ValueError as error:
            self.close()
            api_error = bad_request_from(error)
            api_error.headers.update(pulled(error))
            raise api_error from None
        except BaseException:
            self.close()
            raise
        self.choices = [Choice(i) for i in range(len(self.tracked) * self.n)]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(t.num_prompt_tokens for t in self.tracked)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> dict[str, int]:
        prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _apply(self, which: int, output: RequestOutput) -> list[tuple[Choice, Any, bool]]:
        """Fold one output into the choices; returns (choice, its delta output, finished)."""
        tracked = self.tracked[which]
        if tracked.first_token is None:
            engine_time = (output.metrics or {}).get("first_token_time")  # time.monotonic()
            if engine_time is not None:
                tracked.first_token = engine_time
            elif any(o.token_ids for o in output.outputs):
                tracked.first_token = time.monotonic()
        changes = []
        for seq in output.outputs:
            choice = self.choices[which * self.n + seq.index]
            choice.text += seq.text
            choice.token_ids += seq.token_ids
            choice.logprobs += seq.logprobs or []
            finished = seq.finish_reason is not None and choice.finish_reason is None
            if finished:
                choice.finish_reason, choice.stop_reason = seq.finish_reason, seq.stop_reason
            changes.append((choice, seq, finished))
        if output.finished:
            self._record(which, output.outputs[0].finish_reason)
            if output.kv_transfer_params is not None:
                self.kv_transfer_params = output.kv_transfer_params
        return changes

    def _record(self, which: int, reason: str | None) -> None:
        tracked = self.tracked[which]
        if tracked.recorded:
            return
        tracked.recorded = True
        num_out = sum(len(c.token_ids) for c in self.choices[which * self.n:(which + 1) * self.n])
        self.metrics.observe_finished(
            num_prompt_tokens=tracked.num_prompt_tokens, num_output_tokens=num_out,
            finish_reason=reason, arrival=tracked.arrival, first_token=tracked.first_token,
            finished=time.monotonic())

    async def events(self) -> AsyncIterator[tuple[Choice, Any, bool]]:
        """(choice, delta, finished) as outputs arrive, over all prompts interleaved."""
        if len(self.tracked) == 1:
            async for output in self.tracked[0].stream:
                for change in self._apply(0, output):
                    yield change
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(which: int) -> None:
            try:
                async for output in self.tracked[which].stream:
                    await queue.put((which, output))
            except BaseException as error:  # noqa: BLE001 - handed to the consumer
                await queue.put((which, error))
            finally:
                await queue.put((which, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.tracked))]
        try:
            remaining = len(tasks)
            while remaining:
                which, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    for change in self._apply(which, item):
                        yield change
        finally:
            for task in tasks:
                task.cancel()

    async def run_to_end(self) -> None:
        """Consume every event (a non-streamed response); ``close`` runs whatever happens,
        so a client that leaves or an engine error aborts what is left and records it."""
        try:
            async for _ in self.events():
                pass
        finally:
            self.close()

    def close(self) -> None:
        """Abort whatever has not finished (a client that left) and record its metrics.

        Safe to call more than once. A request whose final output was not applied is
        recorded with ``finished_reason="abort"`` (as vLLM counts requests aborted by a
        client that left), so every engine request of the job is counted exactly once.
        """
        for which, tracked in enumerate(self.tracked):
            if not tracked.stream.finished:
                tracked.stream.finished = True
                try:
                    self.engine.abort(tracked.stream.request_id)
                except EngineDeadError:
                    pass  # the engine has stopped: nothing is left to free
            self._record(which, "abort")


def completion_logprobs(entries: list[dict], token_ids: list[int],
                        text_offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object from per-token Logprob dicts."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_lps.append(chosen.logprob)
        # the sampled token and the top n, best first
        ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0)
        tops.append({(lp.decoded_token or ""): lp.logprob for lp in ranked})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: list[dict], token_ids: list[int], n: int) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        ranked = [lp for tid, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
                  if (lp.rank or 0) <= n][:n]
        content.append({
            "token": chosen.decoded_token or "", "logprob": chosen.logprob,
            "bytes": list((chosen.decoded_token or "").encode()),
            "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                              "bytes": list((lp.decoded_token or "").encode())} for lp in ranked]})
    return {"content": content}
