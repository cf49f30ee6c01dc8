"""Stream one prompt's text as it is generated (``jaxpage generate``).

With the engine's delta outputs (``SamplingParams(output_kind="delta")``) each step's new
text is yielded as soon as the step returns; an engine without them yields the whole
text at the end. The request is aborted if the consumer stops early (Ctrl-C).
"""

from __future__ import annotations

from typing import Any, Iterator

from jaxpage.sampling_params import SamplingParams


def stream_generate(llm, prompt: str, params: dict[str, Any], *, chat: bool = False) -> Iterator[str]:
    engine = llm.llm_engine
    params = dict(params, output_kind="delta")
    sampling = SamplingParams(**params)
    if chat:
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError("--chat needs a tokenizer, and this model has none")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                            return_dict=True, add_generation_prompt=True)["input_ids"]
        prompt_input: Any = {"prompt_token_ids": list(ids)}
    else:
        prompt_input = prompt
    request_id = engine.add_request(None, prompt_input, sampling)
    finished = False
    try:
        while not finished and engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                if output.outputs and output.outputs[0].text:
                    yield output.outputs[0].text
                finished = finished or output.finished
    finally:
        if not finished:
            engine.abort_request(request_id)
