"""Shared pieces of the benchmark scripts: workloads, model choice, environment, reports.

Workloads come from ``configs/workloads/<name>.toml`` (or any TOML path) and are drawn
locally with a seed; nothing is downloaded. A workload is a list of ``BenchRequest``
(prompt token ids and the exact number of tokens to generate, with ``ignore_eos``), so
every system under test produces the same number of tokens.

Reports are written as ``<stem>.json`` (everything, machine-readable), ``<stem>.md``
(a Markdown table with the command, device, date and versions) and ``<stem>.png``
(a matplotlib plot), into one output directory.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD_DIR = ROOT / "configs" / "workloads"
PRESET_PREFIX = "preset:"


# -- workloads ----------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt token ids and exactly how many tokens it must generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    spec: dict[str, Any]            # the TOML fields after overrides, as used
    requests: list[BenchRequest]

    @property
    def num_input_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_total_len(self) -> int:
        return max(r.prompt_len + r.output_len for r in self.requests)

    def summary(self) -> dict[str, Any]:
        ins = np.array([r.prompt_len for r in self.requests])
        outs = np.array([r.output_len for r in self.requests])
        return {"name": self.name, "num_requests": len(self.requests),
                "input_tokens": int(ins.sum()), "output_tokens": int(outs.sum()),
                "input_len_mean": float(ins.mean()), "input_len_max": int(ins.max()),
                "output_len_mean": float(outs.mean()), "output_len_max": int(outs.max()),
                "spec": self.spec}


def workload_spec(name_or_path: str) -> dict[str, Any]:
    """The TOML table of ``configs/workloads/<name>.toml``, or of a TOML file path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = WORKLOAD_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in WORKLOAD_DIR.glob("*.toml"))
        raise ValueError(f"workload={name_or_path!r}: no such file {str(path)!r}; "
                         f"known workloads: {known}")
    with open(path, "rb") as f:
        return tomllib.load(f)


def lognormal_lengths(rng: np.random.Generator, count: int, mean: float, sigma: float,
                      low: int, high: int) -> np.ndarray:
    """Integer lengths from a log-normal with the given mean and sigma, clipped to [low, high].

    For a log-normal, mean = exp(mu + sigma^2 / 2), so mu = log(mean) - sigma^2 / 2.
    """
    mu = np.log(mean) - sigma ** 2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, count)), low, high).astype(int)


def make_workload(name_or_path: str, vocab_size: int, **overrides: Any) -> Workload:
    """Draw a workload from its TOML spec; ``overrides`` (None values ignored) replace fields.

    ``input_len`` / ``output_len`` overrides turn any workload into fixed lengths.
    """
    spec = workload_spec(name_or_path)
    spec.update({k: v for k, v in overrides.items() if v is not None})
    if "input_len" in overrides and overrides["input_len"] is not None:
        spec["kind"] = "fixed"
    if vocab_size <= 11:
        raise ValueError(f"vocab_size={vocab_size} is too small for random prompts")
    rng = np.random.default_rng(int(spec.get("seed", 0)))
    count = int(spec["num_requests"])
    if count < 1:
        raise ValueError(f"num_requests={count} must be at least 1")
    kind = spec.get("kind", "fixed")
    if kind == "fixed":
        ins = np.full(count, int(spec["input_len"]))
        outs = np.full(count, int(spec["output_len"]))
    elif kind == "lognormal":
        low = int(spec.get("min_len", 1))
        ins = lognormal_lengths(rng, count, spec["input_mean"], spec["input_sigma"], low,
                                int(spec["max_input_len"]))
        outs = lognormal_lengths(rng, count, spec["output_mean"], spec["output_sigma"], low,
                                 int(spec["max_output_len"]))
        if "output_len" in overrides and overrides["output_len"] is not None:
            outs = np.full(count, int(overrides["output_len"]))
    else:
        raise ValueError(f"workload kind={kind!r} must be 'fixed' or 'lognormal'")
    if ins.min() < 1 or outs.min() < 1:
        raise ValueError(f"workload {spec.get('name')!r}: lengths must be at least 1")
    requests = [BenchRequest(rng.integers(10, vocab_size - 1, int(n)).tolist(), int(m))
                for n, m in zip(ins, outs)]
    return Workload(str(spec.get("name", name_or_path)), spec, requests)


