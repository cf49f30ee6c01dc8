"""Compiled programs saved by one process are loaded, not compiled, by the next one."""

import json
import os
import subprocess
import sys
from pathlib import Path

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


def start(checkpoint: str, cache: Path) -> dict:
    env = dict(os.environ, JAXPAGE_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", CHILD, checkpoint], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_second_start_loads_every_program(tiny_checkpoints, tmp_path):
    cold = start(tiny_checkpoints["llama"], tmp_path)
    warm = start(tiny_checkpoints["llama"], tmp_path)
    assert cold["compiled"] >= 2 and cold["loaded"] == 0   # prefill and multi-step decode
    assert warm == {**cold, "loaded": cold["compiled"], "compiled": 0}
    saved = list(tmp_path.glob("executables/*/*.bin"))
    assert len(saved) == cold["compiled"]
    for path in saved:  # a damaged file is recompiled, not trusted
        path.write_bytes(b"junk")
    again = start(tiny_checkpoints["llama"], tmp_path)
    assert again == {**cold, "loaded": 0}


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
