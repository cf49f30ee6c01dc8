"""The user's view of requests: a request id owns its ``n`` sequences (a group).

``RequestGroups`` maps request ids to their sequences and sequence ids back, and turns
the sequences that moved in a device call into ``RequestOutput``s: a delta per moved
sequence for ``output_kind="delta"``, one final output when every sequence of the group
has finished. Invariant: a group is forgotten (with its detokenizer and logprobs state)
exactly when its final output is produced or it is aborted, never before.
"""

from __future__ import annotations

import time

from jaxpage.core.request import FINISHED_IDS, Request
from jaxpage.engine.features.logprobs import LogprobsRecorder
from jaxpage.engine.output_processor import OutputProcessor
from jaxpage.outputs import CompletionOutput, RequestOutput


class RequestGroups:
    def __init__(self, output_processor: OutputProcessor, logprobs: LogprobsRecorder) -> None:
        self.output_processor = output_processor
        self.logprobs = logprobs
        self._groups: dict[str, list[Request]] = {}  # request id -> its n sequences
        self._group_of: dict[str, str] = {}           # sequence id -> request id

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def add(self, request: Request) -> None:
        """Track ``request`` and the sequences forked from it (``n > 1``)."""
        group = [request, *request.fork_children]
        self._groups[request.request_id] = group
        self._group_of.update((seq.request_id, request.request_id) for seq in group)

    def pop(self, request_id: str) -> list[Request]:
        """Forget the group of ``request_id`` (aborted); its sequences, or [] if unknown."""
        group = self._groups.pop(request_id, [])
        for sequence in group:
            self._forget(sequence)
        return group

    def _forget(self, sequence: Request) -> None:
        self._group_of.pop(sequence.request_id, None)
        self.output_processor.forget(sequence.request_id)
        self.logprobs.forget(sequence.request_id)

    def collect(self, requests: list[Request]) -> list[RequestOutput]:
        """Outputs for the groups of ``requests``: deltas, and finals of finished groups."""
        outputs = []
        seen: set[str] = set()
        moved: set[str] | None = None  # made on first use (most steps have no output)
        finished_ids = FINISHED_IDS
        for request in requests:
            if not request.streams_deltas and id(request.status) not in finished_ids:
                continue  # a final-only request that moved but did not finish: nothing to say
            if moved is None:
                moved = {seq.request_id for seq in requests}
            group_id = self._group_of.get(request.request_id)
            if group_id is None or group_id in seen:
                continue
            seen.add(group_id)
            group = self._groups[group_id]
            finished = all(seq.is_finished for seq in group)
            if group[0].sampling_params.output_kind == "delta":
                parts = [self.logprobs.attach(self.output_processor.delta(i, seq), seq)
                         for i, seq in enumerate(group) if seq.request_id in moved]
                completions = [part for part in parts if part is not None]
                if completions or finished:
                    outputs.append(_request_output(group, completions, finished))
            elif finished:
                completions = [self.logprobs.attach(self.output_processor.final(i, seq), seq)
                               for i, seq in enumerate(group)]
                outputs.append(_request_output(group, completions, True))
            if finished:
                del self._groups[group_id]
                for seq in group:
                    self._forget(seq)
        return outputs


def _request_output(group: list[Request], completions: list[CompletionOutput],
                    finished: bool) -> RequestOutput:
    leader = group[0]
    metrics = {"arrival_time": leader.arrival_time,
               "first_token_time": min((s.first_token_time for s in group
                                        if s.first_token_time is not None), default=None),
               "num_preemptions": sum(seq.num_preemptions for seq in group)}
    if finished:
        metrics["finished_time"] = time.monotonic()
    return RequestOutput(
        request_id=leader.request_id, prompt=leader.prompt,
        prompt_token_ids=list(leader.prompt_token_ids), outputs=completions,
        finished=finished, num_cached_tokens=leader.num_cached_tokens or 0, metrics=metrics,
        kv_transfer_params=leader.kv_transfer_params if finished else None)
