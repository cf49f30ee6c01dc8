"""`jaxpage serve --help` documents every option; the embedded SmolLM2 answers over HTTP."""

from __future__ import annotations

import openai
import pytest

from jaxpage.cli import ENGINE_FLAGS, build_parser
from tests.server.conftest import start_server


def test_serve_help_lists_every_option():
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    for flag in ["--host", "--port", "--api-key", "--served-model-name", "--config",
                 "--tokenizer", *("--" + name.replace("_", "-") for name in ENGINE_FLAGS)]:
        assert flag in text, flag
    args = parser.parse_args(["serve", "--port", "9000", "--max-waiting-requests", "4",
                              "--enable-prefix-caching", "false"])
    assert args.model is None and args.port == 9000 and args.max_waiting_requests == 4
    assert args.enable_prefix_caching is False
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--enable-prefix-caching", "maybe"])


@pytest.mark.slow
def test_default_model_chat_over_http():
    info, server = start_server(None, api_key=None, name="SmolLM2-135M-Instruct",
                                max_model_len=512, num_kv_blocks=128)
    try:
        client = openai.OpenAI(base_url=info.url + "/v1", api_key="none", max_retries=0,
                               timeout=300)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert reply.choices[0].message.content == "The capital of France is Paris."
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=16, stream=True,
            messages=[{"role": "user", "content": "What is the capital of France?"}]))
        assert streamed == reply.choices[0].message.content
    finally:
        server.stop()
        info.engine.shutdown()
