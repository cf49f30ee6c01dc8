"""Command line: ``jaxpage serve`` (the OpenAI-compatible server), ``jaxpage generate`` and
``jaxpage plan`` (compile for a TPU or GPU target without one, and size it).

Engine options mirror ``LLM``'s keyword arguments (``--max-num-seqs`` is
``max_num_seqs``); ``--config FILE.toml`` reads them from a file like
``configs/engine.toml``, and flags given on the command line win. With no model, the
embedded default (SmolLM2-135M-Instruct) is used. ``jaxpage serve --help`` and
``jaxpage generate --help`` list every option.
"""

from __future__ import annotations

import argparse
import json
import sys


def _bool(text: str) -> bool:
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
        return _bool(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false, ready or core") from None


def _json_object(text: str) -> dict:
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
    "enable_prefix_caching": (_bool, "reuse KV blocks of shared prompt prefixes (true/false)"),
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
    "hf_overrides": (_json_object, "JSON object of Hugging Face config keys to replace"),
    "speculative_config": (_json_object, "speculative decoding as a JSON object, e.g. "
                           "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'"),
    "max_waiting_requests": (int, "server: answer 503 when this many requests wait (default: no cap)"),
    "seed": (int, "engine seed for requests without their own"),
    "enable_lora": (_bool, "serve PEFT LoRA adapters (true/false; on with --lora-modules)"),
    "max_loras": (int, "LoRA adapters on the device at once (one batch may mix them)"),
    "max_lora_rank": (int, "largest LoRA rank accepted"),
    "max_cpu_loras": (int, "LoRA adapters kept in host memory (default: every one loaded)"),
    "kv_role": (str, "disaggregated serving: prefill or decode (see `jaxpage proxy`)"),
    "kv_transfer_timeout": (float, "decode instance: seconds to wait for a request's KV pages"),
    "attention_backend": (str, "auto, reference, cpu (C++ kernel), gpu or tpu"),
    "compilation_cache": (_bool, "save compiled programs for the next start (true/false)"),
    "weight_cache": (_bool, "keep GGUF weights converted for the next start (true/false)"),
    "warmup": (_warmup, "programs compiled at start-up: true (every bucket), ready (the "
                        "few that run any batch padded; the rest in the background), core "
                        "(a full prefill step and the decode programs, unless saved) or "
                        "false (default: ready on accelerators, core on the CPU)"),
    "async_scheduling": (_bool, "dispatch the next call before processing the last one's tokens (true/false)"),
    "cpu_compute_niceness": (int, "CPU backend: nice value of XLA's compute threads, so the host loop gets a core first (0..19; 0: unchanged; default 10)"),
    "compile_ahead": (_bool, "build the decode programs of smaller batches in the background (true/false; default: on accelerators only)"),
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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options (LLM keyword arguments)")
    group.add_argument("--tokenizer", default=None, help="tokenizer directory, .gguf file or "
                                                         "Hub id")
    group.add_argument("--config", default=None, help="TOML file of engine options")
    for name, (kind, help_text) in ENGINE_FLAGS.items():
        group.add_argument(_flag(name), *VLLM_ALIASES.get(name, ()), dest=name, type=kind,
                           default=None, help=help_text + (
                               " (bare: true; --no-... : false)" if kind is _bool else ""))
    ignored = parser.add_argument_group("vLLM flags that change nothing here")
    for name, why in NO_EFFECT_FLAGS.items():
        ignored.add_argument(_flag(name), dest=name, type=_bool, default=None, help=why)


_BOOL_WORDS = ("1", "true", "yes", "on", "0", "false", "no", "off")


def normalize_bool_flags(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's boolean flag forms in ``argv``: a bare ``--enable-prefix-caching`` means true
    and ``--no-enable-prefix-caching`` false; ``--flag true|false`` keeps working."""
    flags = {option for action in _all_actions(parser) if action.type is _bool
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{serve,generate,plan,proxy}")
    serve = commands.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "/metrics, /tokenize and /detokenize.")
    serve.add_argument("model", nargs="?", default=None,
                       help="HF checkpoint directory or .gguf file (default: embedded SmolLM2)")
    serve.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None,
                       help="model name clients use (default: the model path's name)")
    serve.add_argument("--log-level", default="info",
                       help="jaxpage's log level (start-up facts at info) and uvicorn's")
    serve.add_argument("--uvicorn-log-level", default=None, help="uvicorn's own log level "
                                                                "(default: --log-level)")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one, instead of the "
                            "tokenizer's")
    serve.add_argument("--enable-auto-tool-choice", type=_bool, default=False,
                       help="tool_choice \"auto\": parse tool calls out of free output "
                            "(needs --tool-call-parser)")
    serve.add_argument("--tool-call-parser", default=None,
                       help="hermes (Qwen2/Qwen3, Hermes), llama3_json (Llama 3.x) or mistral")
    serve.add_argument("--lora-modules", nargs="+", default=None, type=_lora_module,
                       metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) served under NAME as the "
                            "request's model; implies --enable-lora true")
    serve.add_argument("--disaggregated", default=None, metavar="NPMD",
                       help="start N prefill and M decode instances of this model on this "
                            "host (e.g. 1P1D) and serve the proxy on --host/--port")
    _add_engine_flags(serve)

    proxy = commands.add_parser(
        "proxy", help="one OpenAI front for prefill and decode instances",
        description="Route each request to a prefill instance (prompt and first token), "
                    "then to a decode instance that pulls the KV pages and generates the "
                    "rest (instances started with `jaxpage serve --kv-role ...`).")
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                       help="prefill instances, e.g. http://127.0.0.1:8100")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL",
                       help="decode instances, e.g. http://127.0.0.1:8200")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on")
    proxy.add_argument("--log-level", default="info", help="uvicorn log level")
    proxy.add_argument("--max-imbalance", type=int, default=8, metavar="N",
                       help="requests in flight an instance that recently took a request's "
                            "prefix may be ahead of the least loaded one and still get it")

    gen = commands.add_parser("generate", help="generate a completion for one prompt, streamed",
                              description="Generate for one prompt, printing text as it comes.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None,
                     help="HF checkpoint directory or .gguf file (default: embedded SmolLM2)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=-1, help="-1 disables top-k")
    gen.add_argument("--sample-seed", type=int, default=None, help="seed of this request")
    gen.add_argument("--log-level", default="info", help="jaxpage's log level (to stderr)")
    _add_engine_flags(gen)

    plan = commands.add_parser(
        "plan", help="compile for a TPU/GPU target without one; memory and KV capacity",
        description="Compile every program of the engine for a target that is not there "
                    "(libtpu for TPUs, the CUDA plugin for GPUs) and report, per device, "
                    "the weights, the largest temporary, the KV blocks and tokens that fit, "
                    "and a roofline estimate of decode speed (an estimate, not a "
                    "measurement). Exit status 1 when something does not compile or fit.")
    plan.add_argument("model", nargs="?", default=None,
                      help="HF checkpoint directory, .gguf file or preset:<name> "
                           "(default: embedded SmolLM2); only its config is read")
    plan.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    plan.add_argument("--target", required=True,
                      help="v5e:1x1, v5e:2x4, v6e:1x1, v5p:2x2x1, h100, a100, h100x8, ...")
    plan.add_argument("--buckets", choices=("largest", "warmup", "all"), default="largest",
                      help="compile the largest bucket of each program (default; they bound "
                           "the memory), the ready set an engine builds before it takes "
                           "requests (warmup), or every program it builds eventually (all)")
    plan.add_argument("--log-level", default="info", help="jaxpage's log level (to stderr)")
    plan.add_argument("--context", type=int, default=None,
                      help="tokens per sequence for the roofline (default: max_model_len)")
    _add_engine_flags(plan)
    return parser


def _engine_options(args) -> dict:
    from jaxpage.config import load_toml_options

    options = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if args.config:
        options = {**load_toml_options(args.config), **options}
    return options


def _instance_args(args) -> list[str]:
    """``jaxpage serve`` arguments that start an instance like this command's engine."""
    out = [args.model or args.model_flag] if (args.model or args.model_flag) else []
    for name in ENGINE_FLAGS:
        value = getattr(args, name)
        if value is not None and name != "kv_role":
            text = (json.dumps(value) if isinstance(value, dict) else
                    str(value).lower() if isinstance(value, bool) else str(value))
            out += ["--" + name.replace("_", "-"), text]
    for flag in ("tokenizer", "config", "api_key", "served_model_name"):
        if getattr(args, flag):
            out += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    return out


def _lora_module(text: str) -> tuple[str, str]:
    """``name=path`` (or vLLM's JSON ``{"name": ..., "path": ...}``) -> (name, path)."""
    if text.lstrip().startswith("{"):
        value = _json_object(text)
        if not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str):
            raise argparse.ArgumentTypeError(f"{text!r} needs string 'name' and 'path'")
        return value["name"], value["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path


def _serve(args) -> int:
    from jaxpage.server.proxy.disaggregated import die_with_parent
    from jaxpage.server.launch import serve

    die_with_parent()  # an instance that `serve --disaggregated` started
    if args.disaggregated and args.lora_modules:
        raise ValueError("--lora-modules is not supported with --disaggregated")
    if args.disaggregated:
        from jaxpage.server.proxy.disaggregated import parse_layout, serve_disaggregated

        parse_layout(args.disaggregated)  # a bad layout fails before anything starts
        serve_disaggregated(args.disaggregated, _instance_args(args), host=args.host,
                            port=args.port, log_level=args.log_level)
        return 0
    model = args.model or args.model_flag
    options = _engine_options(args)
    lora_modules = dict(args.lora_modules or ())
    if lora_modules:
        options.setdefault("enable_lora", True)
    tool_parser = None
    if args.enable_auto_tool_choice or args.tool_call_parser:
        if not (args.enable_auto_tool_choice and args.tool_call_parser):
            raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together")
        from jaxpage.server.tool_parsers import get_parser

        tool_parser = get_parser(args.tool_call_parser).name
    serve(model, tokenizer=args.tokenizer, host=args.host, port=args.port, api_key=args.api_key,
          served_model_name=args.served_model_name,
          log_level=args.uvicorn_log_level or args.log_level, lora_modules=lora_modules,
          chat_template=_chat_template(args.chat_template), tool_parser=tool_parser, **options)
    return 0


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself."""
    import os

    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def _configure_logging(level: str) -> None:
    """The ``jaxpage`` logger at ``level``, to stderr (start-up facts are at INFO)."""
    import logging

    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"--log-level {level!r} is not one of debug, info, warning, error")
    logger = logging.getLogger("jaxpage")
    logger.setLevel(numeric)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s jaxpage: %(message)s",
                                               "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False


def _report_no_effect_flags(args) -> None:
    import logging

    for name, why in NO_EFFECT_FLAGS.items():
        if getattr(args, name, None):
            logging.getLogger("jaxpage").info("%s has no effect: %s", _flag(name), why)


def _generate(args) -> int:
    from jaxpage.engine.generate_stream import stream_generate
    from jaxpage.engine.llm import LLM
    from jaxpage.sampling_params import SamplingParams

    llm = LLM(args.model, tokenizer=args.tokenizer, **_engine_options(args))
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.sample_seed)
    SamplingParams(**params)  # validate before anything is printed
    for piece in stream_generate(llm, args.prompt, params, chat=args.chat):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _plan(args) -> int:
    import os

    # Compile for the target without touching this machine's own accelerators (or
    # initializing their plugins): the target's compiler runs on the CPU host.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jaxpage.planning import plan

    report = plan(args.model or args.model_flag, args.target, buckets=args.buckets,
                  context=args.context, progress=True, **_engine_options(args))
    print(report.text())
    return 0 if report.ok else 1


def _proxy(args) -> int:
    from jaxpage.server.proxy.disaggregated import run_proxy

    run_proxy(args.prefill, args.decode, host=args.host, port=args.port,
              log_level=args.log_level, max_imbalance=args.max_imbalance)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(normalize_bool_flags(sys.argv[1:] if argv is None else argv,
                                                  parser))
    commands = {"serve": _serve, "generate": _generate, "plan": _plan, "proxy": _proxy}
    try:
        if args.command != "proxy":
            _configure_logging(args.log_level)
            _report_no_effect_flags(args)
        return commands[args.command](args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
