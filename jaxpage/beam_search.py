"""Beam search parameters and results (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpage.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams, each extended by one token per step for up to ``max_tokens``.

    At each step every beam proposes its ``2 * beam_width`` most likely next tokens; EOS
    proposals end a hypothesis (unless ``ignore_eos``), and the ``beam_width`` best of the
    rest by cumulative log-probability continue. At the end, finished and live hypotheses
    are ranked by ``cum_logprob / len(tokens) ** length_penalty`` (a trailing EOS not
    counted) and the best ``beam_width`` returned.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        limit = MAX_LOGPROBS // 2
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= limit:
            raise ValueError(f"BeamSearchParams.beam_width={self.beam_width!r} must be an "
                             f"integer in [1, {limit}]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens={self.max_tokens!r} must be >= 1")
        if self.temperature != 0.0:
            raise ValueError(f"BeamSearchParams.temperature={self.temperature!r}: only 0.0 "
                             "(log-probabilities of the model itself) is supported")


@dataclass
class BeamSearchSequence:
    tokens: list[int]            # prompt and generated tokens
    cum_logprob: float
    logprobs: list[float] = field(default_factory=list)  # one per generated token
    text: str | None = None      # the generated part, decoded
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids, length_penalty: float) -> float:
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length ** length_penalty)
