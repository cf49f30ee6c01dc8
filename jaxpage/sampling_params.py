"""SamplingParams: how one request samples and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence


def _fail(name: str, value: object, rule: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Rules the output must follow (vLLM's ``StructuredOutputsParams``): exactly one of

    * ``json``: a JSON schema (a dict, or its JSON text);
    * ``regex``: a regular expression the whole output must match;
    * ``choice``: a list of strings, the output is one of them;
    * ``grammar``: a context-free grammar in Lark (or llama.cpp's GBNF) syntax;
    * ``json_object=True``: any JSON object.

    ``disable_any_whitespace`` (JSON only): no whitespace between JSON tokens but the
    one space after "," and ":". Otherwise one space, or one line break and an indent,
    may separate them (vLLM allows any amount; a small model can then fill
    ``max_tokens`` with blank lines, and the output never parses).

    The grammar engine (llguidance, ``jaxpage.engine.features.structured_outputs``) compiles it once
    per distinct spec; a spec it rejects is a ``ValueError`` when the request is added.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if self.json_object is not False:
            if self.json_object is not True:
                _fail_structured("json_object", self.json_object, "must be a bool")
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as error:
                    _fail_structured("json", self.json, f"is not valid JSON ({error})")
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                _fail_structured("json", self.json, "must be a JSON schema (an object)")
        if not isinstance(self.disable_any_whitespace, bool):
            _fail_structured("disable_any_whitespace", self.disable_any_whitespace,
                             "must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail_structured(name, value, "must be a non-empty string")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not isinstance(self.choice, Sequence)
                    or not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
                _fail_structured("choice", self.choice, "must be a non-empty list of non-empty "
                                 "strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """Which rule is given: "json", "regex", "choice", "grammar" or "json_object"."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar")
                    if getattr(self, name) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for specs that compile to the same grammar."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            value = json.dumps(list(value))
        elif kind == "json_object":
            value = ""
        if kind in ("json", "json_object") and self.disable_any_whitespace:
            kind += ":compact"
        return kind, value

    def __hash__(self) -> int:
        return hash(self.key)


def _fail_structured(name: str, value: object, rule: str) -> None:
    raise ValueError(f"StructuredOutputsParams.{name}={value!r} is invalid: {rule}")


# Most top log-probabilities a request may ask for per generated token (vLLM's default cap).
MAX_LOGPROBS = 20
# Tokens one request's logit_bias may name (each row of a batch carries this many slots).
MAX_LOGIT_BIAS = 16


@dataclass(frozen=True)
class SamplingParams:
    """Frozen, validated sampling parameters.

    ``temperature == 0`` means greedy. ``top_k == -1`` disables top-k. ``stop`` strings are
    cut from the returned text unless ``include_stop_str_in_output``. ``stop`` and
    ``stop_token_ids`` are normalised to tuples. ``max_tokens=None`` means "until the
    context (``max_model_len``) is full". ``output_kind="delta"`` makes
    ``LLMEngine.step`` return the new part of a request's output at every step (streaming);
    ``"final"`` returns it once, finished.

    Penalties follow vLLM: ``repetition_penalty`` (> 0, 1 = off) divides positive logits
    and multiplies negative ones of every token seen in the prompt or the output;
    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]) subtract a constant, and a
    constant per occurrence, from the logits of tokens in the output. ``logprobs=N``
    returns, per generated token, the log-probabilities of the N most likely tokens of
    the raw model distribution plus the sampled one (``0``: the sampled one only).
    ``prompt_logprobs`` is not supported. ``structured_outputs``: rules the output must
    follow (``StructuredOutputsParams``); every token is drawn from those the rules allow.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    output_kind: str = "final"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> a number in [-100, 100] added to that token's logit
    # before sampling (greedy too), at most MAX_LOGIT_BIAS tokens
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            _fail("n", self.n, "must be an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            _fail("temperature", self.temperature, "must be a number >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:
            _fail("top_k", self.top_k, "must be -1 (disabled) or an integer >= 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", self.seed, "must be an integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        else:
            stop = tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            _fail("stop", self.stop, "must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids or ())
        if any(not _is_int(t) or t < 0 for t in ids):
            _fail("stop_token_ids", self.stop_token_ids, "must be a list of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", ids)
        if self.output_kind not in ("final", "delta"):
            _fail("output_kind", self.output_kind, 'must be "final" or "delta"')
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                _fail(name, value, "must be a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            _fail("repetition_penalty", self.repetition_penalty, "must be a number > 0")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _fail("logprobs", self.logprobs, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None:
            _fail("prompt_logprobs", self.prompt_logprobs, "is not supported (leave it None)")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            _fail("structured_outputs", self.structured_outputs,
                  "must be a StructuredOutputsParams or None")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS or any(
                    not _is_int(t) or t < 0 or not _is_number(v) or not -100 <= v <= 100
                    for t, v in bias.items()):
                _fail("logit_bias", bias, f"must map at most {MAX_LOGIT_BIAS} token ids >= 0 "
                                          "to numbers in [-100, 100]")
            object.__setattr__(self, "logit_bias", {int(t): float(v) for t, v in bias.items()}
                               or None)
        for flag in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                _fail(flag, getattr(self, flag), "must be a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """True when presence, frequency or repetition penalties change the logits."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)
