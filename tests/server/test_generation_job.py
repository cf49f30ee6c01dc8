"""GenerationJob records each engine request exactly once, however it ends, over a stand-in
engine (no model, no server): finished, cut off by a client that left (before or after its
first output), closed twice, or closed while the engine is shutting down."""

from __future__ import annotations

import asyncio
import types

import pytest

from jaxpage.engine.async_llm_engine import EngineDeadError
from jaxpage.outputs import CompletionOutput, RequestOutput
from jaxpage.sampling_params import SamplingParams
from jaxpage.server.metrics import ServerMetrics
from jaxpage.server.serving import GenerationJob


class FakeStream:
    """Plays back a fixed list of outputs, like RequestStream (``finished`` at the end)."""

    def __init__(self, request_id: str, outputs: list[RequestOutput]) -> None:
        self.request_id = request_id
        self.request = types.SimpleNamespace(num_prompt_tokens=3)
        self.outputs = list(outputs)
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or not self.outputs:
            self.finished = True
            raise StopAsyncIteration
        return self.outputs.pop(0)


class FakeEngine:
    def __init__(self, outputs: list[RequestOutput], *, dead: bool = False) -> None:
        self.outputs = outputs
        self.dead = dead
        self.aborted: list[str] = []

    async def add_request(self, prompt, params, validate=None) -> FakeStream:
        return FakeStream("r0", self.outputs)

    def abort(self, request_id: str) -> None:
        if self.dead:
            raise EngineDeadError("the engine has been shut down")
        self.aborted.append(request_id)


def output(tokens: list[int], reason: str | None) -> RequestOutput:
    return RequestOutput("r0", None, [1, 2, 3], [CompletionOutput(
        0, "x" * len(tokens), tokens, finish_reason=reason)], finished=reason is not None)


def counts(metrics: ServerMetrics) -> dict[str, float]:
    """request_success_total by finished_reason, plus the e2e histogram's count."""
    found = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "jaxpage:request_success_total":
                found[sample.labels["finished_reason"]] = sample.value
            elif sample.name == "jaxpage:e2e_request_latency_seconds_count":
                found["e2e"] = sample.value
    return found


def run_job(engine: FakeEngine, steps: int | None) -> tuple[GenerationJob, ServerMetrics]:
    """Start a job, consume ``steps`` events (None: all), then close it twice."""
    metrics = ServerMetrics("m", dict)

    async def go() -> GenerationJob:
        job = GenerationJob(engine, metrics, 1)
        await job.start(["p"], SamplingParams(max_tokens=4))
        events = job.events()
        try:
            taken = 0
            while steps is None or taken < steps:
                try:
                    await events.__anext__()
                except StopAsyncIteration:
                    break
                taken += 1
        finally:
            await events.aclose()
            job.close()
            job.close()
        return job

    return asyncio.run(go()), metrics


def test_finished_request_is_recorded_with_its_reason_once():
    engine = FakeEngine([output([5], None), output([6, 7], "length")])
    job, metrics = run_job(engine, None)
    assert counts(metrics) == {"length": 1.0, "e2e": 1.0}
    assert engine.aborted == []
    assert job.choices[0].token_ids == [5, 6, 7]


@pytest.mark.parametrize("steps", [0, 1])
def test_client_that_left_is_recorded_as_abort_once(steps):
    engine = FakeEngine([output([5], None), output([6], None), output([7], "length")])
    _, metrics = run_job(engine, steps)
    assert counts(metrics) == {"abort": 1.0, "e2e": 1.0}
    assert engine.aborted == ["r0"]


def test_close_while_the_engine_shuts_down_still_records():
    engine = FakeEngine([output([5], None), output([6], "length")], dead=True)
    _, metrics = run_job(engine, 1)
    assert counts(metrics) == {"abort": 1.0, "e2e": 1.0}
