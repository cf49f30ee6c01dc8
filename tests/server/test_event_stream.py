"""The streaming tail shared by completions and chat (``event_stream``), without a server:
``[DONE]`` after the chunks, an error event for an error raised mid-stream, and the job
closed however the stream ends."""

from __future__ import annotations

import asyncio
import json

import pytest

from jaxpage.server.event_stream import event_stream
from jaxpage.server.errors import APIError


class FakeJob:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def stream_of(job: FakeJob, error: BaseException | None = None):
    async def chunks():
        yield "data: 1\n\n"
        yield "data: 2\n\n"
        if error is not None:
            raise error
    return event_stream(job, chunks())


async def drain(response) -> list[str]:
    return [chunk async for chunk in response.body_iterator]


def test_chunks_then_done_and_the_job_is_closed():
    job = FakeJob()
    response = stream_of(job)
    assert response.media_type == "text/event-stream"
    assert asyncio.run(drain(response)) == ["data: 1\n\n", "data: 2\n\n", "data: [DONE]\n\n"]
    assert job.closed == 1
    response.on_close()  # the response's own hook: closing again is harmless
    assert job.closed == 2


@pytest.mark.parametrize("error, status, param", [
    (APIError(400, "bad value", param="stop"), 400, "stop"),
    (ValueError("prompt is too long"), 400, None),
])
def test_an_error_mid_stream_is_one_error_event_then_done(error, status, param):
    job = FakeJob()
    events = asyncio.run(drain(stream_of(job, error)))
    assert events[:2] == ["data: 1\n\n", "data: 2\n\n"]
    assert events[-1] == "data: [DONE]\n\n" and len(events) == 4
    body = json.loads(events[2][len("data: "):])["error"]
    assert (body["code"], body["message"], body["param"]) == (status, str(error), param)
    assert job.closed == 1


def test_another_error_ends_the_stream_without_done():
    job = FakeJob()
    with pytest.raises(RuntimeError):
        asyncio.run(drain(stream_of(job, RuntimeError("engine step failed"))))
    assert job.closed == 1


def test_a_stream_closed_after_its_first_event_closes_the_job_and_stops():
    job = FakeJob()

    async def first_then_close():
        events = stream_of(job).body_iterator
        first = await events.__anext__()
        await events.aclose()
        return first

    assert asyncio.run(first_then_close()) == "data: 1\n\n"
    assert job.closed == 1
