"""Beam search inside the engine, on the fork / copy-on-write mechanism.

Each beam is a Request whose next token the driver chooses (``external_sampling``): the
step returns its top log-probabilities instead. Once every live beam of a search has
its distribution, the driver expands: the best ``beam_width`` continuations survive; a
beam chosen k times is reused once and forked k - 1 times (children share its blocks by
reference count, and the partly filled last block is copied on first write); unchosen
beams are finished and their blocks freed. The search reserves ``beam_width`` batch rows.
"""

from __future__ import annotations

import itertools

import numpy as np

from jaxpage.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_score
from jaxpage.core.request import Request, RequestStatus
from jaxpage.core.sched.scheduler import Scheduler


class _Search:
    def __init__(self, leader: Request, params: BeamSearchParams) -> None:
        self.params = params
        self.live: list[Request] = [leader]
        self.cum: dict[str, float] = {leader.request_id: 0.0}
        self.logprobs: dict[str, list[float]] = {leader.request_id: []}
        self.pending: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.completed: list[BeamSearchSequence] = []


class BeamSearchDriver:
    def __init__(self, scheduler: Scheduler, eos_token_ids: frozenset[int], decode) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.decode = decode  # list[int] -> str
        self.searches: dict[str, _Search] = {}   # search id -> state
        self.search_of: dict[str, str] = {}      # beam request id -> search id
        self.results: dict[str, BeamSearchOutput] = {}
        self._ids = itertools.count()

    def start(self, search_id: str, leader: Request, params: BeamSearchParams) -> None:
        if self.scheduler.speculation is not None:
            raise ValueError("beam search is not supported with speculative decoding "
                             f"(speculative_config={self.scheduler.config.speculative_config!r}); "
                             "start an engine without it for beam search")
        leader.external_sampling = True
        leader.extra_seats = params.beam_width - 1
        self.scheduler.add_request(leader)
        self.searches[search_id] = _Search(leader, params)
        self.search_of[leader.request_id] = search_id

    def abort(self, search_id: str) -> None:
        search = self.searches.pop(search_id, None)
        if search is None:
            return
        for beam in search.live:
            self.scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)
            self.search_of.pop(beam.request_id, None)

    def on_distribution(self, beam: Request, top_ids: np.ndarray, top_logprobs: np.ndarray) -> None:
        search_id = self.search_of.get(beam.request_id)
        search = self.searches.get(search_id)
        if search is None:
            return
        width = 2 * search.params.beam_width
        search.pending[beam.request_id] = (top_ids[:width], top_logprobs[:width])
        if len(search.pending) == len(search.live):
            self._expand(search_id, search)

    def _hypothesis(self, search: _Search, beam: Request, token: int | None, logprob: float,
                    reason: str) -> BeamSearchSequence:
        output = beam.output_token_ids + ([token] if token is not None else [])
        logprobs = search.logprobs[beam.request_id] + ([logprob] if token is not None else [])
        return BeamSearchSequence(tokens=beam.prompt_token_ids + output,
                                  cum_logprob=search.cum[beam.request_id] + (logprob if token is not None else 0.0),
                                  logprobs=logprobs, text=self.decode(output), finish_reason=reason)

    def _expand(self, search_id: str, search: _Search) -> None:
        params = search.params
        candidates = []  # (cum_logprob, beam index, token, logprob)
        for index, beam in enumerate(search.live):
            ids, logprobs = search.pending[beam.request_id]
            for token, logprob in zip(ids.tolist(), logprobs.tolist()):
                if token in self.eos_token_ids and not params.ignore_eos:
                    search.completed.append(self._hypothesis(search, beam, token, logprob, "stop"))
                else:
                    candidates.append((search.cum[beam.request_id] + logprob, index, token, logprob))
        search.pending.clear()
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then token rank
        chosen = candidates[:params.beam_width]

        reused: set[int] = set()
        new_live: list[tuple[Request, int, float, float, Request]] = []
        for cum, index, token, logprob in chosen:  # forks first, from unmodified parents
            parent = search.live[index]
            if index in reused:
                child = self.scheduler.fork_running(parent, f"{search_id}@beam{next(self._ids)}")
                self.search_of[child.request_id] = search_id
            else:
                reused.add(index)
                child = parent
            new_live.append((child, token, cum, logprob, parent))
        history = {beam.request_id: list(search.logprobs[beam.request_id]) for beam in search.live}
        for index, beam in enumerate(search.live):
            if index not in reused:
                self._drop(beam)
        search.cum, search.logprobs, search.live = {}, {}, []
        for beam, token, cum, logprob, parent in new_live:
            beam.append_output_token(token)
            search.cum[beam.request_id] = cum
            search.logprobs[beam.request_id] = history[parent.request_id] + [logprob]
            search.live.append(beam)
        for beam in search.live:
            beam.extra_seats = 0
        if search.live:
            search.live[0].extra_seats = params.beam_width - len(search.live)
        if not search.live or search.live[0].num_output_tokens >= search.live[0].max_tokens:
            self._finish(search_id, search)

    def _drop(self, beam: Request) -> None:
        self.scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_STOPPED)
        self.search_of.pop(beam.request_id, None)

    def _finish(self, search_id: str, search: _Search) -> None:
        for beam in search.live:
            search.completed.append(BeamSearchSequence(
                tokens=beam.prompt_token_ids + beam.output_token_ids,
                cum_logprob=search.cum[beam.request_id], logprobs=search.logprobs[beam.request_id],
                text=self.decode(beam.output_token_ids), finish_reason="length"))
            self._drop(beam)
        params = search.params
        ranked = sorted(search.completed, key=lambda h: -beam_score(
            h.tokens, h.cum_logprob, self.eos_token_ids, params.length_penalty))
        self.results[search_id] = BeamSearchOutput(sequences=ranked[:params.beam_width])
        del self.searches[search_id]
