"""The compiled step and decode-loop programs update the KV cache in place.

With the layers unrolled, XLA once copied the whole cache twice per layer inside the
decode loop of a single sequence (one token per step) and around reshapes of the cache.
Each copy is as large as the cache, so this is checked on the optimized programs the
engine actually ran, not on timings: with the fused C++ CPU call (``"auto"`` here) and
with the XLA scatter + attention structure that GPUs and TPUs run (``"reference"``).
"""

from __future__ import annotations

import pytest

from jaxpage import LLM, SamplingParams
from tests.kernels.test_write_and_attend import _cache_copies
from tests.options import TINY


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_step_and_decode_programs_copy_no_cache(backend, tiny_checkpoints):
    # powers-of-two buckets: three sequences decode in the (4, 4) bucket checked below
    tiny_llm = LLM(tiny_checkpoints["llama"], **{**TINY, "bucket_growth": 2},
                   attention_backend=backend)
    engine = tiny_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 6, 7], [8, 9], [10])]
    tiny_llm.generate(prompts[:1], params, use_tqdm=False)                 # one sequence
    tiny_llm.generate(prompts, params, use_tqdm=False)                     # three
    cache_shape = tuple(engine.runner.kv_cache[0].shape)
    programs = {key: program for key, program in engine.runner.executables.programs().items()
                if key.kind in ("step", "step-masked", "decode")}
    names = {key.name for key in programs}
    assert any(name.startswith("step") for name in names), names
    assert any(name.startswith("decode") for name in names), names
    buckets = {key.bucket[:2] for key in programs if key.kind == "decode"}
    seats = engine.batch_builder.decode_seats(4)                 # 8 (4 rows pad to 8)
    assert (1, 1) in buckets and (seats, seats) in buckets, buckets   # decodes at T = S
    for key, program in programs.items():
        assert not _cache_copies(program.as_text(), cache_shape), key
