"""Tool-call parsers for ``tool_choice: "auto"`` on model outputs in each family's format,
whole and streamed in pieces of every size: calls come out as OpenAI ``tool_calls``, text
before them as content, and no markup ever reaches the content."""

from __future__ import annotations

import json

import pytest

from jaxpage.server.tool_parsers import StreamingToolCalls, get_parser

WEATHER = {"city": "Paris", "unit": "celsius"}

# (parser, reply as the model writes it, content, [(name, arguments)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>', None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check.",
     [("get_weather", WEATHER), ("get_time", {})]),
    ("hermes", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>",
     []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                    '"celsius"}}', None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"unit": "celsius"}}; {"name": "get_time", "parameters": {}}', None,
     [("get_weather", WEATHER), ("get_time", {})]),
    ("llama3_json", "It is sunny in Paris {mostly}.", "It is sunny in Paris {mostly}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                '"unit": "celsius"}}, {"name": "get_time", "arguments": {}}]', None,
     [("get_weather", WEATHER), ("get_time", {})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": '
                '"{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}]', "Sure.",
     [("get_weather", WEATHER)]),
    ("mistral", "No tools needed: 4.", "No tools needed: 4.", []),
]


def _named(calls):
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_a_whole_reply(name, text, content, calls):
    got_content, got_calls = get_parser(name).parse(text)
    assert got_content == content
    assert _named(got_calls) == calls


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_a_streamed_reply(name, text, content, calls, piece):
    stream = StreamingToolCalls(get_parser(name))
    streamed, got = "", []
    for start in range(0, len(text), piece):
        delta, new = stream.feed(text[start:start + piece])
        streamed += delta
        got += new
    delta, new = stream.finish()
    streamed += delta
    got += new
    assert _named(got) == calls
    if calls:
        assert streamed.strip() == (content or "")
        for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name"'):
            assert marker not in streamed
    else:
        assert streamed == text


def test_hermes_calls_stream_as_each_closes():
    stream = StreamingToolCalls(get_parser("hermes"))
    first = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    assert _named(stream.feed(first)[1]) == [("a", {})]
    assert _named(stream.feed('<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>')[1]) \
        == [("b", {"x": 1})]
    assert stream.finish() == ("", [])


def test_unknown_parser():
    with pytest.raises(ValueError, match="tool_call_parser='pythonic'.*hermes"):
        get_parser("pythonic")
