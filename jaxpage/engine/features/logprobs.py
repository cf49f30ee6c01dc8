"""Per-token log-probabilities of generated tokens, kept on the host until output time.

The device returns, for every sampled token of a request that asked for ``logprobs``,
the sampled token's logprob and rank and the top ``MAX_TOP_LOGPROBS`` of the raw model
distribution. ``LogprobsRecorder.record`` is called once per accepted output token, so a
request's list always has exactly one entry per token of ``output_token_ids`` (tokens
dropped after a stop were never accepted; recompute preemption keeps outputs and
entries alike).
"""

from __future__ import annotations

from jaxpage.core.request import Request
from jaxpage.outputs import CompletionOutput, Logprob, SampleLogprobs
from jaxpage.core.sched.step_result import StepResult


class LogprobsRecorder:
    def __init__(self, decode_one) -> None:
        self._decode_one = decode_one     # token id -> its text
        self._entries: dict[str, SampleLogprobs] = {}
        self._cumulative: dict[str, float] = {}

    def record(self, request: Request, result: StepResult, row: int,
               step: int | None = None) -> None:
        """Store the entry of ``request``'s newest output token (batch row ``row``; ``step``
        indexes the leading axis of a multi-step result)."""
        want = request.sampling_params.logprobs
        if want is None or result.token_logprobs is None:
            return
        at = (row,) if step is None else (step, row)
        token = request.last_token_id
        logprob = float(result.token_logprobs[at])
        entry = {token: Logprob(logprob, int(result.token_ranks[at]), self._decode_one(token))}
        ids = result.top_ids[at][:want].tolist()
        values = result.top_logprobs[at][:want].tolist()
        for rank, (token_id, value) in enumerate(zip(ids, values), start=1):
            if token_id not in entry:
                entry[token_id] = Logprob(value, rank, self._decode_one(token_id))
        self._entries.setdefault(request.request_id, []).append(entry)
        self._cumulative[request.request_id] = self._cumulative.get(request.request_id, 0.0) + logprob

    def get(self, request: Request, start: int = 0) -> tuple[SampleLogprobs | None, float | None]:
        """(entries from output token ``start`` on, cumulative logprob), or (None, None)
        when the request did not ask for logprobs."""
        if request.sampling_params.logprobs is None:
            return None, None
        entries = self._entries.get(request.request_id, [])
        return entries[start:], self._cumulative.get(request.request_id, 0.0)

    def attach(self, output: CompletionOutput | None, request: Request) -> CompletionOutput | None:
        """Fill ``output``'s logprobs (for its ``token_ids``, the newest of ``request``'s
        outputs: all of them for a final output, the new ones for a delta) in place."""
        if output is None:
            return None
        start = request.num_output_tokens - len(output.token_ids)
        output.logprobs, output.cumulative_logprob = self.get(request, start)
        return output

    def forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)
        self._cumulative.pop(request_id, None)
