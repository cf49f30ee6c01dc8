"""The proxy's /metrics merges every instance's metrics, labelled by role and URL, and
keeps answering when an instance is down."""

import asyncio

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxpage.server.proxy.metrics import UP_METRIC, gather_metrics


def _instance_text(running: int, finished: int) -> str:
    registry = CollectorRegistry()
    Gauge("jaxpage:num_requests_running", "Requests running.", registry=registry).set(running)
    Counter("jaxpage:request_success", "Finished\nrequests.", ["finished_reason"],
            registry=registry).labels("stop").inc(finished)
    Histogram("jaxpage:time_to_first_token_seconds", "TTFT.", buckets=(0.1, 1.0),
              registry=registry).observe(0.5)
    return generate_latest(registry).decode()


def test_every_instance_is_labelled_and_a_down_one_is_reported():
    texts = {"http://p:1": _instance_text(1, 10), "http://d:2": _instance_text(3, 7),
             "http://d:3": _instance_text(0, 2)}

    def handler(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base == "http://d:3":
            raise httpx.ConnectError("down")
        assert request.headers["authorization"] == "Bearer k"
        return httpx.Response(200, text=texts[base])

    async def run() -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await gather_metrics(
                client, [("prefill", "http://p:1"), ("decode", "http://d:2"),
                         ("decode", "http://d:3")], {"authorization": "Bearer k"})

    text = asyncio.run(run())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    up = {(s.labels["role"], s.labels["instance"]): s.value
          for s in families[UP_METRIC].samples}
    assert up == {("prefill", "http://p:1"): 1.0, ("decode", "http://d:2"): 1.0,
                  ("decode", "http://d:3"): 0.0}
    running = {s.labels["instance"]: s.value
               for s in families["jaxpage:num_requests_running"].samples}
    assert running == {"http://p:1": 1.0, "http://d:2": 3.0}
    finished = {(s.labels["role"], s.labels["finished_reason"]): s.value
                for s in families["jaxpage:request_success"].samples
                if s.name.endswith("_total")}
    assert finished == {("prefill", "stop"): 10.0, ("decode", "stop"): 7.0}
    assert families["jaxpage:request_success"].documentation == "Finished\nrequests."
    buckets = [s for s in families["jaxpage:time_to_first_token_seconds"].samples
               if s.name.endswith("_bucket") and s.labels["instance"] == "http://d:2"]
    assert [(s.labels["le"], s.value) for s in buckets] == [
        ("0.1", 0.0), ("1.0", 1.0), ("+Inf", 1.0)]
    assert text.count("# TYPE jaxpage:num_requests_running gauge") == 1
