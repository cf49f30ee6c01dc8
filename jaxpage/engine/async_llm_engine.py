"""AsyncLLMEngine: many asyncio callers feed one LLMEngine stepping on its own thread.

Invariants:

* Every call into the ``LLMEngine`` (validation, tokenization, add, step, abort, stats)
  happens on the one engine thread; callers submit work through ``run`` and await it.
  The engine is not thread-safe and never needs to be. The one exception is
  ``compile_grammar`` (thread-safe): structured outputs' grammars compile on a pool
  thread before the request reaches the engine thread, so a slow compile stalls nobody.
* Each request has its own ``asyncio.Queue`` of ``RequestOutput``; the engine thread puts
  into it with ``call_soon_threadsafe`` and ends it with ``_END`` (or an exception).
* ``abort`` is queued ahead of the next step, so an aborted request's KV blocks are freed
  before the engine runs again; a caller that stops iterating (a client that
  disconnected) aborts its request in ``generate``'s ``finally``.
* An exception in one request's handling fails that request only; an exception from
  ``LLMEngine.step`` fails the requests of that step (they are aborted, freeing their
  blocks) and the loop goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from typing import Any, AsyncIterator, Callable

from jaxpage.engine.input_processor import PromptInput
from jaxpage.engine.features.kv_handoff import NoRoomForPages
from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.lora_request import LoRARequest
from jaxpage.outputs import RequestOutput
from jaxpage.sampling_params import SamplingParams

logger = logging.getLogger("jaxpage")

_END = object()


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` already; retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped."""


@dataclasses.dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    finished: bool = False

    def put(self, item: Any) -> bool:
        """Queue ``item`` for the caller; False when the caller's event loop has closed
        (nobody will ever read it: the caller's request should be aborted)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True


class AsyncLLMEngine:
    """Asynchronous front of an ``LLMEngine``; see the module docstring for the invariants.

    The scheduler option ``max_waiting_requests`` (None: unbounded) caps the waiting
    queue: a new request beyond it raises ``QueueFullError``.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.max_waiting_requests = engine.config.scheduler.max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self.stats: dict[str, Any] = engine.get_stats()   # snapshot, refreshed every step
        self.errored: BaseException | None = None
        # Structured outputs' grammars compile here, and a decode instance's KV pages are
        # pulled here: never on the engine thread.
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="jaxpage-grammar")
        self._thread = threading.Thread(target=self._run_loop, name="jaxpage-engine",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> "AsyncLLMEngine":
        """Build the engine from ``LLM``-style keyword options."""
        from jaxpage.engine.llm import LLM

        return cls(LLM(model, **options).llm_engine)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    # -- the engine thread ---------------------------------------------------------------

    def _run_loop(self) -> None:
        while not self._stopped:
            self._drain_commands()
            if self._stopped:
                break
            if not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # noqa: BLE001 - one bad step must not kill the loop
                logger.exception("engine step failed; failing its requests")
                self._fail_all(error)
                continue
            finally:
                self.stats = self.engine.get_stats()
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if not stream.put(output):  # its caller's loop is gone: nobody is listening
                    del self._streams[output.request_id]
                    if not output.finished:
                        self.engine.abort_request(output.request_id)
                    continue
                if output.finished:
                    stream.finished = True
                    stream.put(_END)
                    del self._streams[output.request_id]

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as error:  # noqa: BLE001 - reported to the caller
                future.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(error)
            stream.put(_END)
        self._streams.clear()

    # -- callers (any thread / the event loop) -----------------------------------------

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread before its next step."""
        if self._stopped:
            raise EngineDeadError("the engine has been shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        self._wake.set()
        return future

    async def run(self, fn: Callable[[], Any]) -> Any:
        """Await ``fn()`` run on the engine thread (for tokenizer and engine calls)."""
        return await asyncio.wrap_future(self.submit(fn))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step."""
        def do_abort() -> None:
            self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(_END)
            self.stats = self.engine.get_stats()
        if not self._stopped:
            self.submit(do_abort)

    async def add_request(self, prompt: PromptInput, params: SamplingParams, *,
                          request_id: str | None = None,
                          validate: Callable[[Any], None] | None = None,
                          kv_transfer: dict | None = None,
                          lora_request: LoRARequest | None = None) -> "RequestStream":
        """Validate and queue a request; returns its stream of outputs.

        ``validate(request)`` runs on the engine thread before queueing and may raise
        ``ValueError``. Raises ``ValueError`` for bad input and ``QueueFullError`` when
        the waiting queue is full; in both cases nothing is queued.

        ``kv_transfer``: disaggregated serving's ``kv_transfer_params``
        (``engine.features.kv_handoff``). On a decode instance the pages are pulled on a pool thread
        first (``TimeoutError`` when they do not come); a full host pool is a
        ``QueueFullError``.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(asyncio.Queue(), loop)
        grammar = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # Compiled on a pool thread: a slow grammar delays only its own request.
            grammar = await loop.run_in_executor(
                self._grammar_pool, self.engine.compile_grammar, params.structured_outputs)
        if lora_request is not None and self.engine.loras is not None:
            # Its files (if not in host memory) are read on a pool thread, not the engine's.
            await loop.run_in_executor(self._grammar_pool, self.engine.loras.get, lora_request)
        pages = None
        if kv_transfer is not None:
            ticket = self.engine.check_kv_transfer(kv_transfer)
            if ticket is not None:
                pages = await loop.run_in_executor(self._grammar_pool, self.engine.pull_kv,
                                                   ticket)

        def do_add():
            engine = self.engine
            rid = engine.next_request_id() if request_id is None else str(request_id)
            request = engine.make_request(rid, prompt, params, grammar=grammar,
                                          kv_transfer=kv_transfer, lora_request=lora_request)
            if validate is not None:
                validate(request)
            limit = self.max_waiting_requests
            if limit is not None and engine.scheduler.stats()["num_waiting"] >= limit:
                raise QueueFullError(f"the waiting queue is full ({limit} requests)")
            if pages is None:
                engine.add_validated_request(request)
            else:
                try:
                    engine.add_prefilled(request, pages, kv_transfer)
                except NoRoomForPages as error:
                    raise QueueFullError(f"no room for the request's KV pages: {error}") from None
            self._streams[rid] = stream
            return RequestStream(self, rid, request, stream)

        try:
            return await self.run(do_add)
        except Exception as error:
            if pages is not None:  # the prefill instance's pages were taken all the same
                error.kv_pulled = True
            raise

    async def generate(self, prompt: PromptInput, params: SamplingParams,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs (one final output, or deltas with
        ``output_kind="delta"``). Leaving the loop early aborts the request."""
        stream = await self.add_request(prompt, params, request_id=request_id,
                                        lora_request=lora_request)
        async with stream:
            async for output in stream:
                yield output

    async def get_stats(self) -> dict[str, Any]:
        return await self.run(self.engine.get_stats)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; pending requests are aborted."""
        if self._stopped:
            return
        def stop() -> None:
            for request_id in list(self._streams):
                self.engine.abort_request(request_id)
                self._streams.pop(request_id).put(_END)
            self._stopped = True
        future = self.submit(stop)
        self._wake.set()
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            self._stopped = True
        self._thread.join(timeout)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)


class RequestStream:
    """The outputs of one request, as an async iterator. Closing it before the final
    output (``aclose`` or leaving ``async with``) aborts the request."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, request: Any,
                 stream: _Stream) -> None:
        self.engine = engine
        self.request_id = request_id
        self.request = request  # the validated Request (read-only here: prompt ids, limits)
        self._stream = stream
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if item is _END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
