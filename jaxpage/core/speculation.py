"""Speculative decoding on the host: who proposes, and what was accepted.

A step that speculates (``Scheduler._propose``) gives each eligible decode row its last
accepted token followed by up to ``num_speculative_tokens`` proposals; the device samples
every position and decides which sampled tokens are emitted
(``jaxpage.runtime.step.verify_tokens``); the host appends those and releases the blocks
that only rejected proposals reached (``KVCacheManager.free_tail``).

Rows that never carry proposals (they are verified one token at a time, as without
speculation): requests with presence, frequency or repetition penalties (the penalty of
a proposal's position would have to count the proposals before it), beam search (refused
at submission), a row whose request is within one token of ``max_tokens``, and every row
of a step that also carries prefill tokens or has more running requests than
``disable_by_batch_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpage.config import SpeculativeConfig
from jaxpage.core.ngram_proposer import propose_ngram
from jaxpage.core.request import Request


class NgramProposer:
    """Prompt lookup over each request's own tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` proposed tokens after ``request``'s last one; [] if none."""
        config = self.config
        k = min(max_tokens, config.num_speculative_tokens)
        if k < 1:
            return []
        return propose_ngram(request.all_token_ids, k, config.prompt_lookup_min,
                             config.prompt_lookup_max).tolist()


def make_proposer(config: SpeculativeConfig | None) -> NgramProposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    raise ValueError(f"speculative_config method={config.method!r} is not supported")


@dataclass
class SpecDecodeStats:
    """Counters of speculation (vLLM's names in ``get_stats``)."""

    num_drafts: int = 0           # rows verified with at least one proposal
    num_draft_tokens: int = 0     # proposals verified
    num_accepted_tokens: int = 0  # proposals the target agreed with

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed:
            self.num_drafts += 1
            self.num_draft_tokens += num_proposed
            self.num_accepted_tokens += num_accepted

    def as_dict(self) -> dict[str, float]:
        drafts, proposed = self.num_drafts, self.num_draft_tokens
        return {"spec_num_drafts": drafts, "spec_num_draft_tokens": proposed,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": self.num_accepted_tokens / proposed if proposed else 0.0,
                # tokens a verified row emits on average: the accepted ones plus one
                "spec_mean_accepted_length": (1 + self.num_accepted_tokens / drafts
                                              if drafts else 0.0)}