# -- models -------------------------------------------------------------------------------

def resolve_model(flag: str | None) -> str | None:
    """``default``/None -> None (embedded SmolLM2); ``llama3-8b`` -> ``preset:llama3-8b``;
    anything else (a path, or ``preset:<name>``) unchanged."""
    if flag in (None, "", "default"):
        return None
    if flag.startswith(PRESET_PREFIX) or os.path.exists(os.path.expanduser(flag)):
        return flag
    from jaxpage.models.presets import PRESETS

    if flag in PRESETS:
        return PRESET_PREFIX + flag
    raise ValueError(f"--model={flag!r} is neither 'default', an existing path, nor a preset "
                     f"({sorted(PRESETS)})")


def model_label(model: str | None) -> str:
    return "SmolLM2-135M (embedded default)" if model is None else model


def vocab_size_of(model: str | None) -> int:
    """The vocabulary size of a model flag, without building the model."""
    if model is not None and model.startswith(PRESET_PREFIX):
        from jaxpage.models.presets import preset_config

        return int(preset_config(model)["vocab_size"])
    from jaxpage.models.loader import default_model_path, open_source
    from jaxpage.models.registry import resolve_architecture

    source = open_source(default_model_path() if model is None else os.path.expanduser(model))
    return int(resolve_architecture(source.hf_config)[1].vocab_size)


# -- environment --------------------------------------------------------------------------

def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except Exception:
        return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Date, command, device and versions: the header every report carries."""
    import jax

    devices = jax.devices()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "jax_backend": jax.default_backend(),
        "device": f"{len(devices)} x {devices[0].device_kind}",
        "cpu": f"{cpu_name()} ({os.cpu_count()} cores)",
        "git_commit": git_commit(),
        "versions": {name: _version(name) for name in
                     ("jax", "jaxlib", "flax", "torch", "transformers", "numpy")}
                    | {"python": platform.python_version()},
    }


# -- reports ------------------------------------------------------------------------------

def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:,.1f}"
    return "-" if value is None else str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A Markdown table; ``columns`` are (key, header) pairs; missing keys print '-'."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(k)) for k, _ in columns) + " |")
    return "\n".join(lines)


def environment_markdown(env: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    return "\n".join([
        "```bash", env["command"], "```", "",
        f"- date: {env['date']}",
        f"- device: {env['device']} (JAX backend `{env['jax_backend']}`); host CPU: {env['cpu']}",
        f"- versions: {versions}; jaxpage commit {env.get('git_commit') or '?'}",
    ])


def write_report(out_dir: str | Path, stem: str, *, title: str, payload: dict[str, Any],
                 table: str, notes: str = "",
                 plot: Callable[[Any], None] | None = None) -> dict[str, Path]:
    """Write ``stem``.json / .md / .png into ``out_dir``; returns the paths written.

    ``plot(ax)`` draws on one matplotlib Axes (created here, Agg backend, no display).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(payload, indent=2, default=str) + "\n")
    env = payload.get("environment")
    body = [f"# {title}", ""]
    if env:
        body += [environment_markdown(env), ""]
    body += [table, ""]
    if notes:
        body += [notes, ""]
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        plot(ax)
        fig.tight_layout()
        paths["png"] = out / f"{stem}.png"
        fig.savefig(paths["png"])
        plt.close(fig)
        body += [f"![{title}]({stem}.png)", ""]
    paths["md"].write_text("\n".join(body))
    return paths


def median_ms(fn: Callable, *args: Any, repeats: int = 10) -> float:
    """Median milliseconds of ``fn(*args)`` (a jitted function; the first call, which
    compiles, is not timed), each call waited for."""
    import statistics
    import time

    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
