"""Speculative decoding on the host: who proposes, and what was accepted.

A step that speculates gives each eligible decode row its last accepted token followed
by up to ``num_speculative_tokens`` proposals: the host's ``NgramProposer`` proposes inside
``Scheduler.schedule``; a draft model (``jaxpage.runtime.draft_model``) proposes on the
device, called by the engine (``DeviceCalls``) between scheduling and building the batch,
for the rows ``Speculation.reserve_draft_rows`` picked (their slots allocated first). The
device samples every position and decides which sampled tokens are emitted
(``jaxpage.runtime.step.verify_tokens``); the host appends those and releases the blocks
that only rejected proposals reached (``KVCacheManager.free_tail``, in
``StepApplier``).

Rows that never carry proposals (they are verified one token at a time, as without
speculation): beam search (refused at submission), a row whose request is within one
token of ``max_tokens``, and every row of a step that also carries prefill tokens or has
more running requests than ``disable_by_batch_size``. Rows with presence, frequency or
repetition penalties do speculate: the verify step counts a row's proposals before each
position as output tokens (``sampler.proposals_before``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxpage.speculative_config import SpeculativeConfig
from jaxpage.core.sched.ngram_proposer import propose_ngram
from jaxpage.core.request import Request
from jaxpage.core.sched.schedule_output import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from jaxpage.core.kv.kv_cache_manager import KVCacheManager


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


class Speculation:
    """The scheduler's speculative-decoding part: which rows carry proposals, and their
    statistics. Its own state: the config, the host proposer (None: the engine's draft
    model proposes, on the device, from ``DeviceCalls``), the counters.

    Invariant: nothing here touches the device. With a draft model ``schedule`` leaves
    proposals out; the engine asks ``reserve_draft_rows`` for the rows that may carry them
    (their slots allocated), runs the draft model, and hands its tokens to ``give``."""

    def __init__(self, config: SpeculativeConfig, max_num_batched_tokens: int,
                 kv: "KVCacheManager") -> None:
        self.config = config
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.proposer = make_proposer(config)
        self.stats = SpecDecodeStats()

    @property
    def engine_proposes(self) -> bool:
        """Proposals come from the engine's draft model (``method="draft_model"``)."""
        return self.config.method == "draft_model"

    def active(self, num_running: int) -> bool:
        """Whether steps may carry proposals now: few enough requests run
        (``disable_by_batch_size``). Such steps are scheduled one at a time by the host,
        which must know each request's last token to propose after it."""
        return num_running <= self.config.disable_by_batch_size

    def _eligible_rows(self, out: SchedulerOutput) -> bool:
        """Every row of ``out`` a plain decode, nothing preempted, the batch small enough:
        only then do its rows carry proposals (a prefill chunk or a fork shares the step
        otherwise)."""
        items = out.scheduled
        if not items or out.preempted or len(items) > self.config.disable_by_batch_size:
            return False
        for item in items:
            request = item.request
            if (item.num_new_tokens != 1 or item.ahead or request.external_sampling
                    or request.fork_children
                    or request.num_computed_tokens != len(request.all_token_ids) - 1):
                return False
        return True

    def propose(self, out: SchedulerOutput) -> None:
        """Give ``out``'s decode rows the host proposer's proposals (see the module
        docstring). A row whose blocks for its proposals cannot be had without a
        preemption simply carries none."""
        if self.proposer is None or not self._eligible_rows(out):
            return
        budget = self.max_num_batched_tokens - len(out.scheduled)
        for item in out.scheduled:
            request = item.request
            room = request.max_tokens - request.num_output_tokens - 1
            if budget <= 0 or room <= 0:
                continue
            drafts = self.proposer.propose(request, min(room, budget))
            if drafts and self.kv.allocate_slots(request, 1 + len(drafts)):
                self._give(out, item, drafts)
                budget -= len(drafts)

    def reserve_draft_rows(self, out: SchedulerOutput) -> list[tuple[ScheduledRequest, int]]:
        """The rows of ``out`` that may carry up to ``k`` of a draft model's proposals,
        as (row, k), their slots allocated; [] when ``out`` takes no proposals."""
        if not self.engine_proposes or not self._eligible_rows(out):
            return []
        budget = self.max_num_batched_tokens - len(out.scheduled)
        wanted = []
        for item in out.scheduled:
            request = item.request
            room = request.max_tokens - request.num_output_tokens - 1
            if budget <= 0 or room <= 0:
                continue
            k = min(room, budget, self.config.num_speculative_tokens)
            if self.kv.allocate_slots(request, 1 + k):
                wanted.append((item, k))
                budget -= k
        return wanted

    def give(self, out: SchedulerOutput, wanted: list[tuple[ScheduledRequest, int]],
             proposals: list[list[int]]) -> None:
        """Hand the draft model's proposals for ``reserve_draft_rows``'s rows to them
        (row ``i`` of its propose call is the ``i``-th wanted row: its q row)."""
        for q_row, ((item, _), drafts) in enumerate(zip(wanted, proposals)):
            self._give(out, item, drafts)
            item.draft_q_row = q_row

    @staticmethod
    def _give(out: SchedulerOutput, item: ScheduledRequest, drafts: list[int]) -> None:
        item.num_new_tokens += len(drafts)
        item.draft_token_ids = drafts
        out.num_draft_tokens += len(drafts)
