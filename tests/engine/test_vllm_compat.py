"""What a vLLM user types keeps working: vLLM's flag names and boolean forms, ``dtype="auto"``
per platform, and the checkpoint's generation-config sampling defaults."""

from __future__ import annotations

import json

import pytest

from jaxpage.cli import build_parser, normalize_bool_flags
from jaxpage.engine.startup.generation_config import generation_defaults
from jaxpage.models.loader import auto_dtype


def _parse(*argv):
    parser = build_parser()
    return parser.parse_args(normalize_bool_flags(list(argv), parser))


def test_vllm_serve_flags_parse():
    args = _parse("serve", "meta-llama/Llama-3.1-8B-Instruct", "--gpu-memory-utilization", "0.85",
                  "--enable-prefix-caching", "--enable-lora", "--chat-template", "t.jinja",
                  "--generation-config", "vllm", "--enable-auto-tool-choice",
                  "--tool-call-parser", "hermes", "--download-dir", "/d", "--revision", "main",
                  "--load-format", "safetensors", "--max-model-len", "8192", "--dtype", "auto",
                  "--trust-remote-code", "--disable-log-requests", "--num-gpu-blocks-override",
                  "100", "--kv-cache-memory-bytes", "1000000")
    assert args.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert args.memory_utilization == 0.85 and args.enable_prefix_caching is True
    assert args.enable_lora is True and args.chat_template == "t.jinja"
    assert args.generation_config == "vllm" and args.enable_auto_tool_choice is True
    assert args.tool_call_parser == "hermes" and args.download_dir == "/d"
    assert args.revision == "main" and args.load_format == "safetensors"
    assert args.trust_remote_code is True and args.num_kv_blocks == 100
    assert args.kv_cache_memory == 1000000


def test_boolean_flags_in_every_form():
    assert _parse("serve", "--no-enable-prefix-caching").enable_prefix_caching is False
    assert _parse("serve", "--enable-prefix-caching", "false").enable_prefix_caching is False
    assert _parse("serve", "--enable-prefix-caching", "m").enable_prefix_caching is True
    args = _parse("serve", "--enable-prefix-caching", "--max-num-seqs", "4")
    assert args.enable_prefix_caching is True and args.max_num_seqs == 4
    assert _parse("generate", "hi", "--no-compilation-cache").compilation_cache is False
    assert _parse("serve").enable_prefix_caching is None  # unset: the engine's default


def test_auto_tool_choice_needs_its_parser(capsys):
    from jaxpage.cli import main

    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    assert main(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "nope"]) == 2
    assert "hermes" in capsys.readouterr().err


@pytest.mark.parametrize("saved,config,platform,expected", [
    (None, {"torch_dtype": "bfloat16"}, "cpu", "float32"),
    (None, {"torch_dtype": "bfloat16"}, "gpu", "bfloat16"),
    (None, {"torch_dtype": "float16"}, "gpu", "float16"),
    (None, {"dtype": "float16"}, "tpu", "bfloat16"),
    (None, {"torch_dtype": "float32"}, "gpu", "bfloat16"),
    (None, {}, "tpu", "bfloat16"),
    ("float16", {"torch_dtype": "bfloat16"}, "gpu", "float16"),
])
def test_dtype_auto_per_platform(saved, config, platform, expected):
    assert auto_dtype(saved, config, platform) == expected


def test_dtype_auto_is_the_default_and_float32_on_the_cpu(tiny_llm):
    assert tiny_llm.llm_engine.config.model.dtype == "auto"
    assert str(tiny_llm.llm_engine.runner.dtype) == "float32"


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
         "max_new_tokens": 512, "bos_token_id": 1}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9,
                                                  "top_k": 20, "max_tokens": 512}
    assert generation_defaults(str(tmp_path), "vllm") == {}
    assert generation_defaults(None) == {}
    other = tmp_path / "other"
    other.mkdir()
    assert generation_defaults(None, str(tmp_path)) == generation_defaults(str(tmp_path))
    with pytest.raises(ValueError, match="generation_config='nowhere'"):
        generation_defaults(str(other), "nowhere")
