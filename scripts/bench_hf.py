"""The Hugging Face baseline: ``transformers`` ``generate`` with static batching.

Requests are taken in workload order in batches of ``batch_size``. A batch is left-padded
to its longest prompt and generates, greedily, exactly as many tokens as its longest
request asks for (``min_new_tokens = max_new_tokens``, so EOS never ends it early): a
static batch runs until its longest member is done, and its shorter members' extra tokens
are wasted work. Throughput counts only the tokens each request asked for, exactly as for
jaxpage, so both systems are credited with the same token count.

The model is the same checkpoint jaxpage runs: the embedded GGUF (dequantized by
``transformers``, offline, from the local file), a local checkpoint directory, or a
shape preset built with random weights directly on the device (``torch.device`` context),
in the requested dtype.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

from bench_common import PRESET_PREFIX, BenchRequest

TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_hf_model(model: str | None, dtype: str, device: str | None = None):
    """The Hugging Face model for a jaxpage model flag (None: the embedded SmolLM2 GGUF)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(TORCH_DTYPES)} for the "
                         "Hugging Face baseline")
    torch_dtype = getattr(torch, TORCH_DTYPES[dtype])
    device = device or torch_device()
    if model is not None and model.startswith(PRESET_PREFIX):
        from jaxpage.models.presets import preset_config

        fields = preset_config(model)
        config = AutoConfig.for_model(
            {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[fields["architectures"][0]],
            **{k: v for k, v in fields.items() if k != "architectures"})
        torch.manual_seed(0)
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        return hf.eval()
    if model is None:
        from jaxpage.models.loader import default_model_path

        model = default_model_path()
    model = os.path.expanduser(model)
    if model.endswith(".gguf"):
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(model),
                                                  gguf_file=os.path.basename(model),
                                                  dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    return hf.to(device).eval()


def pad_id(hf) -> int:
    config = hf.generation_config
    for value in (config.pad_token_id, config.eos_token_id, hf.config.pad_token_id):
        if isinstance(value, list) and value:
            return int(value[0])
        if isinstance(value, int):
            return value
    return 0


def generate_batch(hf, prompts: Sequence[Sequence[int]], new_tokens: int) -> int:
    """Greedy ``generate`` on one left-padded batch for exactly ``new_tokens`` tokens.

    Returns the number of new tokens per row (checked to equal ``new_tokens``).
    """
    import torch

    device = next(hf.parameters()).device
    longest = max(len(p) for p in prompts)
    pad = pad_id(hf)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, longest - len(p):] = 1
    with torch.inference_mode():
        out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                          do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          pad_token_id=pad)
    made = out.shape[1] - longest
    if made != new_tokens:
        raise RuntimeError(f"Hugging Face generate made {made} tokens, expected {new_tokens}")
    return made


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def predict_seconds(requests: Sequence[BenchRequest], batch_size: int,
                    step_s: float, prefill_s_per_token: float,
                    step_s_per_context_token: float = 0.0) -> float:
    """Modelled wall time of the static-batch schedule: per batch, a prefill of
    ``rows x longest prompt`` tokens plus ``longest output`` decode steps, a step at
    context ``c`` costing ``step_s + step_s_per_context_token * c`` (the cache a step
    reads, and copies when it grows, is the whole padded batch's)."""
    total = 0.0
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        prompt = max(r.prompt_len for r in batch)
        steps = max(r.output_len for r in batch)
        total += prefill_s_per_token * len(batch) * prompt
        contexts = steps * prompt + steps * (steps - 1) / 2  # sum of contexts over the steps
        total += step_s * steps + step_s_per_context_token * contexts
    return total


def _time_generate(hf, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
    synchronize()
    began = time.perf_counter()
    generate_batch(hf, prompts, new_tokens)
    synchronize()
    return time.perf_counter() - began


def search_batch_size(hf, requests: Sequence[BenchRequest], candidates: Sequence[int],
                      log: Callable[[str], None] = print) -> tuple[int, list[dict[str, Any]]]:
    """Pick the batch size with the least modelled time for this workload.

    For each candidate (ascending), after one untimed call (a first call at a new batch
    size pays one-time costs that made the old single probe pick batch 64 with a decode
    step three times too fast), short probes on a full batch give the decode step's
    time at two context lengths, the workload's mean prompt and that plus its mean output
    (2 and 10 new tokens each: the difference over 8 steps), and the prefill time per
    token; ``predict_seconds`` turns them into the whole schedule's time, with the step
    growing linearly with the context. A candidate that runs out of memory ends the search
    (larger ones would too).
    """
    import torch

    mean_len = max(1, round(sum(r.prompt_len for r in requests) / len(requests)))
    mean_out = max(1, round(sum(r.output_len for r in requests) / len(requests)))
    long_len = mean_len + mean_out
    probes = []
    for size in sorted(set(candidates)):
        def prompts_of(length: int) -> list[list[int]]:
            rows = []
            for i in range(size):
                ids = list(requests[i % len(requests)].prompt_token_ids) or [10]
                rows.append((ids * (length // len(ids) + 1))[:length])
            return rows

        try:
            _time_generate(hf, prompts_of(mean_len), 2)  # untimed: first use of this size
            short = [_time_generate(hf, prompts_of(mean_len), n) for n in (2, 10)]
            long = [_time_generate(hf, prompts_of(long_len), n) for n in (2, 10)]
        except torch.OutOfMemoryError:
            log(f"HF batch size {size}: out of memory; search stops")
            break
        step_short = max((short[1] - short[0]) / 8, 1e-9)
        step_long = max((long[1] - long[0]) / 8, step_short)
        slope = (step_long - step_short) / (long_len - mean_len)
        intercept = max(step_short - slope * mean_len, 0.0)
        prefill = max(short[0] - 2 * step_short, 0.0) / (size * mean_len)
        predicted = predict_seconds(requests, size, intercept, prefill, slope)
        probes.append({"batch_size": size, "decode_step_s": step_short,
                       "decode_step_long_context_s": step_long,
                       "probe_contexts": [mean_len, long_len],
                       "prefill_s_per_token": prefill, "predicted_s": predicted})
        log(f"HF batch size {size}: decode step {1e3 * step_short:.1f} ms at context "
            f"{mean_len}, {1e3 * step_long:.1f} ms at {long_len}; predicted workload time "
            f"{predicted:.1f} s")
    if not probes:
        raise RuntimeError("the Hugging Face model cannot hold even the smallest batch")
    best = min(probes, key=lambda p: p["predicted_s"])
    return best["batch_size"], probes


def run_static_batches(hf, requests: Sequence[BenchRequest], batch_size: int,
                       progress: bool = True) -> dict[str, Any]:
    """Time the whole workload in static batches of ``batch_size``; returns counts and time."""
    from tqdm.auto import tqdm

    generated = 0
    synchronize()
    began = time.perf_counter()
    with tqdm(total=len(requests), desc=f"HF generate (batch {batch_size})",
              disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(requests), batch_size):
            batch = requests[start:start + batch_size]
            longest_out = max(r.output_len for r in batch)
            generated += len(batch) * generate_batch(hf, [r.prompt_token_ids for r in batch],
                                                     longest_out)
            bar.update(len(batch))
    synchronize()
    return {"wall_s": time.perf_counter() - began, "batch_size": batch_size,
            "generated_tokens_incl_padding": generated}
