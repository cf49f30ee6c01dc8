"""The server's ASGI middleware: the API key check and the response counter. Pure ASGI
(no ``BaseHTTPMiddleware``), so streamed responses pass through untouched."""

from __future__ import annotations

from jaxpage.server.errors import error_response


class APIKeyMiddleware:
    """Pure ASGI middleware: ``/v1`` routes need ``Authorization: Bearer <key>`` (401)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization") != self.expected:
                response = error_response(401, "invalid or missing API key", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CountResponsesMiddleware:
    """Pure ASGI middleware: counts every HTTP response in ``jaxpage:http_requests`` by
    route and status (401s from the key check included; unknown paths count as ``other``
    so that a scanner cannot grow the label set)."""

    def __init__(self, app, counter, routes: set[str]) -> None:
        self.app = app
        self.counter = counter
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counted_send(message):
            if message["type"] == "http.response.start":
                self.counter.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted_send)
