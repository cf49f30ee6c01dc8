"""``jaxpage proxy``: one OpenAI-compatible front for prefill and decode instances.

For each completion or chat request the proxy

1. sends it to a prefill instance (the least loaded, unless one recently took the same
   prompt prefix: ``proxy.routing``) with ``max_tokens=1``, ``stream=false``
   and ``kv_transfer_params={"do_remote_decode": true}``: that instance runs the prompt,
   samples the first token and answers with a ticket for the prompt's KV pages;
2. sends the original request plus the ticket to a decode instance (chosen the same way,
   by the prompt's token blocks: one that holds the prefix shares it), which
   pulls the pages (one transfer, ``jax.experimental.transfer``) and decodes the rest;
3. streams the decode instance's answer back unchanged.

Requests that gain nothing from the split go to a prefill instance whole (it serves them
colocated): ``max_tokens=1``, ``n > 1``, log-probabilities (the decode instance has none
for the first token), ``echo``. A request the first token finishes (a stop token or
string) is answered from the prefill instance's result. Errors of an instance (400s)
pass through unchanged; an instance that cannot be reached, or a transfer that fails, is a
503 with an OpenAI error body; a decode instance that is full (503) is retried with a fresh
prefill a few times, then the 503 and its ``Retry-After`` reach the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prometheus_client import CONTENT_TYPE_LATEST

from jaxpage.server.errors import error_response
from jaxpage.server.proxy.metrics import gather_metrics
from jaxpage.server.proxy.routing import MAX_IMBALANCE, InstancePool, prefix_keys, prompt_keys

DECODE_ATTEMPTS = 3        # prefill + decode rounds before a full decode instance's 503 is final
RETRY_AFTER_S = 1.0


def _answer(response: httpx.Response) -> Response:
    """An instance's (error) answer, passed through."""
    headers = {k: v for k, v in response.headers.items()
               if k.lower() in ("retry-after", "content-type", "x-kv-pulled")}
    return Response(response.content, status_code=response.status_code, headers=headers)


def _unavailable(role: str, url: str, error: Exception) -> Response:
    return error_response(503, f"the {role} instance {url} is unavailable: "
                               f"{type(error).__name__}: {error}",
                          headers={"Retry-After": str(int(RETRY_AFTER_S))})


def _as_events(route: str, data: dict, include_usage: bool) -> AsyncIterator[bytes]:
    """A whole (non-streamed) answer as the server-sent events a streamed one would be."""
    async def events():
        base = {k: data[k] for k in ("id", "created", "model") if k in data}
        for choice in data.get("choices", []):
            if route.endswith("chat/completions"):
                message = choice.get("message") or {}
                delta = {"role": "assistant", "content": message.get("content") or ""}
                chunk = {"index": choice["index"], "delta": delta, "logprobs": None,
                         "finish_reason": choice.get("finish_reason")}
                obj = "chat.completion.chunk"
            else:
                chunk = {"index": choice["index"], "text": choice.get("text", ""),
                         "logprobs": choice.get("logprobs"),
                         "finish_reason": choice.get("finish_reason")}
                obj = "text_completion"
            yield f"data: {json.dumps(dict(base, object=obj, choices=[chunk]))}\n\n".encode()
        if include_usage:
            obj = "chat.completion.chunk" if route.endswith("chat/completions") else "text_completion"
            yield (f"data: {json.dumps(dict(base, object=obj, choices=[], usage=data.get('usage')))}"
                   "\n\n").encode()
        yield b"data: [DONE]\n\n"
    return events()


def _whole_on_prefill(body: dict) -> bool:
    """Requests a prefill instance serves entirely (see the module docstring)."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    logprobs = body.get("logprobs")  # completions: 0 asks for the sampled token's
    return (body.get("n", 1) != 1 or limit == 1 or (logprobs is not None and logprobs is not False)
            or body.get("top_logprobs") is not None or bool(body.get("echo"))
            or "kv_transfer_params" in body)


def _ticket_keys(ticket: dict, body: dict) -> list[bytes]:
    """Prefix keys of a prefilled request: its prompt token ids in the instances' blocks."""
    try:
        block_size = int(ticket["shape"][2])
        ids = list(ticket["prompt_token_ids"])
    except (KeyError, IndexError, TypeError, ValueError):
        return []
    return prefix_keys(ids, block_size, str(body.get("model", ""))) if block_size > 0 else []


