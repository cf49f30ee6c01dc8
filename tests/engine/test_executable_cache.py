"""Compiled programs saved by one process are loaded, not compiled, by the next one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
from jaxpage import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
          block_size=8, num_kv_blocks=24, num_scheduler_steps=4, bucket_growth=4096)
outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9] * 11}],
                    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
programs = llm.llm_engine.runner.executables
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "loaded": programs.num_loaded, "compiled": programs.num_compiled}))
"""


# warmup="ready": the ready set before the engine returns, the rest in the background
CHILD_READY = """
import json, sys, threading
from jaxpage import LLM, SamplingParams
from jaxpage.runtime import background_compile
llm = LLM(sys.argv[1], max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
          block_size=8, num_kv_blocks=24, num_scheduler_steps=4, bucket_growth=4096,
          warmup="ready")
outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9] * 11}],
                    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
done = threading.Event()
background_compile.submit(done.set)
assert done.wait(600)
runner = llm.llm_engine.runner
programs = runner.executables
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "loaded": programs.num_loaded, "compiled": programs.num_compiled,
                  "held": len(programs.programs()), "fallback_off": runner.fallback is None}))
"""


def start(checkpoint: str, cache: Path, child: str = CHILD) -> dict:
    env = dict(os.environ, JAXPAGE_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", child, checkpoint], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_second_start_loads_every_program(tiny_checkpoints, tmp_path):
    cold = start(tiny_checkpoints["llama"], tmp_path)
    warm = start(tiny_checkpoints["llama"], tmp_path)
    assert cold["compiled"] >= 2 and cold["loaded"] == 0   # prefill and multi-step decode
    assert warm == {**cold, "loaded": cold["compiled"], "compiled": 0}
    saved = sorted(tmp_path.glob("executables/*/*.bin"))
    assert len(saved) == cold["compiled"]
    saved[0].write_bytes(b"junk")  # a damaged file is recompiled, not trusted; the rest load
    again = start(tiny_checkpoints["llama"], tmp_path)
    assert again == {**cold, "loaded": cold["compiled"] - 1, "compiled": 1}
    assert saved[0].read_bytes() != b"junk"  # and replaced


@pytest.mark.slow  # ~30 s: two starts; the plain second start above is the default suite's
def test_a_ready_engine_second_start_compiles_nothing(tiny_checkpoints, tmp_path):
    """``warmup="ready"``, twice with one cache: the first start compiles its whole program
    set (the ready set, then the rest in the background), the second loads every one."""
    cold = start(tiny_checkpoints["llama"], tmp_path, CHILD_READY)
    warm = start(tiny_checkpoints["llama"], tmp_path, CHILD_READY)
    assert cold["fallback_off"] and cold["compiled"] == cold["held"] and cold["loaded"] == 0
    assert warm == {**cold, "loaded": cold["held"], "compiled": 0}


def test_an_engine_like_another_runs_its_programs_without_compiling(tiny_llm, tiny_checkpoints):
    """Engines of the same model, options and device share compiled programs in memory."""
    from jaxpage import LLM, SamplingParams
    from tests.options import TINY

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [11, 12, 13, 14, 15]}]
    first = tiny_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    twin = LLM(tiny_checkpoints["llama"], **TINY)
    assert twin.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == first
    programs = twin.llm_engine.runner.executables
    assert programs.num_shared >= 2 and programs.num_compiled == 0
    other = LLM(tiny_checkpoints["llama"], **{**TINY, "num_kv_blocks": 100})  # other shapes
    other.generate(prompt, params, use_tqdm=False)
    assert other.llm_engine.runner.executables.num_shared == 0


