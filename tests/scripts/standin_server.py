"""A tiny OpenAI-compatible streaming server for testing bench_serving.py.

``/v1/completions`` streams ``max_tokens`` text chunks (SSE), the first after ``ttft_s``
and then one every ``itl_s``, ends with a ``usage`` chunk and ``[DONE]``; it records the
latencies it served in Prometheus histograms named as vLLM names them, on ``/metrics``.
Requests carrying ``"fail": true`` in the prompt ids (a negative id) get HTTP 400.
"""

import asyncio
import json
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest

FIRST_TOKEN_S = 0.03
ITL_S = 0.004


def make_app(ttft_s: float = FIRST_TOKEN_S, itl_s: float = ITL_S):

    registry = CollectorRegistry()
    buckets = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
    ttft = Histogram("standin:time_to_first_token_seconds", "TTFT", registry=registry,
                     buckets=buckets)
    e2e = Histogram("standin:e2e_request_latency_seconds", "E2E", registry=registry,
                    buckets=buckets)
    tpot = Histogram("standin:time_per_output_token_seconds", "TPOT", registry=registry,
                     buckets=buckets)
    app = FastAPI()
    app.state.bodies = []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "standin-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode())

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        prompt = body["prompt"]
        if isinstance(prompt, list) and any(t < 0 for t in prompt):
            return JSONResponse({"error": {"message": "prompt has a negative token id",
                                           "type": "invalid_request_error"}}, status_code=400)
        n = int(body["max_tokens"])
        arrived = time.perf_counter()

        async def events():
            await asyncio.sleep(ttft_s)
            first = time.perf_counter()
            ttft.observe(first - arrived)
            for i in range(n):
                if i:
                    await asyncio.sleep(itl_s)
                chunk = {"id": "c", "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            done = time.perf_counter()
            e2e.observe(done - arrived)
            if n > 1:
                tpot.observe((done - first) / (n - 1))
            usage = {"id": "c", "object": "text_completion", "model": body["model"],
                     "choices": [], "usage": {"prompt_tokens": len(prompt),
                                              "completion_tokens": n,
                                              "total_tokens": len(prompt) + n}}
            yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class ServerThread:
    """uvicorn serving ``app`` on a free loopback port in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("stand-in server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
