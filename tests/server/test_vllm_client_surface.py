"""The parts of the OpenAI / vLLM surface that applications send by default, through the
``openai`` client over real HTTP: ``tools`` with ``tool_choice: "auto"`` (parsed by the
server's ``--tool-call-parser``, whole and streamed), the fields that cannot change the
tokens, ``logit_bias``, ``chat_template_kwargs``, ``GET /version`` and ``/ping``."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError, OpenAI

from tests.server.conftest import API_KEY, MODEL_NAME, start_server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The model's reply is forced to a Hermes-style call (a tiny random model would not write
# one by itself): the parser, not the grammar, turns it into tool_calls.
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FORCE_CALL = {"structured_outputs": {"regex": "Checking\\. " + CALL.replace("{", "\\{")
                                     .replace("}", "\\}")}}


@pytest.fixture(scope="module")
def hermes(tiny_checkpoints):
    info, server = start_server(tiny_checkpoints["llama"], tool_parser="hermes")
    yield info
    server.stop()
    info.engine.shutdown()


def _client(url):
    return OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)


def test_auto_tool_choice_returns_tool_calls(hermes):
    reply = _client(hermes.url).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=60,
        temperature=0, extra_body=FORCE_CALL)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_tool_choice_streams_tool_call_deltas(hermes):
    stream = _client(hermes.url).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0,
        stream=True, extra_body=FORCE_CALL)
    content, calls, reasons = "", {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert content.strip() == "Checking."
    assert "<tool_call>" not in content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"})]
    assert reasons[-1] == "tool_calls"


def test_a_reply_without_a_call_stays_content(hermes):
    reply = _client(hermes.url).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=8,
        temperature=0, extra_body={"structured_outputs": {"choice": ["It is sunny."]}})
    assert reply.choices[0].message.content == "It is sunny."
    assert not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"


def test_a_tool_result_goes_back_through_the_template(hermes):
    reply = _client(hermes.url).chat.completions.create(
        model=MODEL_NAME, max_tokens=4, temperature=0, tools=TOOLS, messages=[
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}])
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_auto_without_a_parser_is_a_400_naming_the_flags(served):
    with pytest.raises(BadRequestError, match="--tool-call-parser"):
        _client(served.url).chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=4)


def test_fields_that_cannot_change_the_tokens_are_accepted(served):
    client = _client(served.url)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                           temperature=0)
    extra = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0, user="u1",
        metadata={"trace": "abc"}, store=False, service_tier="auto", parallel_tool_calls=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert extra.choices[0].message.content == plain.choices[0].message.content
    forced = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                            temperature=0, logit_bias={"1234": 100})
    assert forced.choices[0].message.content == served.reference(
        lambda llm: llm.get_tokenizer().decode([1234] * 4, skip_special_tokens=True))
    with pytest.raises(BadRequestError, match="logit_bias"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                       logit_bias={"5": 101})
    with pytest.raises(BadRequestError, match="logit_bias"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                       logit_bias={"five": 1})
    with pytest.raises(BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                       extra_body={"chat_template_kwargs": {"tools": []}})


def test_version_and_ping(served):
    version = httpx.get(served.url + "/version", timeout=30)
    assert version.status_code == 200 and version.json()["version"]
    assert httpx.get(served.url + "/ping", timeout=30).status_code == 200
    assert httpx.post(served.url + "/ping", timeout=30).status_code == 200
