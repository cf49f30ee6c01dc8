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

from jaxpage.cli_flags import (ENGINE_FLAGS, NO_EFFECT_FLAGS, add_engine_flags, flag_name,
                               json_object, normalize_bool_flags, parse_bool)


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
    serve.add_argument("--enable-auto-tool-choice", type=parse_bool, default=False,
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
    add_engine_flags(serve)

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
    add_engine_flags(gen)

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
    add_engine_flags(plan)
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
        value = json_object(text)
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
            logging.getLogger("jaxpage").info("%s has no effect: %s", flag_name(name), why)


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
