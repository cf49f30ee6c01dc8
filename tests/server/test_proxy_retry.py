"""The proxy facing a full decode instance (503 with ``Retry-After``): it runs the prefill
again and tries another decode instance while one remains, passes the 503 on after its
last attempt, and settles every ticket with the prefill instance (pulled or not). The
instances here are small HTTP apps that answer as real ones do; the proxy is real."""

from __future__ import annotations

import itertools
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from jaxpage.server.launch import BackgroundServer
from jaxpage.server.proxy.app import DECODE_ATTEMPTS, RETRY_AFTER_S, build_proxy_app


def _prefill_app(settled: list) -> FastAPI:
    app, ids = FastAPI(), itertools.count(1)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        assert body["max_tokens"] == 1 and body["kv_transfer_params"] == {"do_remote_decode": True}
        ticket = {"address": "127.0.0.1:1", "uuid": next(ids), "shape": [2, 1, 8, 1, 4],
                  "dtype": "float32", "num_blocks": 1, "kv_shards": 1,
                  "prompt_token_ids": list(range(20)), "output_token_ids": [7]}
        return {"id": "cmpl-p", "object": "text_completion", "model": "m",
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "kv_transfer_params": ticket}

    @app.post("/kv_transfer/settle")
    async def settle(request: Request):
        settled.append(await request.json())
        return {"settled": True}

    return app


def _decode_app(full: bool | int, seen: list) -> FastAPI:
    """A decode instance that answers "full" to every request (``full=True``), to none
    (``False``), or to its first ``full`` requests (an int: a seat frees after them)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen.append((await request.json())["kv_transfer_params"]["uuid"])
        if full is True or (full is not False and len(seen) <= full):
            return JSONResponse({"error": {"message": "the host pool is full", "type":
                                           "ServiceUnavailableError", "param": None,
                                           "code": 503}},
                                status_code=503, headers={"Retry-After": "1",
                                                          "X-KV-Pulled": "false"})
        return {"id": "cmpl-d", "object": "text_completion", "model": "m",
                "choices": [{"index": 0, "text": "decoded", "finish_reason": "length"}]}

    return app


@pytest.fixture
def servers():
    started = []

    def start(app):
        server = BackgroundServer(app).start()
        started.append(server)
        return server.url

    yield start
    for server in reversed(started):
        server.stop()


def _settled(settled: list, count: int) -> dict:
    """uuid -> pulled, once ``count`` tickets were settled (posted in the background)."""
    for _ in range(100):
        if len(settled) >= count:
            break
        time.sleep(0.05)
    return {entry["uuid"]: entry["pulled"] for entry in settled}


def test_a_full_decode_instance_is_left_for_another(servers):
    settled, seen_full, seen_ok = [], [], []
    prefill = servers(_prefill_app(settled))
    full, ok = servers(_decode_app(True, seen_full)), servers(_decode_app(False, seen_ok))
    proxy = servers(build_proxy_app([prefill], [full, ok]))
    r = httpx.post(proxy + "/v1/completions", timeout=30,
                   json={"model": "m", "prompt": "hello", "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    assert seen_full == [1] and seen_ok == [2]  # the second prefill's ticket went elsewhere
    assert _settled(settled, 2) == {1: False, 2: True}


def test_the_only_decode_instance_is_waited_for_and_serves_once_it_has_room(servers):
    """One decode instance, full for its first DECODE_ATTEMPTS - 1 answers: the proxy
    waits Retry-After between rounds, prefills again and the last round is served."""
    settled, seen = [], []
    prefill = servers(_prefill_app(settled))
    decode = servers(_decode_app(DECODE_ATTEMPTS - 1, seen))
    proxy = servers(build_proxy_app([prefill], [decode]))
    began = time.monotonic()
    r = httpx.post(proxy + "/v1/completions", timeout=60,
                   json={"model": "m", "prompt": "hello", "max_tokens": 8})
    elapsed = time.monotonic() - began
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    assert seen == list(range(1, DECODE_ATTEMPTS + 1))
    assert elapsed >= (DECODE_ATTEMPTS - 1) * RETRY_AFTER_S  # it waited between rounds
    assert _settled(settled, DECODE_ATTEMPTS) == {
        i: i == DECODE_ATTEMPTS for i in range(1, DECODE_ATTEMPTS + 1)}


def test_the_503_reaches_the_client_after_the_last_attempt(servers):
    settled, seen = [], []
    prefill = servers(_prefill_app(settled))
    full = servers(_decode_app(True, seen))
    proxy = servers(build_proxy_app([prefill], [full]))
    r = httpx.post(proxy + "/v1/completions", timeout=60,
                   json={"model": "m", "prompt": "hello", "max_tokens": 8})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    assert seen == list(range(1, DECODE_ATTEMPTS + 1))  # a fresh prefill each attempt
    assert _settled(settled, DECODE_ATTEMPTS) == {i: False for i in range(1, DECODE_ATTEMPTS + 1)}
