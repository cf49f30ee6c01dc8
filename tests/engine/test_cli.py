"""`jaxpage generate` end to end on a tiny checkpoint."""

import pytest

from jaxpage import LLM, SamplingParams
from jaxpage.cli import main


def test_generate_prints_the_greedy_completion(tiny_checkpoints, capsys, tmp_path):
    path = tiny_checkpoints["llama"]
    config = tmp_path / "engine.toml"
    config.write_text("[scheduler]\nmax_num_seqs = 4\nmax_num_batched_tokens = 64\n"
                      "[cache]\nblock_size = 8\nnum_kv_blocks = 64\n")
    assert main(["generate", "Hello, my name is", "--model", path, "--max-tokens", "8",
                 "--max-model-len", "256", "--config", str(config)]) == 0
    printed = capsys.readouterr().out.strip()
    llm = LLM(path, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
              num_kv_blocks=64)
    want = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0].text
    assert printed == want.strip()


def test_bad_option_exits_2_with_a_message(capsys):
    assert main(["generate", "hi", "--model", "/nonexistent/model"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_warmup_option_takes_true_false_or_core(capsys):
    from jaxpage.cli import build_parser

    parser = build_parser()
    for text, value in (("core", "core"), ("true", True), ("off", False)):
        args = parser.parse_args(["generate", "hi", "--warmup", text])
        assert args.warmup == value
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["generate", "hi", "--warmup", "fast"])
    assert exited.value.code == 2
    assert "'fast' is not true, false, ready or core" in capsys.readouterr().err
