"""Run the app with uvicorn: in the foreground (``jaxpage serve``) or on a thread (tests)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import uvicorn

from jaxpage.engine.async_llm_engine import AsyncLLMEngine
from jaxpage.server.api_server import build_app

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_served_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    return model.rstrip("/") if not os.path.exists(model) else os.path.basename(model.rstrip("/"))


def make_server(model: str | None = None, *, served_model_name: str | None = None,
                api_key: str | None = None, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                lora_modules: dict[str, str] | None = None, chat_template: str | None = None,
                tool_parser: str | None = None,
                **engine_options: Any) -> tuple[uvicorn.Server, AsyncLLMEngine]:
    """Load the engine and build a uvicorn server for it (not started); ``lora_modules``:
    adapter name -> PEFT directory, each served as a model of that name; ``chat_template``
    and ``tool_parser``: ``build_app``'s."""
    engine = AsyncLLMEngine.from_options(model, **engine_options)
    try:
        app = build_app(engine, served_model_name=served_model_name or default_served_name(model),
                        api_key=api_key, lora_modules=lora_modules,
                        chat_template=chat_template, tool_parser=tool_parser)
    except BaseException:
        engine.shutdown()
        raise
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config), engine


def serve(model: str | None = None, **kwargs: Any) -> None:
    """Serve until interrupted (Ctrl-C), then stop the engine."""
    server, engine = make_server(model, **kwargs)
    try:
        server.run()
    finally:
        engine.shutdown()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class BackgroundServer:
    """A uvicorn server on a thread, for tests and notebooks: ``start()``, ``stop()``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host, self.port = host, port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port,
                                                    log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
