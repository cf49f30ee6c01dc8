"""Results returned to users, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token at one position, with its 1-based rank in the vocabulary."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the sampled token and the top ones).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"``
    (``max_tokens`` or the context limit) or ``None`` while unfinished. ``stop_reason`` is
    the stop string or stop token id that ended it, or ``None`` for EOS and length.
    ``logprobs`` (when the request asked for them) has one dict per token of
    ``token_ids``; ``cumulative_logprob`` is then the sum of the sampled tokens' logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # Disaggregated serving: a prefill instance's ticket for this request's KV pages
    # (``runtime.kv_transfer.TransferTicket`` plus the prompt ids and first token).
    kv_transfer_params: dict | None = None
