"""Under load: 64 concurrent streaming clients, a quarter disconnecting mid-stream and some
sending bad bodies. Afterwards every good request completed exactly, no request runs,
every KV block is free, and ``/metrics`` parses and counts what was sent."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpage import SamplingParams
from tests.engine.prompts import BASE
from tests.server.conftest import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {sample name (labels dropped): summed value}."""
    text = httpx.get(url + "/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def read_events(response) -> list[dict]:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append({"done": True} if data == "[DONE]" else json.loads(data))
    return events


def wait_idle(served, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = served.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 \
                and stats["num_free_blocks"] == stats["num_kv_blocks"]:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"engine not idle: {served.stats()}")


@pytest.mark.xfail(strict=True, reason=(
    "known bug: request_success_total counts 52 of the 56 requests (4 disconnected streams "
    "are never recorded); outputs, blocks and running counts are right"))
def test_64_streaming_clients_with_disconnects_and_bad_bodies(served):
    before = scrape(served.url)
    prompts = [BASE[i % len(BASE)] for i in range(64)]
    lengths = [8 + (i * 7) % 24 for i in range(64)]
    kinds = ["disconnect" if i % 4 == 1 else "bad" if i % 8 == 2 else "good" for i in range(64)]
    good = [i for i, k in enumerate(kinds) if k == "good"]
    want = served.reference(lambda llm: llm.generate(
        [prompts[i] for i in good], [SamplingParams(temperature=0, max_tokens=lengths[i])
                                     for i in good], use_tqdm=False))
    want = {i: w.outputs[0].text for i, w in zip(good, want)}
    bad_bodies = [{"model": MODEL_NAME, "prompt": "x", "max_tokens": -1, "stream": True},
                  {"model": MODEL_NAME, "prompt": "x", "temperature": "hot", "stream": True},
                  {"model": MODEL_NAME, "prompt": [], "stream": True},
                  {"model": MODEL_NAME, "prompt": "x", "max_tokens": 10**6, "stream": True}]

    async def client(i: int, http: httpx.AsyncClient):
        kind = kinds[i]
        if kind == "bad":
            r = await http.post("/v1/completions", json=bad_bodies[i % len(bad_bodies)])
            return kind, r.status_code, None
        body = {"model": MODEL_NAME, "prompt": prompts[i], "max_tokens": lengths[i],
                "temperature": 0, "stream": True, "ignore_eos": kind == "disconnect"}
        if kind == "disconnect":
            body["max_tokens"] = 200
            body["messages"] = [{"role": "user", "content": prompts[i]}]
            del body["prompt"]
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # the first chunk arrived: leave mid-stream
            return kind, r.status_code, None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            events = await read_events(r)
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        assert events[-1] == {"done": True}
        return kind, r.status_code, text

    async def run():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=served.url, headers=AUTH, timeout=300,
                                     limits=limits) as http:
            return await asyncio.gather(*(client(i, http) for i in range(64)))

    results = asyncio.run(run())
    for i, (kind, status, text) in enumerate(results):
        if kind == "bad":
            assert status == 400, (i, status)
        elif kind == "good":
            assert status == 200 and text == want[i], i
    stats = wait_idle(served)
    assert stats["num_running"] == 0
    expected = len(good) + kinds.count("disconnect")
    for _ in range(50):  # a disconnected stream's handler may record its abort just after
        after = scrape(served.url)
        done = after["jaxpage:request_success_total"] - before.get(
            "jaxpage:request_success_total", 0)
        if done >= expected:
            break
        time.sleep(0.2)
    assert after["jaxpage:num_requests_running"] == 0
    assert after["jaxpage:num_requests_waiting"] == 0
    assert after["jaxpage:kv_cache_usage_perc"] == 0
    assert done == expected
    assert after["jaxpage:e2e_request_latency_seconds_count"] - before.get(
        "jaxpage:e2e_request_latency_seconds_count", 0) == done
    # the server still answers
    r = httpx.post(served.url + "/v1/completions", headers=AUTH, json={
        "model": MODEL_NAME, "prompt": prompts[0], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200


def test_metrics_parse_and_counters_match_requests(served):
    before = scrape(served.url)
    prompt_ids = [[3, 4, 5, 6, 7], [8, 9, 10]]
    r = httpx.post(served.url + "/v1/completions", headers=AUTH, json={
        "model": MODEL_NAME, "prompt": prompt_ids, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}, timeout=120)
    usage = r.json()["usage"]
    after = scrape(served.url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["jaxpage:prompt_tokens_total"] == usage["prompt_tokens"] == 8
    assert delta["jaxpage:generation_tokens_total"] == usage["completion_tokens"] == 12
    assert delta["jaxpage:request_success_total"] == 2
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds"):
        assert delta[f"jaxpage:{name}_count"] == 2, name
        assert delta[f"jaxpage:{name}_sum"] > 0, name
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                  "prefix_cache_hit_rate", "num_preemptions_total"):
        assert f"jaxpage:{gauge}" in after


def test_disconnect_mid_stream_frees_blocks_at_once(served):
    """A long stream is cut after its first event; the request is aborted, not finished."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": BASE[3]}],
            "max_tokens": 220, "ignore_eos": True, "temperature": 0, "stream": True}
    before = scrape(served.url)
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    stats = wait_idle(served, timeout=10)
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    after = scrape(served.url)
    generated = after["jaxpage:generation_tokens_total"] - before["jaxpage:generation_tokens_total"]
    assert generated < 220  # it did not run to the end
