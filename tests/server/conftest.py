"""One real uvicorn server per module on a free loopback port, over the tiny Llama.

``reference(fn)`` runs ``fn(llm)`` on the engine thread while the server is idle, so the
expected outputs come from ``LLM.generate`` on the very same engine (no second compile).
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxpage import LLM
from jaxpage.engine.async_llm_engine import AsyncLLMEngine
from jaxpage.server.api_server import build_app
from jaxpage.server.launch import BackgroundServer
from tests.options import FEW_BUCKETS

API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
OPTIONS = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128, block_size=8,
               num_kv_blocks=256, **FEW_BUCKETS)


@dataclasses.dataclass
class Served:
    url: str
    llm: LLM
    engine: AsyncLLMEngine

    def reference(self, fn):
        """fn(llm) run on the engine thread (call only while no HTTP request is in flight)."""
        return self.engine.submit(lambda: fn(self.llm)).result(300)

    def stats(self) -> dict:
        return self.engine.submit(self.llm.get_stats).result(60)


def start_server(model: str, *, api_key: str | None = API_KEY, name: str = MODEL_NAME,
                 lora_modules: dict[str, str] | None = None, tool_parser: str | None = None,
                 chat_template: str | None = None,
                 **options) -> tuple[Served, BackgroundServer]:
    llm = LLM(model, **{**OPTIONS, **options})
    engine = AsyncLLMEngine(llm.llm_engine)
    server = BackgroundServer(build_app(engine, served_model_name=name, api_key=api_key,
                                        lora_modules=lora_modules, tool_parser=tool_parser,
                                        chat_template=chat_template)).start()
    return Served(server.url, llm, engine), server


@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    info, server = start_server(tiny_checkpoints["llama"])
    yield info
    server.stop()
    info.engine.shutdown()
