"""Speculative decoding on the host: who proposes, and what was accepted.

A step that speculates (``Scheduler._propose``) gives each eligible decode row its last
accepted token followed by up to ``num_speculative_tokens`` proposals (from the host's
``NgramProposer``, or, when the proposer has ``propose_batch``, a draft model's on the
device: ``jaxpage.runtime.draft_model``, whose slots are allocated before it proposes); the device samples
every position and decides which sampled tokens are emitted
(``jaxpage.runtime.step.verify_tokens``); the host appends those and releases the blocks
that only rejected proposals reached (``KVCacheManager.free_tail``).

Rows that never carry proposals (they are verified one token at a time, as without
speculation): beam search (refused at submission), a row whose request is within one
token of ``max_tokens``, and every row of a step that also carries prefill tokens or has
more running requests than ``disable_by_batch_size``. Rows with presence, frequency or
repetition penalties do speculate: the verify step counts a row's proposals before each
position as output tokens (``sampler.proposals_before``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from jaxpage.config import SpeculativeConfig
from jaxpage.core.ngram_proposer import propose_ngram
from jaxpage.core.request import Request
from jaxpage.core.schedule_ahead import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from jaxpage.config import SchedulerConfig
    from jaxpage.core.kv_cache_manager import KVCacheManager


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
    """The host-side proposer of ``config``; None when off, and for ``draft_model``, whose
    proposer runs on the device and is attached by the engine that loads the draft
    (``jaxpage.runtime.draft_model.DraftModelProposer``)."""
    if config is None or config.method == "draft_model":
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


class SpeculativeScheduling:
    """The speculative-decoding decisions of ``Scheduler`` (which supplies the queues, the
    KV manager, ``accept_token``, ``proposer``, ``speculation`` and ``spec_stats``)."""

    config: "SchedulerConfig"
    kv: "KVCacheManager"
    running: list[Request]
    proposer: "NgramProposer | None"
    speculation: SpeculativeConfig | None
    spec_stats: SpecDecodeStats

    def speculating(self) -> bool:
        """Whether steps may carry proposals now: speculation is on and few enough
        requests run (``disable_by_batch_size``). Such steps are scheduled one at a time
        by the host, which must know each request's last token to propose after it."""
        return (self.proposer is not None
                and len(self.running) <= self.speculation.disable_by_batch_size)

    def _propose(self, out: SchedulerOutput) -> None:
        """Give the decode rows of ``out`` their proposals (see ``jaxpage.core.speculation``):
        only when every row is a plain decode, nothing was preempted, and the batch is
        small enough. A row whose blocks for its proposals cannot be had without a
        preemption simply carries none."""
        items = out.scheduled
        if (out.preempted or len(items) > self.speculation.disable_by_batch_size
                or self.has_constrained):
            return  # a grammar's rows would need a mask per proposal
        for item in items:
            request = item.request
            if (item.num_new_tokens != 1 or item.ahead or request.external_sampling
                    or request.fork_children
                    or request.num_computed_tokens != len(request.all_token_ids) - 1):
                return  # a prefill chunk (or a fork) shares the step: no speculation in it
        budget = self.config.max_num_batched_tokens - len(items)
        on_device = hasattr(self.proposer, "propose_batch")
        wanted: list[tuple[ScheduledRequest, int]] = []
        for item in items:
            request = item.request
            room = request.max_tokens - request.num_output_tokens - 1
            if budget <= 0 or room <= 0:
                continue
            if on_device:  # a draft model: slots first, then one device call for all rows
                k = min(room, budget, self.speculation.num_speculative_tokens)
                if self.kv.allocate_slots(request, 1 + k):
                    wanted.append((item, k))
                    budget -= k
                continue
            drafts = self.proposer.propose(request, min(room, budget))
            if drafts and self.kv.allocate_slots(request, 1 + len(drafts)):
                self._give_drafts(out, item, drafts)
                budget -= len(drafts)
        if wanted:
            proposals = self.proposer.propose_batch([(item.request, k) for item, k in wanted])
            for row, ((item, _), drafts) in enumerate(zip(wanted, proposals)):
                self._give_drafts(out, item, drafts)
                item.draft_q_row = row

    @staticmethod
    def _give_drafts(out: SchedulerOutput, item: ScheduledRequest, drafts: list[int]) -> None:
        item.num_new_tokens += len(drafts)
        item.draft_token_ids = drafts
        out.num_draft_tokens += len(drafts)


    def accept_verified(self, item: ScheduledRequest, tokens: list[int],
                        on_token: Callable[[Request, int], None] | None = None) -> int:
        """Apply one row of a verify step: ``tokens`` are the row's emitted tokens in
        order (its accepted proposals, then the correction or bonus token). Each is
        accepted like any token, stops included (tokens past a stop are dropped);
        ``on_token(request, i)`` runs after the ``i``-th. Then the blocks that only the
        rejected proposals reached go back to the pool. Returns the tokens applied."""
        request = item.request
        applied = 0
        for token in tokens:
            if request.is_finished:
                break
            self.accept_token(request, token)
            if on_token is not None:
                on_token(request, applied)
            applied += 1
        if not request.is_finished:
            self.kv.free_tail(request)
        self.spec_stats.record(len(item.draft_token_ids), len(tokens) - 1)
        return applied

