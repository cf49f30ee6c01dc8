"""One generation request as the host core sees it."""

from __future__ import annotations

import enum
import time

import numpy as np

from jaxpage.sampling_params import SamplingParams


# Width of the per-sequence list of stop token ids the device knows (EOS and stop_token_ids):
# masked until min_tokens are out, and checked on device by the multi-step decode loop.
MAX_STOP_TOKENS = 16


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"      # by recompute: back in the waiting queue
    SWAPPED = "swapped"          # its KV blocks wait in host memory
    FORK_PENDING = "fork_pending"  # a sibling of an n > 1 request, born when the prompt is in
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return id(self) in FINISHED_IDS

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


# Identities of the finished statuses: ``id(status) in FINISHED_IDS`` is a C-level check,
# where an Enum's own hashing and equality run in Python (hot: once per row per step).
FINISHED_IDS = frozenset(map(id, (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                                   RequestStatus.FINISHED_ABORTED)))


def derive_sample_seed(seed: int) -> int:
    """Map any Python int to the uint32 seed the device sampler keys from."""
    return int(np.random.SeedSequence(seed & 0xFFFF_FFFF_FFFF_FFFF).generate_state(1)[0])


class Request:
    """Tokens, progress and stop rules of one sequence.

    Invariants: ``num_computed_tokens <= num_tokens`` (tokens whose K/V are in the cache
    versus all tokens known); ``all_token_ids == prompt_token_ids + output_token_ids``,
    where only ``all_token_ids`` is stored: ``output_token_ids`` is a copy of its tail
    (``num_output_tokens`` and ``last_token_id`` read it without one), so a decode step
    appends each token to one list. In steady decoding the newest tokens wait in the
    scheduler's ``core.sched.steady_batch.SteadyBatch`` instead, which gives them to the
    request at defined points (see there): code outside the scheduler reads a request only
    after those.
    ``max_tokens`` is already clipped so that ``num_prompt_tokens + max_tokens <=
    max_model_len``.
    """

    # Slots, not a per-object dict: each value lies in the object itself, in this order,
    # so the decode hot loop's attributes (first) share the object's first cache lines and
    # a step over many requests touches about half the memory it did with a dict
    # (``docs/benchmarks/design_measurements.md``).
    __slots__ = (
        "status", "num_computed_tokens", "all_token_ids", "num_prompt_tokens",
        "first_token_time", "has_stop_strings", "has_many_stop_ids", "streams_deltas",
        "request_id", "prompt", "prompt_token_ids", "sampling_params", "eos_token_ids",
        "sample_seed", "arrival_time", "max_tokens", "stop_reason", "num_preemptions",
        "priority", "extra_keys", "block_hashes", "num_cached_tokens", "arrival_seq",
        "added_step", "fork_children", "fork_leader", "external_sampling", "grammar",
        "kv_export", "exported_blocks", "kv_transfer_params", "extra_seats", "lora",
        "lora_slot",
        "__weakref__")  # (the draft model keeps per-request state in a WeakKeyDictionary)

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, *, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset(), sample_seed: int = 0,
                 prompt: str | None = None, arrival_time: float | None = None,
                 priority: int = 0, extra_keys: tuple = ()) -> None:
        # The decode hot loop's attributes first (``__slots__`` keeps the same order).
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.all_token_ids: list[int] = list(prompt_token_ids)  # the prompt, then the outputs
        self.num_prompt_tokens = len(self.all_token_ids)
        self.first_token_time: float | None = None  # monotonic time of its first output token
        self.has_stop_strings = bool(sampling_params.stop)
        self.has_many_stop_ids = False  # set below, once the stop ids are known
        self.streams_deltas = sampling_params.output_kind == "delta"  # an output every step
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.sample_seed = sample_seed
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        room = max_model_len - len(self.prompt_token_ids)
        requested = sampling_params.max_tokens
        self.max_tokens = room if requested is None else min(requested, room)
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.priority = priority
        self.extra_keys = extra_keys          # joins every block hash (adapters, media, ...)
        self.block_hashes: list[bytes] = []   # hashes of full blocks of all_token_ids, in order
        self.num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache
        self.arrival_seq = 0          # set by the scheduler: FCFS order, ties in priority order
        self.added_step = 0           # scheduler step at which it arrived (for priority aging)
        # Siblings (n > 1, beam search) that will share this request's blocks once all but the
        # last prompt token are computed; each then computes that token into its own copy.
        self.fork_children: list[Request] = []
        self.fork_leader: Request | None = None  # set on a sibling until it is born
        # When True the engine chooses each next token (beam search), not the sampler.
        self.external_sampling = False
        # Structured outputs: the grammar's state for this sequence (the engine's
        # ``GrammarState``; opaque here). Its mask must be computed on the host before each
        # token, so while such a request is in the scheduler, calls are single steps.
        self.grammar = None
        # Disaggregated serving: a prefill instance offers this request's prompt pages when
        # it finishes at its token limit (``kv_export``); ``exported_blocks`` are the block
        # ids holding them, taken as it finishes, and ``kv_transfer_params`` the ticket.
        self.kv_export = False
        self.exported_blocks: list[int] | None = None
        self.kv_transfer_params: dict | None = None
        self.extra_seats = 0  # batch rows held for siblings born later (beam search)
        # Multi-LoRA: the adapter (an engine ``LoadedLoRA``, opaque here; None: the base
        # model) and, while the request runs, the device slot holding it (1..max_loras,
        # ``core.sched.lora_slots``; 0 = none).
        self.lora = None
        self.lora_slot = 0
        # More stop token ids than the device's list holds: vector pre-checks cannot rule
        # out a stop, so every token of this request is checked exactly.
        self.has_many_stop_ids = len(self.stop_token_ids_to_suppress) > MAX_STOP_TOKENS

    @property
    def fork_at(self) -> int:
        """Computed-token count at which the pending fork happens."""
        return self.num_prompt_tokens - 1

    @property
    def num_seats(self) -> int:
        """Batch rows this request will occupy: itself plus its unborn siblings."""
        return 1 + len(self.fork_children) + self.extra_seats

    def fork(self, request_id: str, sample_seed: int) -> "Request":
        """A copy with the same tokens and progress; blocks are shared by the KV manager."""
        child = Request.__new__(Request)
        for name in Request.__slots__[:-1]:  # (not __weakref__)
            setattr(child, name, getattr(self, name))
        child.request_id = request_id
        child.sample_seed = sample_seed
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.fork_children = []
        child.fork_leader = self
        child.num_preemptions = 0
        child.extra_seats = 0
        return child

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far (a new list: appending to it changes nothing)."""
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.all_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return id(self.status) in FINISHED_IDS

    @property
    def stop_token_ids_to_suppress(self) -> tuple[int, ...]:
        """Token ids whose sampling is masked while fewer than ``min_tokens`` are out."""
        ids = set(self.sampling_params.stop_token_ids)
        if not self.sampling_params.ignore_eos:
            ids |= self.eos_token_ids
        return tuple(sorted(ids))

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_token_stop(self) -> RequestStatus | None:
        """The finished status implied by the last token (EOS, stop ids, lengths), if any."""
        params = self.sampling_params
        last = self.all_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