def test_a_prefetched_program_is_built_once_in_the_background(tmp_path):
    """``prefetch`` compiles from shapes alone on the background thread; ``get`` then
    hands back that program (waiting for it if needed) instead of compiling again."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpage.core.batch.program_set import ProgramKey
    from jaxpage.runtime.executable_cache import ExecutableCache

    cache = ExecutableCache(tmp_path, "prefetch-test")
    key = ProgramKey("f", (2, 3, 4))
    jitted = jax.jit(lambda x, y: x @ y + 1.0)
    x = jnp.arange(6.0).reshape(2, 3)
    y = np.ones((3, 4), np.float32)
    shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), y)
    assert cache.prefetch(key, jitted, shapes)
    assert not cache.prefetch(key, jitted, shapes)   # already on its way
    program = cache.get(key, jitted, (x, y))
    assert cache.num_compiled == 1 and cache.num_prefetched == 1
    np.testing.assert_array_equal(np.asarray(program(x, y)), np.asarray(x) @ y + 1.0)
    assert cache.get(key, jitted, (x, y)) is program


def test_a_failed_background_build_is_redone_by_the_caller(tmp_path):
    import jax
    import jax.numpy as jnp

    from jaxpage.core.batch.program_set import ProgramKey
    from jaxpage.runtime.executable_cache import ExecutableCache

    cache = ExecutableCache(None, "prefetch-fail")
    key = ProgramKey("g", (2,))
    jitted = jax.jit(lambda x: x * 2)
    wrong = (jax.ShapeDtypeStruct((2, 2), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.int32))
    cache.prefetch(key, jitted, wrong)       # two arguments for one: fails to lower
    x = jnp.ones(2)
    program = cache.get(key, jitted, (x,))
    assert list(program(x)) == [2.0, 2.0] and cache.num_prefetched == 0


def test_compile_ahead_builds_the_drain_programs_and_changes_no_token(tiny_checkpoints):
    """With ``compile_ahead`` the decode programs of the smaller batches a workload drains
    into are built on the background thread before the engine needs them, and every
    token is what the engine without it produces."""
    from jaxpage import LLM, SamplingParams

    options = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, block_size=8,
                   num_kv_blocks=40, num_scheduler_steps=4)
    prompts = [{"prompt_token_ids": [3 + i, 7, 11 + i]} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=2 + 5 * i, ignore_eos=True)
              for i in range(5)]
    ahead = LLM(tiny_checkpoints["llama"], compile_ahead=True, **options)
    got = [o.outputs[0].token_ids for o in ahead.generate(prompts, params, use_tqdm=False)]
    programs = ahead.llm_engine.runner.executables
    # greedy decodes: the host-picked program of greedy and plain sampling
    decodes = {key.bucket for key in programs.programs() if key.name == "decode4+sampled"}
    assert programs.num_prefetched >= 2 and len(decodes) >= 2
    plain = LLM(tiny_checkpoints["llama"], compile_ahead=False, **options)
    assert plain.llm_engine.device_calls.drain_programs is None
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize("variable", ["XLA_FLAGS", "LIBTPU_INIT_ARGS",
                                      "JAXPAGE_GPU_DECODE_DOT_MERGER_MB"])
def test_programs_built_under_other_compiler_flags_are_not_loaded(monkeypatch, variable):
    """The compiler's flags change the code it emits: executables saved under other flags
    live in another directory (a run comparing flags once loaded the first run's)."""
    import jax.numpy as jnp

    from jaxpage.runtime.executable_cache import fingerprint

    params = {"w": jnp.zeros((4, 4), jnp.float32)}
    monkeypatch.delenv(variable, raising=False)
    plain = fingerprint(params)
    assert fingerprint(params) == plain
    monkeypatch.setenv(variable, "--xla_gpu_enable_command_buffer=")
    flagged = fingerprint(params)
    assert flagged != plain
    monkeypatch.setenv(variable, "--xla_gpu_graph_min_graph_size=1")
    assert fingerprint(params) not in (plain, flagged)


def test_programs_built_under_another_attention_tuning_are_not_loaded(monkeypatch, tmp_path):
    """The GPU kernel's tilings change the programs: the file
    ``JAXPAGE_GPU_ATTENTION_TUNING`` names is part of the fingerprint by its contents."""
    import jax.numpy as jnp

    from jaxpage.runtime.executable_cache import fingerprint

    params = {"w": jnp.zeros((4, 4), jnp.float32)}
    monkeypatch.delenv("JAXPAGE_GPU_ATTENTION_TUNING", raising=False)
    plain = fingerprint(params)
    table = tmp_path / "tuning.json"
    table.write_text('{"entries": []}')
    monkeypatch.setenv("JAXPAGE_GPU_ATTENTION_TUNING", str(table))
    tuned = fingerprint(params)
    assert tuned != plain and fingerprint(params) == tuned
    table.write_text('{"entries": [{"phase": "decode", "config": {"block_kv": 128}}]}')
    assert fingerprint(params) not in (plain, tuned)
