"""Server-sent events for the streaming routes: a response that stops when the client
leaves, and the event tail both OpenAI routes share (errors as events, then ``[DONE]``)."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import anyio
from fastapi.responses import StreamingResponse

from jaxpage.server.errors import APIError, error_body
from jaxpage.server.serving import GenerationJob


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop as soon as the client disconnects.

    Starlette only notices a disconnect on its next send under ASGI 2.4; this response
    always listens for ``http.disconnect`` and cancels the stream then, so the engine
    requests are aborted at once even between events: by the stream's ``finally`` when
    the cancel lands inside the generator, else (cancelled mid-send, or before the
    generator started) by ``on_close``, which runs however the response ends.
    """

    def __init__(self, content, on_close=None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        # Runs however the response ends, even when the client left before the stream's
        # generator started (its ``finally`` would then never run).
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-send
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            if self.on_close is not None:
                self.on_close()


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def event_stream(job: GenerationJob, chunks: AsyncIterator[str]) -> EventStreamResponse:
    """The streaming response of ``job``: the events of ``chunks``, then ``data: [DONE]``.

    The tail both routes share: an ``APIError`` or ``ValueError`` raised while streaming
    becomes one error event (the 200 status line has gone out already, so it cannot be a
    4xx any more) followed by ``[DONE]``; any other exception ends the response. The
    idempotent ``job.close()`` runs in the generator's ``finally`` when the stream runs
    out, fails or is cancelled inside it, and again from the response's ``on_close``
    however the response ended (which covers a client that left mid-send or before the
    generator started).
    """
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as error:
            yield sse(error_body(error.status, error.message, error.param))
        except ValueError as error:
            yield sse(error_body(400, str(error)))
        finally:
            job.close()
        # Not in the ``finally``: a closed or cancelled generator must not yield again.
        yield "data: [DONE]\n\n"

    return EventStreamResponse(events(), on_close=job.close)
