"""SamplingParams: how one request samples and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def _fail(name: str, value: object, rule: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Most top log-probabilities a request may ask for per generated token (vLLM's default cap).
MAX_LOGPROBS = 20


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
    ``prompt_logprobs`` is not supported.
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
