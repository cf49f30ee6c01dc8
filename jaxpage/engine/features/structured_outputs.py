"""Structured outputs on the host: grammars compiled by llguidance, one matcher per
sequence, and the packed masks the device sampler applies.

* ``GrammarCompiler.compile(spec)`` turns a ``StructuredOutputsParams`` into a
  ``CompiledGrammar`` once per distinct spec (an LRU cache keyed by ``spec.key``). It is
  thread-safe and meant to run off the engine's thread (``AsyncLLMEngine`` runs it in a
  pool), so a slow compile delays only its own request. A spec llguidance rejects is a
  ``ValueError`` naming the problem, raised before the request exists (it holds no block).
* Each sequence gets its own ``GrammarState`` (a copy of the compiled matcher) in
  ``Request.grammar``; ``n > 1`` siblings get one each.
* Before a step, ``fill_masks`` writes the packed masks (int32 ``[S, ceil(V / 32)]``,
  llguidance's layout, -1 = all allowed) of every constrained row in one parallel fill;
  rows without a grammar stay all ones. After the step, ``advance`` feeds each
  constrained sequence its new tokens and reports those whose grammar has ended.

The masks depend on the token just sampled, so the scheduler runs single steps, none
ahead of the host, while a constrained request is in it (``Scheduler.has_constrained``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any, Iterable

import numpy as np

from jaxpage.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Whitespace allowed between two JSON tokens (unless ``disable_any_whitespace``): one space
# or tab, or one line break and an indent of up to 40 spaces or tabs. Pretty-printed JSON
# fits; a model that would fill ``max_tokens`` with blank lines cannot (vLLM allows any
# amount, and small models then often never close their JSON).
JSON_WHITESPACE = r"(?:[\x20\x09]|\r?\n[\x20\x09]{0,40})?"

# Distinct specs whose compiled grammars are kept.
GRAMMAR_CACHE_SIZE = 256


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError as error:  # pragma: no cover - a dependency of the package
        raise ValueError("structured outputs need the llguidance package") from error
    return llguidance


_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "additionalProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


def without_unlisted_properties(schema: Any) -> Any:
    """A copy of a JSON schema in which an object that lists ``properties`` and says
    nothing about others (no ``additionalProperties``, ``patternProperties`` or
    ``unevaluatedProperties``) allows no other keys. Every output of the copy is valid
    for the original; it only stops a model from inventing keys until ``max_tokens``
    (xgrammar, vLLM's default backend, does the same). Objects whose ``required`` names
    a key not in ``properties`` are left as they are."""
    if isinstance(schema, list):
        return [without_unlisted_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = without_unlisted_properties(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [without_unlisted_properties(item) for item in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: without_unlisted_properties(value)
                        for name, value in out[key].items()}
    properties = out.get("properties")
    if (isinstance(properties, dict) and not any(
            k in out for k in ("additionalProperties", "patternProperties",
                               "unevaluatedProperties"))
            and all(name in properties for name in out.get("required", []) or [])):
        out["additionalProperties"] = False
    return out


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar definition for ``spec`` (not yet checked)."""
    llg = _llguidance()
    kind = spec.kind
    if kind in ("json", "json_object"):
        if kind == "json_object":
            schema = {"type": "object"}
        else:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            schema = without_unlisted_properties(schema)
        # oneOf is compiled as anyOf (llguidance cannot check that exactly one matches).
        options = ({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                    "coerce_one_of": True}
                   if spec.disable_any_whitespace else
                   {"whitespace_pattern": JSON_WHITESPACE, "coerce_one_of": True})
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except (ValueError, TypeError) as error:
            raise ValueError(f"structured_outputs.json is not a usable JSON schema: {error}") \
                from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(list(spec.choice)))
    try:  # Lark, or llama.cpp's GBNF (recognised by its ::= rules)
        return llg.grammar_from("grammar", spec.grammar)
    except (ValueError, TypeError) as error:
        raise ValueError(f"structured_outputs.grammar is invalid: {error}") from None


class GrammarState:
    """One sequence's place in its grammar: a matcher and how many of the sequence's
    output tokens it has consumed (tokens after that are fed by ``advance``)."""

    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.consumed = 0


class CompiledGrammar:
    """A compiled spec: a matcher at the start state that each sequence copies."""

    def __init__(self, spec: StructuredOutputsParams, matcher: Any) -> None:
        self.spec = spec
        self._template = matcher
        self._lock = threading.Lock()

    def new_state(self) -> GrammarState:
        with self._lock:  # copies may be taken from several threads at once
            return GrammarState(self._template.deep_copy())


class GrammarCompiler:
    """Compiles specs against one tokenizer (see the module docstring).

    ``vocab_size``: the model's vocabulary (the width of its logits), which may exceed
    the tokenizer's; masks cover ``ceil(vocab_size / 32)`` words.
    """

    def __init__(self, tokenizer: Any, vocab_size: int,
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.mask_words = -(-vocab_size // 32)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._executor = None
        self.num_compiles = 0

    def ll_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built once (~0.5 s for a 49k vocabulary)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer; this model has none")
                llg = _llguidance()
                try:
                    self._ll_tokenizer = llg.hf.from_tokenizer(self.tokenizer,
                                                               n_vocab=self.vocab_size)
                except ValueError as error:
                    raise ValueError(f"structured outputs cannot use this tokenizer: {error}") \
                        from None
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); ValueError when llguidance rejects it."""
        if not isinstance(spec, StructuredOutputsParams):
            raise ValueError(f"structured_outputs={spec!r} must be a StructuredOutputsParams")
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        tokenizer = self.ll_tokenizer()
        matcher = _llguidance().LLMatcher(tokenizer, grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} cannot be compiled: "
                             f"{matcher.get_error()}")
        compiled = CompiledGrammar(spec, matcher)
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def fill_masks(self, rows: Iterable[tuple[int, GrammarState]], num_rows: int) -> np.ndarray:
        """int32 [num_rows, mask_words]: all ones, and each given row's grammar mask for
        its next token, filled by llguidance's thread pool in one call."""
        llg = _llguidance()
        mask = np.full((num_rows, self.mask_words), -1, np.int32)
        if self._executor is None:
            self._executor = llg.LLExecutor()
        llg.numpy.fill_next_token_bitmask_par(
            self._executor, [(state.matcher, row) for row, state in rows], mask)
        return mask


def advance(requests: Iterable[Any]) -> list[Any]:
    """Feed each constrained request (``Request.grammar`` set, not finished) the output
    tokens its grammar has not seen; returns those whose grammar has now ended (it
    accepts and allows nothing more) or failed, which the caller finishes."""
    ended = []
    for request in requests:
        state = request.grammar
        if state is None or request.is_finished:
            continue
        tokens, first = request.all_token_ids, request.num_prompt_tokens  # outputs from first
        matcher = state.matcher
        while first + state.consumed < len(tokens):
            matcher.consume_token(tokens[first + state.consumed])
            state.consumed += 1
        if matcher.is_error():
            logger.warning("request %s: its grammar rejected an output token (%s); finishing it",
                           request.request_id, matcher.get_error())
            ended.append(request)
        elif matcher.is_stopped():
            ended.append(request)
    return ended