def build_proxy_app(prefill: list[str], decode: list[str], *, timeout_s: float = 600.0,
                    max_imbalance: int = MAX_IMBALANCE) -> FastAPI:
    """The proxy's app; ``max_imbalance``: requests in flight an instance that holds a
    request's prefix may be ahead of the least loaded one and still get it
    (``proxy.routing``)."""
    prefills = InstancePool(prefill, max_imbalance=max_imbalance)
    decodes = InstancePool(decode, max_imbalance=max_imbalance)
    # Idle connections are dropped before uvicorn's own 5 s keep-alive ends, so a request
    # is rarely sent on a connection the instance is closing (see ``send``).
    client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(
        max_connections=512, keepalive_expiry=2.0))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()

    app = FastAPI(title="jaxpage proxy", lifespan=lifespan)
    app.state.instance_pools = {"prefill": prefills, "decode": decodes}  # loads and affinity

    def forward_headers(request: Request) -> dict:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    async def send(pool: InstancePool, url: str, route: str, body: dict, headers: dict,
                   stream: bool) -> httpx.Response:
        pool.in_flight[url] += 1
        try:
            request = client.build_request("POST", url + route, json=body, headers=headers)
            try:
                try:
                    return await client.send(request, stream=stream)
                except (httpx.RemoteProtocolError, httpx.ReadError):
                    # The instance closed (or reset) a kept-alive connection as we sent on
                    # it: send once more on a new connection. At worst an instance runs the
                    # request twice and drops the first answer (its pages are offered but
                    # never pulled).
                    request = client.build_request("POST", url + route, json=body,
                                                   headers=headers)
                    return await client.send(request, stream=stream)
            except (AttributeError, OSError) as error:
                # A socket closed while it connected (an instance killed at that moment)
                # can surface from httpcore's anyio backend as an AttributeError ("'NoneType'
                # object has no attribute 'getpeername'"): the instance is unreachable,
                # which the callers answer with a 503, as for any transport error.
                raise httpx.ConnectError(f"connecting to {url} failed: {error!r}",
                                         request=request) from error
        finally:
            if not stream:
                pool.in_flight[url] -= 1

    def relay(pool: InstancePool, url: str, response: httpx.Response) -> StreamingResponse:
        """Stream an instance's answer; closing it (a client that left) closes ours."""
        async def body() -> AsyncIterator[bytes]:
            try:
                async for piece in response.aiter_raw():
                    yield piece
            finally:
                await response.aclose()
                pool.in_flight[url] -= 1
        return StreamingResponse(body(), status_code=response.status_code,
                                 media_type=response.headers.get("content-type"))

    async def whole(pool: InstancePool, url: str, route: str, body: dict,
                    headers: dict) -> Response:
        try:
            response = await send(pool, url, route, body, headers, stream=True)
        except httpx.HTTPError as error:
            pool.in_flight[url] -= 1
            return _unavailable("prefill" if pool is prefills else "decode", url, error)
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            pool.in_flight[url] -= 1
            return _answer(response)
        return relay(pool, url, response)

    async def generate(route: str, request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        headers = forward_headers(request)
        if _whole_on_prefill(body):
            return await whole(prefills, prefills.pick(prompt_keys(body)), route, body, headers)
        first = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
        first.update(max_tokens=1, stream=False, min_tokens=min(body.get("min_tokens") or 0, 1),
                     kv_transfer_params={"do_remote_decode": True})
        keys = prompt_keys(body)
        full: set[str] = set()  # decode instances that answered "full" to this request
        for attempt in range(DECODE_ATTEMPTS):
            url = prefills.pick(keys)
            try:
                answer = await send(prefills, url, route, first, headers, stream=False)
            except httpx.HTTPError as error:
                return _unavailable("prefill", url, error)
            if answer.status_code != 200:
                return _answer(answer)
            data = answer.json()
            ticket = data.pop("kv_transfer_params", None)
            if ticket is None:  # finished at its first token
                if body.get("stream"):
                    usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    return StreamingResponse(_as_events(route, data, usage),
                                             media_type="text/event-stream")
                return JSONResponse(data)
            response = None
            decode_url = decodes.pick(_ticket_keys(ticket, body), avoid=full)
            try:
                response = await whole(decodes, decode_url, route,
                                       dict(body, kv_transfer_params=ticket), headers)
            finally:
                # The decode instance answers once it has the pages (200) or has failed;
                # a failure says whether it pulled them first (X-KV-Pulled). Pages nobody
                # took are released by the prefill instance. Left unsettled (this handler
                # cancelled mid-way), they are released when they expire there.
                if response is not None:
                    settle(url, ticket, headers=headers, pulled=response.status_code == 200
                           or response.headers.get("x-kv-pulled") == "true")
            if response.status_code != 503 or "retry-after" not in response.headers \
                    or attempt == DECODE_ATTEMPTS - 1:
                return response
            full.add(decode_url)  # a full decode instance: try another, or again later
            await asyncio.sleep(RETRY_AFTER_S)
        return response

    settling: set[asyncio.Task] = set()

    def settle(url: str, ticket: dict, *, pulled: bool, headers: dict) -> None:
        """Tell prefill instance ``url`` how its ticket's pull ended (in the background)."""
        async def post() -> None:
            with contextlib.suppress(httpx.HTTPError):
                await client.post(url + "/kv_transfer/settle", headers=headers,
                                  json={"uuid": ticket.get("uuid"), "pulled": pulled})
        task = asyncio.get_running_loop().create_task(post())
        settling.add(task)
        task.add_done_callback(settling.discard)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate("/v1/chat/completions", request)

    async def get(url: str, path: str, headers: dict) -> Response:
        try:
            return _answer(await client.get(url + path, headers=headers))
        except httpx.HTTPError as error:
            return _unavailable("decode", url, error)

    @app.get("/v1/models")
    async def models(request: Request):
        return await get(decodes.pick(), "/v1/models", forward_headers(request))

    @app.get("/metrics")
    async def metrics(request: Request):
        instances = [("prefill", url) for url in prefills.in_flight] + \
            [("decode", url) for url in decodes.in_flight]
        routed = {"prefill": prefills.num_affinity_routed, "decode": decodes.num_affinity_routed}
        text = await gather_metrics(client, instances, forward_headers(request), routed)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        down = []
        for url in list(prefills.in_flight) + list(decodes.in_flight):
            try:
                if (await client.get(url + "/health", timeout=5)).status_code != 200:
                    down.append(url)
            except httpx.HTTPError:
                down.append(url)
        if down:
            return error_response(503, f"instances down: {down}")
        return {"status": "ok", "time": time.time()}

    return app
