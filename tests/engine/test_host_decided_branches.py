"""The sampling features decided on the host (what the CPU and a GPU run,
``core.batch.step_features``) give the same tokens and log-probabilities as the programs that
decide on the device (what a TPU runs).

Two engines on the CPU: one with ``runner.programs.host_decides_branches`` forced off, one with it
on (the CPU's default) and ``fixed_decode_length`` on as on a GPU: a batch of greedy and
plain sampling runs the host-picked program (``BASE_FEATURES``: no conditional inside, a
decode loop of known length at K=4), any other batch the program that decides on the
device. The requests mix greedy and seeded sampling, top-k / top-p / min-p, penalties,
log-probabilities, ``min_tokens`` and stops, and the longest samples plainly, so that
the batches change program as requests finish. The sampler's other host-decided features
are checked in ``tests/runtime/test_sampler_features.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxpage import LLM, SamplingParams
from jaxpage.core.batch.builder import BatchBuilder
from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.core.batch.step_features import (BASE_FEATURES, NO_FEATURES, StepFeatures,
                                        features_of)
from tests.default_suite import every_nth
from tests.engine.prompts import BASE
from tests.options import TINY

PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.8, frequency_penalty=0.5,
                   max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.7, min_p=0.1, seed=3, logprobs=2, max_tokens=14,
                   ignore_eos=True),
    SamplingParams(temperature=0, min_tokens=6, max_tokens=18, stop_token_ids=[5, 17, 33]),
    SamplingParams(temperature=0.9, seed=4, max_tokens=28, ignore_eos=True),
]


def _outputs(llm: LLM) -> list[tuple[list[int], list | None]]:
    prompts = [BASE[i % len(BASE)] for i in range(len(PARAMS))]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("steps", every_nth([4, 1], 2))  # single steps: slow
def test_host_decided_features_give_the_same_outputs(tiny_checkpoints, steps):
    path = tiny_checkpoints["llama"]
    device_decided = LLM(path, num_scheduler_steps=steps, **TINY)
    device_decided.llm_engine.runner.programs.host_decides_branches = False
    host_decided = LLM(path, num_scheduler_steps=steps, **TINY)
    runner = host_decided.llm_engine.runner
    programs = runner.programs
    assert programs.host_decides_branches  # the CPU's default
    programs.fixed_decode_length = True
    expected, got = _outputs(device_decided), _outputs(host_decided)
    for (ids, logprobs), (want_ids, want_logprobs) in zip(got, expected):
        assert ids == want_ids
        if want_logprobs is None:
            assert logprobs is None
            continue
        for step, want in zip(logprobs, want_logprobs):
            assert step.keys() == want.keys()
            for token in want:
                assert step[token].rank == want[token].rank
                assert abs(step[token].logprob - want[token].logprob) < 1e-5
    # the batches ran programs of several feature sets, none of them the device-decided one
    # batches of greedy or plain sampling ran the host-picked program, the others the one
    # that decides on the device
    used = programs.steps if steps == 1 else programs.decode_loops
    assert {key[1] for key in used} == {BASE_FEATURES, None}
    if steps > 1:  # every decode loop of known length, saved and shared under its own name
        assert all(key[2] for key in used)
        assert any(key.name.startswith("decode4+") and key.name.endswith("+fixed")
                   and key.fixed_length for key in runner.executables.programs())
    assert {key[1] for key in device_decided.llm_engine.runner.programs.steps} == {None}
    assert device_decided.llm_engine.num_used_blocks() == 0
    assert host_decided.llm_engine.num_used_blocks() == 0


def _batch(**fields):
    """An empty 4-row batch with ``fields`` (arrays of 4) written in."""
    builder = BatchBuilder(KVCacheManager(BlockPool(16), 4), max_num_batched_tokens=8,
                           max_num_seqs=4, max_model_len=32)
    batch = builder.empty(4, 4, 8)
    return batch.replaced(**{name: np.asarray(value, getattr(batch, name).dtype)
                             for name, value in fields.items()})


def test_features_read_off_the_batch():
    assert StepFeatures.of(_batch()) == NO_FEATURES
    assert StepFeatures.of(_batch()).suffix == ""
    greedy_top_k = _batch(top_k=[3, 0, 0, 0], top_p=[0.5, 1, 1, 1])
    assert StepFeatures.of(greedy_top_k) == NO_FEATURES  # top-k / top-p of a greedy row
    sampled = _batch(temperature=[0, 0.5, 0, 0], top_p=[1, 0.9, 1, 1])
    assert StepFeatures.of(sampled) == StepFeatures(True, True, False, False, False)
    assert StepFeatures.of(sampled).suffix == "+sampled+sort"
    assert StepFeatures.of(_batch(temperature=[0, 0, 0, 1.0])).suffix == "+sampled"
    rest = _batch(penalty_slot=[-1, 2, -1, -1], want_logprobs=[0, 0, 0, 1],
                  sample_index=[3, 0, 0, 0], min_tokens=[4, 0, 0, 0])
    assert StepFeatures.of(rest) == StepFeatures(False, False, True, True, True)
    assert StepFeatures.of(_batch(sample_index=[4, 0, 0, 0], min_tokens=[4, 0, 0, 0])) \
        == NO_FEATURES  # min_tokens reached
    # the one host-picked program: greedy and plain sampling; any other batch runs the
    # program that decides on the device (None), as every batch does on a TPU
    assert features_of(_batch(), static=True) == BASE_FEATURES
    assert features_of(_batch(temperature=[0, 0, 0, 1.0]), static=True) == BASE_FEATURES
    assert features_of(sampled, static=True) is None
    assert features_of(rest, static=True) is None
    assert features_of(_batch(), static=False) is None
