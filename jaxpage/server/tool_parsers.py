"""Tool calls in free model output, for ``tool_choice: "auto"`` (``jaxpage serve
--enable-auto-tool-choice --tool-call-parser NAME``, vLLM's flags).

A parser splits a chat completion's text into plain ``content`` and OpenAI ``tool_calls``
(``{"id", "type": "function", "function": {"name", "arguments"}}``, arguments a JSON
string). Formats, by parser name:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more
  (Qwen2 / Qwen2.5 / Qwen3 and Hermes chat templates);
* ``llama3_json``: a JSON object ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``) as the whole reply, optionally after ``<|python_tag|>``, several
  separated by ``;`` (Llama 3.1 / 3.2 / 3.3);
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``.

A reply with no call stays plain content; text before a call stays content; the markup
of a call never reaches ``content``. Text that starts a call but does not parse as one is
returned as content unchanged (the model did not make a valid call).

Streaming (``StreamingToolCalls``): content is released as it comes, except a tail that
could still be the start of a call marker; once a marker is seen, nothing more is
content until the call can be parsed, and each call goes out as one delta holding its
id, name and full arguments (OpenAI's delta format, which clients accumulate).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

# Markup tokens the parsers read; the request must keep them in the text
# (``skip_special_tokens=False`` for parsers whose markers are special tokens).
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TAG = "[TOOL_CALLS]"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(name: Any, arguments: Any) -> dict | None:
    """An OpenAI tool call, or None when ``name`` / ``arguments`` are not a call's."""
    if not isinstance(name, str) or not name:
        return None
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # some models emit the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value of ``text``, back to back (separated by whitespace or ``;``), or
    None when any part is not JSON."""
    decoder = json.JSONDecoder()
    values, position = [], 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
        if position == len(text):
            return values
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        values.append(value)


class ToolParser:
    """One format: ``parse`` a complete reply, ``marker`` starts a call in a stream."""

    name = ""
    markers: tuple[str, ...] = ()  # text that starts a call
    needs_special_tokens = False   # its markers are special tokens: keep them in the text

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a complete reply; no call: (text, [])."""
        raise NotImplementedError

    def call_start(self, text: str) -> int:
        """Where the first call starts in ``text`` (-1: nowhere yet)."""
        found = [text.find(m) for m in self.markers if m in text]
        return min(found) if found else -1


class HermesParser(ToolParser):
    name = "hermes"
    markers = (_HERMES_OPEN,)

    _CALL = re.compile(re.escape(_HERMES_OPEN) + r"(.*?)(?:" + re.escape(_HERMES_CLOSE) + r"|$)",
                       re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        start = text.find(_HERMES_OPEN)
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            value = _json_values(body.strip())
            if not value or len(value) != 1 or not isinstance(value[0], dict):
                return text, []
            call = _call(value[0].get("name"), value[0].get("arguments",
                                                               value[0].get("parameters")))
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].strip()
        return (content or None), calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (_PYTHON_TAG, "{")
    needs_special_tokens = True

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(_PYTHON_TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)  # only a reply that *is* a call
        return -1

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        body = text.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG):]
        if not body.startswith("{"):
            return text, []
        values = _json_values(body)
        if not values or not all(isinstance(v, dict) for v in values):
            return text, []
        calls = [_call(v.get("name"), v.get("parameters", v.get("arguments"))) for v in values]
        if any(call is None for call in calls):
            return text, []
        return None, calls


class MistralParser(ToolParser):
    name = "mistral"
    markers = (_MISTRAL_TAG,)
    needs_special_tokens = True

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        start = text.find(_MISTRAL_TAG)
        if start < 0:
            return text, []
        calls = []
        for part in text[start:].split(_MISTRAL_TAG)[1:]:  # one array per tag
            values = _json_values(part.strip())
            if not values:
                return text, []
            for value in values:
                for item in value if isinstance(value, list) else [value]:
                    call = _call(item.get("name"), item.get("arguments")) \
                        if isinstance(item, dict) else None
                    if call is None:
                        return text, []
                    calls.append(call)
        content = text[:start].strip()
        return (content or None), calls


PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str) -> ToolParser:
    """The parser called ``name``; a ValueError listing the known ones otherwise."""
    parser = PARSERS.get(name)
    if parser is None:
        raise ValueError(f"tool_call_parser={name!r} is not supported; choose one of "
                         f"{sorted(PARSERS)}")
    return parser()


@dataclass
class StreamingToolCalls:
    """A reply parsed as it streams (see the module docstring): ``feed`` each text delta,
    then ``finish``; each returns (content delta, new complete tool calls)."""

    parser: ToolParser
    text: str = ""
    released: int = 0          # characters of ``text`` sent as content
    calls_sent: int = 0
    in_call: bool = False
    emitted: int = 0           # calls handed out by ``delta``

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        if not self.in_call:
            start = self.parser.call_start(self.text)
            if start >= 0:
                self.in_call = True
                content = self.text[self.released:start].rstrip() if start > self.released \
                    else ""
                self.released = start
                return content, self._complete_calls(final=False)
            # hold back a tail that could be the start of a marker
            hold = max((self._partial(marker) for marker in self.parser.markers), default=0)
            end = len(self.text) - hold
            if isinstance(self.parser, Llama3JsonParser) and not self.text.strip():
                end = self.released  # a reply that may yet start with a call
            content = self.text[self.released:end]
            self.released = max(self.released, end)
            return content, []
        return "", self._complete_calls(final=False)

    def delta(self, text: str, finished: bool) -> dict:
        """An OpenAI chat delta for ``text`` (and, when ``finished``, the rest): ``content``
        and / or ``tool_calls`` entries numbered across the stream; {} when nothing can
        be released yet."""
        content, calls = self.feed(text)
        if finished:
            more, last = self.finish()
            content, calls = content + more, calls + last
        out: dict = {"content": content} if content else {}
        if calls:
            out["tool_calls"] = [{"index": self.emitted + i, **call}
                                 for i, call in enumerate(calls)]
            self.emitted += len(calls)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        if not self.in_call:
            content = self.text[self.released:]
            self.released = len(self.text)
            return content, []
        held = self.text[self.released:]
        if self.calls_sent:  # hermes calls already sent: only what follows them is left
            cut = 0
            for _ in range(self.calls_sent):
                cut = held.index(_HERMES_CLOSE, cut) + len(_HERMES_CLOSE)
            held = held[cut:]
            if self.parser.call_start(held) < 0:
                return held.strip(), []
        content, calls = self.parser.parse(held)
        if not calls:  # not a call after all: what was held is content
            return held, []
        return "", calls

    def _complete_calls(self, final: bool) -> list[dict]:
        """Calls complete so far, once the held text parses (hermes: each closed tag)."""
        held = self.text[self.released:]
        if isinstance(self.parser, HermesParser):
            closed = held.count(_HERMES_CLOSE)
            if closed > self.calls_sent:
                cut = 0
                for _ in range(closed):
                    cut = held.index(_HERMES_CLOSE, cut) + len(_HERMES_CLOSE)
                _, calls = self.parser.parse(held[:cut])
                new = calls[self.calls_sent:]
                self.calls_sent = len(calls)
                return new
        return []

    def _partial(self, marker: str) -> int:
        """Length of the longest tail of ``text`` (past what was released) that is a
        proper prefix of ``marker``."""
        tail = self.text[self.released:]
        for size in range(min(len(marker) - 1, len(tail)), 0, -1):
            if marker.startswith(tail[-size:]):
                return size
        return 0
