"""Prometheus metrics of one server, in its own ``CollectorRegistry``.

Gauges of the engine's state (running and waiting requests, KV usage, prefix-cache hit
rate, preemptions) are read at scrape time from the snapshot the engine thread keeps
(``AsyncLLMEngine.stats``), so a scrape never touches the engine. Request-level counters
and histograms are fed by the routes as requests finish.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "jaxpage:"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                    80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


# (name, HELP, key of the engine's stats, kind): a prefill instance's tickets, a decode
# instance's pulls (``KVTransfer``: one transfer per request, never one per block).
_KV_TRANSFER_METRICS = (
    ("kv_transfer_offered_tickets", "Requests whose prompt KV pages were gathered into one "
     "K and one V array and offered to a decode instance", "kv_tickets_offered",
     CounterMetricFamily),
    ("kv_transfer_pending_tickets", "Offered KV pages not pulled or released yet",
     "kv_tickets_pending", GaugeMetricFamily),
    ("kv_transfer_released_tickets", "Offered KV pages released unpulled",
     "kv_tickets_released", CounterMetricFamily),
    ("kv_transfer_pulls", "KV transfers pulled from prefill instances: one per request, "
     "its prompt pages as one K and one V array", "kv_pulls", CounterMetricFamily),
    ("kv_transfer_pulled_blocks", "KV blocks the pulls brought (the requests' prompt "
     "blocks)", "kv_pulled_blocks", CounterMetricFamily),
    ("kv_transfer_pulled_bytes", "Bytes the pulls moved (K and V, the block count padded "
     "to a power of two)", "kv_pulled_bytes", CounterMetricFamily),
)


class _EngineStateCollector:
    def __init__(self, model_name: str, read_stats: Callable[[], dict[str, Any]]) -> None:
        self.model_name = model_name
        self.read_stats = read_stats

    def describe(self):
        return []

    def collect(self):
        stats = self.read_stats()
        labels = ["model_name"]
        gauges = [
            ("num_requests_running", "Requests in the running batch", stats.get("num_running", 0)),
            ("num_requests_waiting", "Requests waiting to be scheduled", stats.get("num_waiting", 0)),
            ("num_requests_swapped", "Requests swapped out to host memory", stats.get("num_swapped", 0)),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1)", stats.get("kv_usage", 0.0)),
            ("num_kv_blocks", "KV blocks in the cache", stats.get("num_kv_blocks", 0)),
            ("num_free_kv_blocks", "KV blocks free", stats.get("num_free_blocks", 0)),
            ("prefix_cache_hit_rate", "Share of prompt tokens served by the prefix cache",
             stats.get("prefix_cache_hit_rate", 0.0)),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric([self.model_name], float(value))
            yield family
        preemptions = CounterMetricFamily(PREFIX + "num_preemptions", "Preemptions so far",
                                          labels=labels)
        preemptions.add_metric([self.model_name], float(stats.get("num_preemptions", 0)))
        yield preemptions
        shared = CounterMetricFamily(
            PREFIX + "swap_in_shared_blocks", "Blocks a swap-in (or a KV handoff on a decode "
            "instance) took from the prefix cache instead of copying", labels=labels)
        shared.add_metric([self.model_name], float(stats.get("num_swap_in_shared_blocks", 0)))
        yield shared
        for name, doc, key, kind in _KV_TRANSFER_METRICS:  # disaggregated serving
            if key in stats:  # the prefill instance's, or the decode instance's
                family = kind(PREFIX + name, doc, labels=labels)
                family.add_metric([self.model_name], float(stats[key]))
                yield family
        if "lora_running" in stats:  # vLLM's info gauge of the adapters in use
            info = GaugeMetricFamily(
                PREFIX + "lora_requests_info", "LoRA adapters of running and waiting requests",
                labels=labels + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([self.model_name, str(stats["max_lora"]), stats["lora_running"],
                             stats["lora_waiting"]], 1.0)
            yield info
            loads = CounterMetricFamily(PREFIX + "lora_slot_loads",
                                        "Adapters written into a device slot", labels=labels)
            loads.add_metric([self.model_name], float(stats["lora_slot_loads"]))
            yield loads
        if "spec_num_drafts" not in stats:
            return  # no speculative decoding in this engine
        counters = [
            ("spec_decode_num_drafts", "Rows verified with speculative proposals", "spec_num_drafts"),
            ("spec_decode_num_draft_tokens", "Speculative proposals verified",
             "spec_num_draft_tokens"),
            ("spec_decode_num_accepted_tokens", "Speculative proposals accepted",
             "spec_num_accepted_tokens"),
        ]
        for name, doc, key in counters:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric([self.model_name], float(stats.get(key, 0)))
            yield family
        for name, doc, key in [
                ("spec_decode_acceptance_rate", "Share of proposals accepted",
                 "spec_acceptance_rate"),
                ("spec_decode_mean_accepted_length",
                 "Tokens a verified row emits on average (accepted proposals + 1)",
                 "spec_mean_accepted_length")]:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric([self.model_name], float(stats.get(key, 0.0)))
            yield family


class ServerMetrics:
    """The server's registry; ``observe_finished`` records one finished request."""

    def __init__(self, model_name: str, read_stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed",
                                     labels, registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated",
                                         labels, registry=reg)
        self.requests = Counter(PREFIX + "request_success", "Requests finished, by reason",
                                labels + ["finished_reason"], registry=reg)
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP responses, by route and status",
                                     ["route", "status"], registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              labels, buckets=_TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=_LATENCY_BUCKETS, registry=reg)
        reg.register(_EngineStateCollector(model_name, read_stats))

    def observe_finished(self, *, num_prompt_tokens: int, num_output_tokens: int,
                         finish_reason: str | None, arrival: float, first_token: float | None,
                         finished: float) -> None:
        """Record one request (all its sequences) that ended, however it ended."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.generation_tokens.labels(m).inc(num_output_tokens)
        self.requests.labels(m, finish_reason or "abort").inc()
        self.e2e.labels(m).observe(finished - arrival)
        if first_token is not None:
            self.ttft.labels(m).observe(first_token - arrival)
            if num_output_tokens > 1:
                self.tpot.labels(m).observe((finished - first_token) / (num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
