"""The engine's options as command-line flags (``jaxpage serve | generate | plan``).

Each ``LLM`` keyword argument is a flag (``max_num_seqs`` -> ``--max-num-seqs``), with
vLLM's names for the options jaxpage names otherwise, vLLM's boolean forms (a bare
``--enable-prefix-caching`` is true, ``--no-enable-prefix-caching`` false) and vLLM's
flags that change nothing here (accepted, logged as having no effect).
"""

from __future__ import annotations

import argparse
import json


def parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def _warmup(text: str) -> bool | str:
    if text.lower() in ("ready", "core"):
        return text.lower()
    try:
        return parse_bool(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false, ready or core") from None


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


ENGINE_FLAGS = {
    "dtype": (str, "compute dtype: auto (default: the checkpoint's on GPUs and TPUs, float32 "
                   "on the CPU), float32, bfloat16, float16"),
    "revision": (str, "Hub model id: the branch, tag or commit to use (default: main)"),
    "download_dir": (str, "Hub model id: the cache directory to download into and read from "
                          "(default: the Hugging Face cache, HF_HOME)"),
    "load_format": (str, "auto, safetensors or gguf (checked against the model)"),
    "generation_config": (str, "auto (default: generation_config.json's sampling defaults for "
                               "requests that set none), vllm (none) or a directory"),
    "max_model_len": (int, "context length (default: the model's)"),
    "max_num_seqs": (int, "most sequences in one step"),
    "max_num_batched_tokens": (int, "token budget of one step (long prompts are chunked)"),
    "block_size": (int, "tokens per KV block"),
    "num_kv_blocks": (int, "KV blocks (default: sized from --kv-cache-memory)"),
    "kv_cache_memory": (int, "bytes for the KV cache when --num-kv-blocks is unset"),
    "memory_utilization": (float, "share of device memory to use (devices with memory stats)"),
    "enable_prefix_caching": (parse_bool, "reuse KV blocks of shared prompt prefixes (true/false)"),
    "kv_cache_dtype": (str, "auto (model dtype), int8, fp8 (e4m3) or fp8_e5m2: one byte per "
                       "cached element"),
    "swap_space": (float, "GiB of host memory for swapped-out KV blocks"),
    "scheduling_policy": (str, "fcfs or priority"),
    "priority_aging_steps": (int, "steps of waiting that improve a priority by one"),
    "preemption_mode": (str, "recompute, swap or auto"),
    "long_prefill_token_threshold": (int, "most prompt tokens one request takes a step (0: off)"),
    "num_scheduler_steps": (int, "decode iterations per device call when all decode"),
    "bucket_growth": (int, "factor between bucket rungs (2: powers of two; larger: fewer programs)"),
    "quantization": (str, "int8, int4, fp8 (W8A8 where the GPU has FP8) or gguf (keep a GGUF "
                     "file's Q8_0/Q4_0/Q4_1 blocks); pre-quantized checkpoints "
                     "(compressed-tensors, fp8, awq, gptq) are detected"),
    "quantization_group_size": (int, "int8 / int4: input rows per scale (default 32; 0: per output channel)"),
    "hf_overrides": (json_object, "JSON object of Hugging Face config keys to replace"),
    "speculative_config": (json_object, "speculative decoding as a JSON object, e.g. "
                           "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'"),
    "max_waiting_requests": (int, "server: answer 503 when this many requests wait (default: no cap)"),
    "seed": (int, "engine seed for requests without their own"),
    "enable_lora": (parse_bool, "serve PEFT LoRA adapters (true/false; on with --lora-modules)"),
    "max_loras": (int, "LoRA adapters on the device at once (one batch may mix them)"),
    "max_lora_rank": (int, "largest LoRA rank accepted"),
    "max_cpu_loras": (int, "LoRA adapters kept in host memory (default: every one loaded)"),
    "kv_role": (str, "disaggregated serving: prefill or decode (see `jaxpage proxy`)"),
    "kv_transfer_timeout": (float, "decode instance: seconds to wait for a request's KV pages"),
    "attention_backend": (str, "auto, reference, cpu (C++ kernel), gpu or tpu"),
    "compilation_cache": (parse_bool, "save compiled programs for the next start (true/false)"),
    "weight_cache": (parse_bool, "keep GGUF weights converted for the next start (true/false)"),
    "warmup": (_warmup, "programs compiled at start-up: true (every bucket), ready (the "
                        "few that run any batch padded; the rest in the background), core "
                        "(a full prefill step and the decode programs, unless saved) or "
                        "false (default: ready on accelerators, core on the CPU)"),
    "async_scheduling": (parse_bool, "dispatch the next call before processing the last one's tokens (true/false)"),
    "cpu_compute_niceness": (int, "CPU backend: nice value of XLA's compute threads, so the host loop gets a core first (0..19; 0: unchanged; default 10)"),
    "compile_ahead": (parse_bool, "build the decode programs of smaller batches in the background (true/false; default: on accelerators only)"),
    "tensor_parallel_size": (int, "devices per model replica (sharded Megatron-style)"),
    "data_parallel_size": (int, "model replicas on disjoint device groups"),
    "coordinator_address": (str, "host:port of process 0 (several processes / hosts)"),
    "num_processes": (int, "processes in the job (same command on each)"),
    "process_id": (int, "this process's rank; 0 runs the scheduler"),
}


# vLLM's names for options jaxpage names otherwise (both are accepted).
VLLM_ALIASES = {"memory_utilization": ("--gpu-memory-utilization",),
                "num_kv_blocks": ("--num-gpu-blocks-override",),
                "kv_cache_memory": ("--kv-cache-memory-bytes",)}
# vLLM flags that change nothing here (accepted so that a vLLM command line runs; each is
# logged as having no effect when given).
NO_EFFECT_FLAGS = {"trust_remote_code": "jaxpage runs no code from checkpoints",
                   "enforce_eager": "jaxpage has no CUDA graphs to turn off",
                   "disable_log_requests": "jaxpage does not log requests",
                   "disable_log_stats": "jaxpage does not log periodic stats"}


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options (LLM keyword arguments)")
    group.add_argument("--tokenizer", default=None, help="tokenizer directory, .gguf file or "
                                                         "Hub id")
    group.add_argument("--config", default=None, help="TOML file of engine options")
    for name, (kind, help_text) in ENGINE_FLAGS.items():
        group.add_argument(flag_name(name), *VLLM_ALIASES.get(name, ()), dest=name, type=kind,
                           default=None, help=help_text + (
                               " (bare: true; --no-... : false)" if kind is parse_bool else ""))
    ignored = parser.add_argument_group("vLLM flags that change nothing here")
    for name, why in NO_EFFECT_FLAGS.items():
        ignored.add_argument(flag_name(name), dest=name, type=parse_bool, default=None, help=why)


_BOOL_WORDS = ("1", "true", "yes", "on", "0", "false", "no", "off")


def normalize_bool_flags(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's boolean flag forms in ``argv``: a bare ``--enable-prefix-caching`` means true
    and ``--no-enable-prefix-caching`` false; ``--flag true|false`` keeps working."""
    flags = {option for action in _all_actions(parser) if action.type is parse_bool
             for option in action.option_strings}
    out: list[str] = []
    for i, token in enumerate(argv):
        if token.startswith("--no-") and "--" + token[5:] in flags:
            out += ["--" + token[5:], "false"]
        elif token in flags and (i + 1 == len(argv) or argv[i + 1].lower() not in _BOOL_WORDS):
            out += [token, "true"]
        else:
            out.append(token)
    return out


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                actions += _all_actions(sub)
    return actions
