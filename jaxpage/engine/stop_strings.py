"""Stop strings, checked on the host against the decoded text of each request."""

from __future__ import annotations

from jaxpage.core.request import Request


def decode_output(tokenizer, request: Request) -> str:
    return tokenizer.decode(request.output_token_ids,
                            skip_special_tokens=request.sampling_params.skip_special_tokens)


def find_stop_string(request: Request, text: str, searched_upto: int) -> tuple[str, int] | None:
    """The first stop string in ``text`` that ends after ``searched_upto``, and where to cut.

    Only the part of the text that could contain a new match is searched. The cut keeps
    the stop string when ``include_stop_str_in_output``.
    """
    params = request.sampling_params
    best: tuple[int, str] | None = None
    for stop in params.stop:
        start = max(0, searched_upto - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    return stop, index + len(stop) if params.include_stop_str_in_output else index
