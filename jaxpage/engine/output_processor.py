"""From accepted tokens to what users see: stop strings, text, streaming deltas.

Per sequence it remembers how far its text was searched for stop strings, where a stop
string cut it, and (for ``output_kind="delta"``) how many tokens and characters were
already sent. Invariants: a sequence's deltas concatenate to exactly the text and token
ids a ``"final"`` request would return; text is held back while its tail could still be
a partial UTF-8 character or the beginning of a stop string, so no delta ever has to be
taken back.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpage.core.request import Request, RequestStatus
from jaxpage.core.sched.scheduler import Scheduler
from jaxpage.engine.stop_strings import decode_output, find_stop_string
from jaxpage.outputs import CompletionOutput

REPLACEMENT_CHAR = "\ufffd"  # what decoding shows for an incomplete UTF-8 sequence


@dataclass
class _SequenceState:
    searched: int = 0           # characters of the text already searched for stop strings
    cut: int | None = None      # where a stop string cut the text
    sent_tokens: int = 0        # delta mode: output tokens already sent
    sent_chars: int = 0         # delta mode: characters of text already sent


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of unfinished ``text`` must not be sent yet."""
    hold = len(text) - len(text.rstrip(REPLACEMENT_CHAR))
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:size]):
                hold = size
                break
    return hold


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self._states: dict[str, _SequenceState] = {}

    def _state(self, request_id: str) -> _SequenceState:
        state = self._states.get(request_id)
        if state is None:
            state = self._states[request_id] = _SequenceState()
        return state

    def _text(self, request: Request) -> str:
        if self.tokenizer is None:
            return ""
        return decode_output(self.tokenizer, request)

    def check_stop_strings(self, request: Request) -> None:
        """Finish ``request`` (freeing its blocks) if its text now holds a stop string."""
        text = self._text(request)
        state = self._state(request.request_id)
        hit = find_stop_string(request, text, state.searched)
        state.searched = len(text)
        if hit is not None:
            request.stop_reason, state.cut = hit
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _finished_text(self, request: Request) -> str:
        text = self._text(request)
        cut = self._state(request.request_id).cut
        return text if cut is None else text[:cut]

    def final(self, index: int, request: Request) -> CompletionOutput:
        """The whole output of a finished sequence; its state is dropped."""
        text = self._finished_text(request)
        self.forget(request.request_id)
        return CompletionOutput(
            index=index, text=text, token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason, stop_reason=request.stop_reason)

    def delta(self, index: int, request: Request) -> CompletionOutput | None:
        """What is new in the sequence since its last delta; None if nothing is.

        A finished sequence gets one last delta (with ``finish_reason``) and its state is
        dropped.
        """
        state = self._state(request.request_id)
        finished = request.is_finished
        if finished:
            text = self._finished_text(request)
            safe = len(text)
        else:
            text = self._text(request)
            safe = len(text) - held_back(text, request.sampling_params.stop)
        new_tokens = request.all_token_ids[request.num_prompt_tokens + state.sent_tokens:]
        new_text = text[state.sent_chars:safe] if safe > state.sent_chars else ""
        if not new_tokens and not new_text and not finished:
            return None
        state.sent_tokens = request.num_output_tokens
        state.sent_chars = max(state.sent_chars, safe)
        if finished:
            self.forget(request.request_id)
        return CompletionOutput(
            index=index, text=new_text, token_ids=list(new_tokens),
            finish_reason=request.status.finish_reason if finished else None,
            stop_reason=request.stop_reason if finished else None)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
