"""int8 / fp8 KV caches through ``LLM``: ~4x the blocks of float32 for the same memory,
SmolLM2's greedy tokens kept, preemption and prefix caching unchanged, bad values refused."""

import numpy as np
import pytest

from jaxpage import LLM, SamplingParams
from tests.options import FEW_BUCKETS
from tests.default_suite import SLOW

MEMORY = 8 * 2**20  # float32 SmolLM2: 11 blocks (below the 64 that 4 x 256 tokens can use)
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, **FEW_BUCKETS)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there was",
           "Water boils at"]


def _tokens(llm, prompts, max_tokens=16, **kw):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, **kw),
                        use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def float_run(smollm2_path):
    llm = LLM(smollm2_path, kv_cache_memory=MEMORY, **ENGINE)
    return llm.get_stats(), _tokens(llm, PROMPTS)


# int8 with the slow cases: the fused int8 cache's and int8 preemption's tests below run it
@pytest.mark.parametrize("kv_cache_dtype", [pytest.param("int8", marks=SLOW), "fp8"])
def test_byte_cache_holds_4x_the_blocks_and_keeps_greedy_tokens(smollm2_path, float_run,
                                                                 kv_cache_dtype):
    float_stats, float_tokens = float_run
    llm = LLM(smollm2_path, kv_cache_memory=MEMORY, kv_cache_dtype=kv_cache_dtype, **ENGINE)
    stats = llm.get_stats()
    assert stats["kv_cache_dtype"] == kv_cache_dtype
    cache = llm.llm_engine.runner.kv_cache
    assert all(array.dtype == np.uint8 for array in cache)
    # int8 adds a scale code per token, KV head and layer for keys and values
    # (kv_token_scale): [L, N, B, Hkv] twice, 2 bytes per token and head next to 2 x 64
    codes = 0
    if kv_cache_dtype == "int8":
        assert [array.shape for array in cache[2:]] == [cache[0].shape[:4]] * 2
        codes = 2 * 30 * 16 * 3   # SmolLM2: 30 layers, blocks of 16, 3 KV heads
    else:
        assert len(cache) == 2
    assert stats["kv_bytes_per_block"] == float_stats["kv_bytes_per_block"] // 4 + codes
    assert stats["num_kv_blocks"] >= (3.9 if codes else 4) * float_stats["num_kv_blocks"]
    ours = _tokens(llm, PROMPTS)
    assert sum(a[:8] == b[:8] for a, b in zip(ours, float_tokens)) >= 3, (ours, float_tokens)


def test_fused_int8_cache_keeps_the_codes_in_its_rows(smollm2_path, float_run, monkeypatch):
    """The TPU's fused layout (run here through the reference kernel): one uint8 array,
    a quarter of float32's bytes (the scale codes ride in the value bytes' parity,
    ``kv_token_scale.embedded``), nothing calibrated, SmolLM2's greedy tokens kept."""
    monkeypatch.setenv("JAXPAGE_KV_LAYOUT", "fused")
    float_stats, float_tokens = float_run
    llm = LLM(smollm2_path, kv_cache_memory=MEMORY, kv_cache_dtype="int8", **ENGINE)
    runner = llm.llm_engine.runner
    assert len(runner.kv_cache) == 1 and runner.kv_cache[0].dtype == np.uint8
    assert runner.kv_cache[0].shape[-1] == 3 * 2 * 64           # 3 KV heads' keys and values
    assert (np.asarray(runner.params["kv_scale"]) == 1).all()   # per-token: no calibration
    stats = llm.get_stats()
    assert stats["kv_bytes_per_block"] == float_stats["kv_bytes_per_block"] // 4
    ours = _tokens(llm, PROMPTS)
    assert sum(a[:8] == b[:8] for a, b in zip(ours, float_tokens)) >= 3, (ours, float_tokens)


def test_a_fused_int8_cache_needs_16_bytes_a_head(monkeypatch):
    monkeypatch.setenv("JAXPAGE_KV_LAYOUT", "fused")
    with pytest.raises(ValueError, match="head_dim=8 is too small"):
        LLM("preset:tiny-llama", hf_overrides={"head_dim": 8}, kv_cache_dtype="int8",
            **ENGINE)


def test_preemption_and_prefix_cache_with_int8_kv(tiny_checkpoints):
    prompts = ["a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2] * 3 + ["hello"]
    roomy = LLM(tiny_checkpoints["llama"], kv_cache_dtype="int8", num_kv_blocks=128,
                block_size=8, enable_prefix_caching=False, **ENGINE)
    want = _tokens(roomy, prompts, 24, ignore_eos=True)
    tight = LLM(tiny_checkpoints["llama"], kv_cache_dtype="int8", num_kv_blocks=24,
                block_size=8, **ENGINE)
    assert _tokens(tight, prompts, 24, ignore_eos=True) == want  # preempted, prefix-shared
    assert tight.get_stats()["num_preemptions"] > 0


def test_bad_kv_cache_dtype_is_refused(smollm2_path):
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        LLM(smollm2_path, kv_cache_dtype="int4", **ENGINE)
