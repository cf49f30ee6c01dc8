"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server can meet has a handler here, so no input produces a bare
traceback: validation problems are 400, a wrong key 401, an unknown model or route 404,
a full queue 503 with ``Retry-After``; anything else is logged and answered as a 500 in
the same shape (a bug, never a crash of the server).
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("jaxpage")

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 413: "RequestTooLargeError",
          415: "UnsupportedMediaTypeError", 503: "ServiceUnavailableError",
          500: "InternalServerError"}


class APIError(Exception):
    """An error with its HTTP status, OpenAI error fields and extra headers."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "APIError"),
                      "param": param, "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


_PARAM = re.compile(r"^(?:SamplingParams\.)?([a-z_]+)=")


def bad_request_from(error: ValueError) -> APIError:
    """A 400 from a ValueError raised by validation; ``param`` names the field when known."""
    message = str(error)
    match = _PARAM.match(message)
    param = match.group(1) if match else ("prompt" if message.startswith("prompt") else None)
    return APIError(400, message, param=param)


def _describe_validation(error: RequestValidationError) -> tuple[str, str | None]:
    problems, param = [], None
    for item in error.errors()[:5]:
        loc = [str(p) for p in item.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        problems.append(f"{where or 'body'}: {item.get('msg', 'invalid')}")
    return "; ".join(problems) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, error: RequestValidationError):
        message, param = _describe_validation(error)
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError):
        return error_response(error.status, error.message, error.param, error.code,
                              error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, error: StarletteHTTPException):
        return error_response(error.status_code, str(error.detail), headers=error.headers)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, error: ValueError):
        bad = bad_request_from(error)
        return error_response(400, bad.message, bad.param)

    @app.exception_handler(Exception)
    async def on_any(request: Request, error: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(error).__name__}")
