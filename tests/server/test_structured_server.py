"""Structured outputs over real HTTP (the tiny random Llama, whose free text is gibberish):
OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*`` fields, forced
tool calls through the official ``openai`` client, bad specs as 400s, and 32 constrained
requests with different schemas at once beside free ones."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from jaxpage import SamplingParams
from tests.server.conftest import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}

# Short, closed schemas: a random model finishes them well within max_tokens.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "level": {"enum": ["low", "mid", "high"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "level", "n"]}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"]}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(served, route, body):
    return httpx.post(served.url + route, headers=AUTH, json={"model": MODEL_NAME, **body},
                      timeout=120)


def test_response_format_on_both_routes(served, client):
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Status?"}], max_tokens=60,
        temperature=0.9, seed=4,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "status", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    r = post(served, "/v1/completions", {"prompt": "Status:", "max_tokens": 60, "n": 3,
                                         "temperature": 1.0, "seed": 1,
                                         "response_format": {"type": "json_schema", "json_schema": {
                                             "name": "status", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)
    r = post(served, "/v1/completions", {"prompt": "Anything:", "max_tokens": 40,
                                         "temperature": 0,
                                         "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("{"), r.text


def test_vllm_fields(served):
    cases = [({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
             ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
             ({"guided_regex": r"[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
             ({"structured_outputs": {"regex": r"id-[a-f]{4}"}}, lambda t: re.fullmatch(r"id-[a-f]{4}", t)),
             ({"guided_json": WEATHER}, lambda t: jsonschema.validate(json.loads(t), WEATHER) is None),
             ({"structured_outputs": {"json": json.dumps(WEATHER), "disable_any_whitespace": True}},
              lambda t: " " not in t.replace(": ", ":").replace(", ", ",")
              and jsonschema.validate(json.loads(t), WEATHER) is None),
             ({"guided_grammar": 'start: "a" ("b" | "c")+ "."', "max_tokens": 200},
              lambda t: re.fullmatch(r"a[bc]+\.", t))]
    for fields, ok in cases:
        body = {"prompt": "Say it:", "max_tokens": 40, "temperature": 1.0, "seed": 7, **fields}
        r = post(served, "/v1/completions", body)
        assert r.status_code == 200, (fields, r.text)
        text = r.json()["choices"][0]["text"]
        assert ok(text), (fields, text)
    chat = post(served, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Pick"}], "max_tokens": 10,
        "guided_choice": ["left", "right"], "guided_decoding_backend": "auto"})
    assert chat.json()["choices"][0]["message"]["content"] in ("left", "right"), chat.text


@pytest.mark.parametrize("fields,param", [
    ({"guided_regex": "a(b"}, None),
    ({"guided_json": {"type": "object", "properties": {"x": {"type": "nope"}}}}, None),
    ({"structured_outputs": {"grammar": "start: ("}}, None),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "nope": 1}}, "structured_outputs"),
])
def test_bad_specs_are_400s(served, fields, param):
    free_before = served.stats()["num_free_blocks"]
    r = post(served, "/v1/completions", {"prompt": "x", "max_tokens": 5, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["message"]
    if param is not None:
        assert param in (error["param"] or "") + error["message"]
    assert served.stats()["num_free_blocks"] == free_before


def test_forced_tool_calls_through_the_openai_client(served, client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "get_status", "parameters": SCHEMA}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    named = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=tools, max_tokens=60, temperature=0.8,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert named.choices[0].message.content is None

    required = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=tools, tool_choice="required",
        max_tokens=150, temperature=0.5, seed=3, parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    schema = {"get_weather": WEATHER, "get_status": SCHEMA}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)

    # The tool's answer goes back in the conversation, as a client's loop sends it.
    follow = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=5, temperature=0, tools=tools, messages=messages + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 3}'}])
    assert follow.choices[0].message.role == "assistant"

    # Streamed: the arguments arrive in pieces under one call id and name.
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=tools, max_tokens=60, temperature=0.8,
        stream=True, tool_choice={"type": "function", "function": {"name": "get_status"}})
    pieces, ids, names = [], set(), set()
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            ids.add(delta_call.id) if delta_call.id else None
            names.add(delta_call.function.name) if delta_call.function.name else None
            pieces.append(delta_call.function.arguments or "")
    assert len(ids) == 1 and names == {"get_status"}
    jsonschema.validate(json.loads("".join(pieces)), SCHEMA)


def test_tool_choice_errors(served):
    tools = [{"type": "function", "function": {"name": "f", "parameters": WEATHER}}]
    r = post(served, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "g"}}})
    assert r.status_code == 400 and "'g'" in r.json()["error"]["message"]
    r = post(served, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def _schema(i: int) -> dict:
    """32 distinct schemas: different keys, enums and bounds."""
    return {"type": "object",
            "properties": {f"k{i}": {"enum": [f"v{i}", f"w{i}", "z"]},
                           "count": {"type": "integer", "minimum": i, "maximum": i + 5},
                           "flag": {"type": "boolean"}},
            "required": [f"k{i}", "count"] + (["flag"] if i % 2 else [])}


def test_32_constrained_requests_at_once_beside_free_ones(served):
    free_prompts = ["The sky", "Once upon", "In 1999", "Numbers:"]
    want = served.reference(lambda llm: [o.outputs[0].text for o in llm.generate(
        free_prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)])

    async def constrained(http, i):
        r = await http.post("/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": f"Item {i}"}],
            "max_tokens": 100, "temperature": 1.0, "seed": i,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": f"s{i}", "schema": _schema(i)}}})
        assert r.status_code == 200, r.text
        return json.loads(r.json()["choices"][0]["message"]["content"])

    async def free(http, prompt):
        r = await http.post("/v1/completions", json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0})
        return r.json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(base_url=served.url, headers=AUTH, timeout=300) as http:
            return await asyncio.gather(*[constrained(http, i) for i in range(32)],
                                        *[free(http, p) for p in free_prompts])

    results = asyncio.run(main())
    for i, value in enumerate(results[:32]):
        jsonschema.validate(value, _schema(i))
    assert results[32:] == want
