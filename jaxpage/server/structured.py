"""Structured outputs over HTTP: the request fields that constrain the output, and tool
calls made by constraining the output to a function's parameters.

Accepted, one at a time (two of them in one request is a 400):

* OpenAI's ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (``"text"`` constrains nothing);
* vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``, ``disable_any_whitespace``) and its older ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar`` fields;
* on chat completions, ``tools`` with ``tool_choice`` naming a function (the output is
  that function's arguments, a JSON object following its ``parameters`` schema) or
  ``"required"`` (a JSON array of ``{"name", "parameters"}`` calls of the listed tools,
  one call when ``parallel_tool_calls`` is false). ``"auto"`` and ``"none"`` constrain
  nothing (jaxpage has no parser for free-form tool calls).

A spec llguidance cannot compile is a 400 too (raised when the request is added).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from jaxpage.sampling_params import StructuredOutputsParams
from jaxpage.server.errors import APIError
from jaxpage.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class ToolCallPlan:
    """How a chat completion's output becomes ``tool_calls``: ``function`` names the one
    forced function (the output is its arguments), or None for ``"required"`` (the
    output is a JSON array of ``{"name", "parameters"}``)."""

    function: str | None


def _spec(param: str, **fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as error:
        raise APIError(400, f"{param}: {error}", param=param) from None


def _from_request_fields(body: CompletionRequest | ChatCompletionRequest
                         ) -> list[tuple[str, StructuredOutputsParams]]:
    found = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", _spec("response_format", json_object=True)))
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format type 'json_schema' needs "
                               "json_schema.schema", param="response_format")
            found.append(("response_format",
                          _spec("response_format", json=fmt.json_schema.schema_)))
    so = body.structured_outputs
    if so is not None:
        found.append(("structured_outputs", _spec(
            "structured_outputs", json=so.json_, regex=so.regex, choice=so.choice,
            grammar=so.grammar, json_object=bool(so.json_object),
            disable_any_whitespace=so.disable_any_whitespace)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            found.append((name, _spec(name, **{kind: value})))
    return found


def _tool_spec(body: ChatCompletionRequest) -> tuple[StructuredOutputsParams, ToolCallPlan] | None:
    choice = body.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    tools = body.tools or []
    if not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "required":
        calls = [{"type": "object",
                  "properties": {"name": {"const": tool.function.name},
                                 "parameters": tool.function.parameters or {"type": "object"}},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for tool in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return _spec("tools", json=schema), ToolCallPlan(None)
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise APIError(400, f"tool_choice names function {name!r}, which is not in tools "
                       f"({[t.function.name for t in tools]})", param="tool_choice")
    return (_spec("tools", json=tool.function.parameters or {"type": "object"}),
            ToolCallPlan(name))


def structured_outputs_of(body: CompletionRequest | ChatCompletionRequest
                          ) -> tuple[StructuredOutputsParams | None, ToolCallPlan | None]:
    """The request's structured-outputs spec (None: free output) and, for a forced tool
    call, how to turn the output into ``tool_calls``. APIError 400 for conflicting or
    malformed fields."""
    found = _from_request_fields(body)
    plan = None
    if isinstance(body, ChatCompletionRequest):
        tool = _tool_spec(body)
        if tool is not None:
            found.append(("tool_choice", tool[0]))
            plan = tool[1]
    if len(found) > 1:
        names = [name for name, _ in found]
        raise APIError(400, f"give at most one way to constrain the output; got {names}",
                       param=names[1])
    return (found[0][1] if found else None), plan


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_of(plan: ToolCallPlan, text: str) -> list[dict] | None:
    """OpenAI ``tool_calls`` from a constrained output; None when the output is not a
    complete call (cut by ``max_tokens``: the text is returned as content instead)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.function is not None:
        calls = [(plan.function, text)]  # the arguments exactly as generated
    else:
        if not isinstance(value, list):
            return None
        calls = [(item["name"], json.dumps(item["parameters"])) for item in value]
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls]


def template_message(message) -> dict:
    """A chat message as chat templates read it (tool calls and answers included)."""
    out = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type,
                              "function": {"name": c.function.name,
                                           "arguments": c.function.arguments}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def tool_delta(plan: ToolCallPlan, choice, delta, finished: bool,
                call_ids: dict[int, str]) -> dict:
    """One streamed chunk's choice for a forced tool call: a named function's arguments
    stream as they come (the first delta carries the call's id and name); ``"required"``
    calls come whole with the last chunk."""
    reason = choice.finish_reason if finished else None
    if plan.function is None:
        calls = tool_calls_of(plan, choice.text)
        if calls is None:
            return {"index": choice.index, "delta": {"content": choice.text},
                    "logprobs": None, "finish_reason": reason}
        return {"index": choice.index,
                "delta": {"tool_calls": [dict(call, index=i) for i, call in enumerate(calls)]},
                "logprobs": None, "finish_reason": "tool_calls"}
    call = {"index": 0, "function": {"arguments": delta.text}}
    if choice.index not in call_ids:
        call_ids[choice.index] = new_call_id()
        call.update(id=call_ids[choice.index], type="function")
        call["function"]["name"] = plan.function
    return {"index": choice.index, "delta": {"tool_calls": [call]}, "logprobs": None,
            "finish_reason": reason}
