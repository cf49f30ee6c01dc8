"""Latency statistics for the serving benchmark, and the server's /metrics cross-check.

Per request the client records the send time, the arrival time of every streamed chunk
that carries text, and the number of output tokens (from the final ``usage`` when the
server sends it, else the count of content chunks). Definitions (vLLM's):

* TTFT: first content chunk - send.
* TPOT: (end-to-end - TTFT) / (output tokens - 1), per request (requests with 1 token excluded).
* ITL: gaps between consecutive content chunks, pooled over all requests.
* E2E: last chunk - send.
* Goodput: requests/s of the requests meeting every SLO given (TTFT, TPOT, E2E), over the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class RequestRecord:
    """What the client saw of one streamed request (times from ``time.perf_counter``)."""

    prompt_len: int
    output_len_wanted: int
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return np.diff(self.chunk_times).tolist()


def stats_ms(values: Sequence[float], prefix: str) -> dict[str, float]:
    """mean / median / p99 of seconds, in milliseconds (NaN when empty)."""
    if not values:
        return {f"mean_{prefix}_ms": math.nan, f"median_{prefix}_ms": math.nan,
                f"p99_{prefix}_ms": math.nan}
    arr = 1e3 * np.asarray(values, dtype=float)
    return {f"mean_{prefix}_ms": float(arr.mean()), f"median_{prefix}_ms": float(np.median(arr)),
            f"p99_{prefix}_ms": float(np.percentile(arr, 99))}


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slo_ms: dict[str, float | None]) -> dict[str, Any]:
    """One row of the serving table: counts, throughputs, latency stats, goodput."""
    good = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    in_tokens = sum(r.prompt_len for r in good)
    row: dict[str, Any] = {
        "completed": len(good), "failed": len(records) - len(good), "duration_s": duration_s,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(good) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
    }
    row.update(stats_ms([r.ttft for r in good], "ttft"))
    row.update(stats_ms([t for r in good if (t := r.tpot) is not None], "tpot"))
    row.update(stats_ms([g for r in good for g in r.itls], "itl"))
    row.update(stats_ms([r.e2e for r in good], "e2el"))

    def meets(r: RequestRecord) -> bool:
        checks = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
        return all(limit is None or 1e3 * checks[k] <= limit for k, limit in slo_ms.items())

    if any(v is not None for v in slo_ms.values()):
        row["goodput"] = sum(meets(r) for r in good) / duration_s
    errors = sorted({r.error for r in records if r.error})
    if errors:
        row["errors"] = errors[:5]
    return row


# -- the server's Prometheus histograms ------------------------------------------------------

# Histogram name suffixes (vLLM's naming; any prefix, e.g. ``vllm:`` or ``jaxpage:``).
HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "e2el": "e2e_request_latency_seconds",
              "tpot": "time_per_output_token_seconds", "itl": "inter_token_latency_seconds"}


def histogram_sums(text: str) -> dict[str, tuple[float, float]]:
    """{metric key: (sum, count)} of the latency histograms in a /metrics page (all labels summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        key = next((k for k, suffix in HISTOGRAMS.items()
                    if family.name.endswith(suffix)), None)
        if key is None or family.type != "histogram":
            continue
        total = count = 0.0
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
        found[key] = (found.get(key, (0.0, 0.0))[0] + total, found.get(key, (0.0, 0.0))[1] + count)
    return found


def metrics_delta(before: str | None, after: str | None) -> dict[str, Any] | None:
    """Server-side mean of each latency histogram over one run (after - before), in ms."""
    if before is None or after is None:
        return None
    b, a = histogram_sums(before), histogram_sums(after)
    out: dict[str, Any] = {}
    for key, (total, count) in a.items():
        total0, count0 = b.get(key, (0.0, 0.0))
        if count - count0 > 0:
            out[f"server_mean_{key}_ms"] = 1e3 * (total - total0) / (count - count0)
            out[f"server_{key}_count"] = int(count - count0)
    return out or None
