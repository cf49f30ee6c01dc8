"""Quality of quantization on SmolLM2 against the float32 model, on held-out text.

The text is ``--corpus`` (default: ``tests/data/heldout_corpus.txt``, prose, dialogue,
code and numbers written for this check and used for nothing else: no option's group
size or scale format is tuned on it), cut into windows of ``--window`` tokens. For each
option, teacher-forced over every position: the top-1 agreement (the option's greedy
next token equals float32's), the mean per-token KL divergence KL(float32 || option) of
the next-token distribution, and perplexity; then greedy continuations of 16 prompts
compared with float32's (how many agree on their first 16 tokens).

    python scripts/bench_quantization_quality.py [--options int8,int4,gguf,kv_int8,kv_int8:fused,kv_fp8]

(``kv_X``: float32 weights with ``kv_cache_dtype="X"``; ``kv_X:fused``: the same in the
TPU's fused KV layout, run here through the reference kernel (``JAXPAGE_KV_LAYOUT``; an
int8 cache there carries its scale codes in its value bytes); ``int8@32``: int8 with
``quantization_group_size=32``.)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GREEDY_PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time there was",
    "Water boils at", "The three primary colors are", "import numpy as np\n",
    "My favourite book is", "The theory of relativity says", "To make a cup of tea,",
    "In 1969, the first", "SELECT name FROM", "The best way to learn a language is",
    "Photosynthesis is the process", "class Stack:\n", "The largest ocean on Earth is",
    "Dear Sir or Madam,"]


DEFAULT_CORPUS = os.path.join(ROOT, "tests", "data", "heldout_corpus.txt")


def corpus_text(path: str) -> str:
    """The file at ``path``; ``"repository"``: this repository's docs and source, the text
    group sizes and scale formats were chosen on (never the held-out corpus)."""
    if path != "repository":
        with open(path, encoding="utf-8") as f:
            return f.read()
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    files += sorted(glob.glob(os.path.join(ROOT, "jaxpage", "**", "*.py"), recursive=True))
    return "\n\n".join(open(f, encoding="utf-8").read() for f in files)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def evaluate(option: str | None, windows: list[list[int]], reference: list[np.ndarray] | None,
             engine: dict) -> dict:
    from jaxpage import LLM

    start = time.perf_counter()
    if option is not None and option.startswith("kv_"):  # a byte KV cache, float weights
        kv_dtype, _, layout = option[3:].partition(":")
        with kv_layout_for(layout or None):
            return _measure(option, LLM(kv_cache_dtype=kv_dtype, **engine), windows,
                            reference, start)
    mode, _, group = (option or "").partition("@")
    llm = LLM(quantization=mode or None,
              quantization_group_size=int(group) if group else None, **engine)
    return _measure(option, llm, windows, reference, start)


@contextlib.contextmanager
def kv_layout_for(layout: str | None):
    """``JAXPAGE_KV_LAYOUT=layout`` while an option is built and measured (None: as is)."""
    if layout is None:
        yield
        return
    before = os.environ.get("JAXPAGE_KV_LAYOUT")
    os.environ["JAXPAGE_KV_LAYOUT"] = layout
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("JAXPAGE_KV_LAYOUT")
        else:
            os.environ["JAXPAGE_KV_LAYOUT"] = before


def _measure(option: str | None, llm, windows: list[list[int]],
             reference: list[np.ndarray] | None, start: float) -> dict:
    from jaxpage import SamplingParams

    stats = llm.get_stats()
    nll, kl, count, agree = 0.0, 0.0, 0, 0
    logprobs_out = []
    for i, ids in enumerate(windows):
        logits = llm.llm_engine.prompt_logits([{"prompt_token_ids": ids}])[0]   # [T, V]
        logp = log_softmax(logits[:-1].astype(np.float64))
        nll -= logp[np.arange(len(ids) - 1), ids[1:]].sum()
        count += len(ids) - 1
        if reference is None:
            logprobs_out.append(logp.astype(np.float32))
        else:
            ref = reference[i].astype(np.float64)
            kl += (np.exp(ref) * (ref - logp)).sum()
            agree += int((ref.argmax(-1) == logp.argmax(-1)).sum())
    outs = llm.generate(GREEDY_PROMPTS, SamplingParams(temperature=0, max_tokens=16),
                        use_tqdm=False)
    return {"option": option or "float32", "weight_bytes": stats["weight_bytes"],
            "perplexity": float(np.exp(nll / count)),
            "kl": None if reference is None else float(kl / count), "tokens": count,
            "top1_agree": None if reference is None else agree / count,
            "greedy": [list(o.outputs[0].token_ids) for o in outs],
            "seconds": time.perf_counter() - start, "_logprobs": logprobs_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options",
                        default="int8,int4,gguf,kv_int8,kv_int8:fused,kv_fp8,kv_fp8_e5m2")
    parser.add_argument("--corpus", default=DEFAULT_CORPUS)
    parser.add_argument("--reference", default=None,
                        help="an .npz to keep float32's results in (reused when it exists: "
                             "same corpus, --tokens and --window only)")
    parser.add_argument("--tokens", type=int, default=0, help="first N tokens (0: all)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks",
                                                      "quantization_quality.json"))
    args = parser.parse_args()
    from jaxpage.engine.tokenizer import load_tokenizer
    from jaxpage.models.loader import default_model_path

    tokenizer = load_tokenizer(default_model_path(), None)
    ids = tokenizer(corpus_text(args.corpus)).input_ids
    if len(ids) < args.tokens:
        raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than --tokens={args.tokens}")
    ids = ids[:args.tokens or len(ids)]
    windows = [ids[i:i + args.window] for i in range(0, len(ids), args.window)]
    windows = [w for w in windows if len(w) > 1]
    engine = dict(max_model_len=args.window + 32, max_num_seqs=16,
                  max_num_batched_tokens=args.window, num_kv_blocks=4 * args.window // 16 + 64)
    if args.reference and os.path.exists(args.reference):  # float32's, saved by a run before
        with np.load(args.reference, allow_pickle=True) as saved:
            base = json.loads(str(saved["row"]))
            reference = [saved[f"w{i}"] for i in range(len(windows))]
    else:
        base = evaluate(None, windows, None, engine)
        reference = base.pop("_logprobs")
        if args.reference:
            np.savez(args.reference, row=json.dumps(base),
                     **{f"w{i}": r for i, r in enumerate(reference)})
    rows = [base]
    for option in [o for o in args.options.split(",") if o]:
        row = evaluate(option, windows, reference, engine)
        row.pop("_logprobs")
        rows.append(row)
    print(f"SmolLM2-135M-Instruct, {len(ids)} tokens of {os.path.relpath(args.corpus, ROOT)}, "
          f"windows of {args.window}")
    print("| option | weight MiB | vs float32 | top-1 agree | mean KL | perplexity | "
          "vs float32 | greedy 16/16 agree |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        agree = sum(g == b for g, b in zip(row["greedy"], base["greedy"]))
        row["greedy_agree"] = agree
        kl = "-" if row["kl"] is None else f"{row['kl']:.4f}"
        top1 = "-" if row["top1_agree"] is None else f"{row['top1_agree']:.2%}"
        print(f"| {row['option']} | {row['weight_bytes'] / 2**20:.1f} | "
              f"{row['weight_bytes'] / base['weight_bytes']:.1%} | {top1} | {kl} | "
              f"{row['perplexity']:.3f} | {row['perplexity'] / base['perplexity'] - 1:+.2%} | "
              f"{agree}/16 |")
    with open(args.out, "w") as f:
        json.dump({"date": datetime.datetime.utcnow().isoformat(timespec="minutes"),
                   "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
