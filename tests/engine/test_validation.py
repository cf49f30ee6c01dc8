"""Bad input raises ValueError naming the field and value, and leaves the engine clean."""

import json
import re
import os

import pytest

from jaxpage import LLM, SamplingParams


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -3), ("temperature", -0.1), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", 0), ("top_k", -2), ("min_p", 1.2), ("min_tokens", -1),
    ("n", 0), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", "x"),
])
def test_sampling_params_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens=5"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_prompt_errors_leave_no_request_behind(tiny_llm):
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate(["ok prompt", ""], params, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([{"prompt_token_ids": []}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=256"):
        tiny_llm.generate([{"prompt_token_ids": [5] * 300}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate([{"prompt_token_ids": [5, 10**9]}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        tiny_llm.generate(["a", "b", "c"], [params, params], use_tqdm=False)
    with pytest.raises(ValueError, match="must be a string"):
        tiny_llm.generate([42], params, use_tqdm=False)
    stats = tiny_llm.get_stats()
    assert stats["num_waiting"] == 0 and stats["num_free_blocks"] == stats["num_kv_blocks"]


def test_request_that_can_never_fit_the_cache_is_rejected(tiny_llm):
    # tiny_llm's cache holds every request of max_model_len 256: build one of 4 blocks.
    with pytest.raises(ValueError, match="KV blocks"):
        tiny = LLM(tiny_llm.llm_engine.config.model.model, max_model_len=256, num_kv_blocks=4,
                   block_size=8, max_num_seqs=4, max_num_batched_tokens=64)
        tiny.generate([{"prompt_token_ids": [5] * 10}], SamplingParams(max_tokens=100),
                      use_tqdm=False)


def test_unknown_model_path_and_architecture(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["GPT2LMHeadModel"]}, f)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(tmp_path))
    open(tmp_path / "weights.bin", "w").close()
    with pytest.raises(ValueError, match="not a .gguf"):
        LLM(os.path.join(tmp_path, "weights.bin"))


def test_engine_option_errors():
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(no_such_option=1)
    with pytest.raises(ValueError, match="block_size=12"):
        LLM(block_size=12)
    with pytest.raises(ValueError, match="dtype='int8'"):
        LLM(dtype="int8")


def test_max_model_len_beyond_the_model(tiny_checkpoints):
    with pytest.raises(ValueError, match="max_model_len=4096"):
        LLM(tiny_checkpoints["llama"], max_model_len=4096)


def test_a_stalled_scheduler_raises_instead_of_hanging(tiny_llm, monkeypatch):
    from jaxpage.core.sched.scheduler import SchedulerOutput

    engine = tiny_llm.llm_engine
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: SchedulerOutput())
    with pytest.raises(RuntimeError, match="no progress"):
        tiny_llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    monkeypatch.undo()
    stats = tiny_llm.get_stats()
    assert stats["num_waiting"] == 0 and stats["num_free_blocks"] == stats["num_kv_blocks"]
