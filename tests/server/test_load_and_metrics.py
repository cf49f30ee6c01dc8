"""Under load: 64 concurrent streaming clients, a quarter disconnecting (before or after
the first event) and some sending bad bodies. Afterwards every good request completed
exactly, no request runs, every KV block is free, and ``/metrics`` parses and counts what
was sent: each request that reached the engine exactly once, under the finish reason it
ended with (``"abort"`` for a client that left, as in vLLM)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
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


def finished_by_reason(url: str) -> dict[str, float]:
    """``request_success_total`` by its ``finished_reason`` label."""
    text = httpx.get(url + "/metrics").text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "jaxpage:request_success_total":
                reason = sample.labels["finished_reason"]
                counts[reason] = counts.get(reason, 0.0) + sample.value
    return counts


def wait_for_finished(url: str, before: dict[str, float], total: int,
                      timeout: float = 10.0) -> dict[str, float]:
    """Counts by reason since ``before`` once ``total`` requests are recorded (a stream
    whose client left records its abort in the server just after the client returns)."""
    deadline = time.monotonic() + timeout
    while True:
        after = finished_by_reason(url)
        delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        if sum(delta.values()) >= total or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


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


def test_64_streaming_clients_with_disconnects_and_bad_bodies(served):
    before = scrape(served.url)
    before_reasons = finished_by_reason(served.url)
    prompts = [BASE[i % len(BASE)] for i in range(64)]
    lengths = [8 + (i * 7) % 24 for i in range(64)]
    kinds = ["disconnect" if i % 4 == 1 else "bad" if i % 8 == 2 else "good" for i in range(64)]
    good = [i for i, k in enumerate(kinds) if k == "good"]
    want = served.reference(lambda llm: llm.generate(
        [prompts[i] for i in good], [SamplingParams(temperature=0, max_tokens=lengths[i])
                                     for i in good], use_tqdm=False))
    reasons = {}
    for w in want:
        reasons[w.outputs[0].finish_reason] = reasons.get(w.outputs[0].finish_reason, 0) + 1
    want = {i: w.outputs[0].text for i, w in zip(good, want)}
    bad_bodies = [{"model": MODEL_NAME, "prompt": "x", "max_tokens": -1, "stream": True},
                  {"model": MODEL_NAME, "prompt": "x", "temperature": "hot", "stream": True},
                  {"model": MODEL_NAME, "prompt": [], "stream": True},
                  {"model": MODEL_NAME, "prompt": "x", "max_tokens": 10**6, "stream": True}]

    async def client(i: int, http: httpx.AsyncClient):
        kind = kinds[i]
        if kind == "bad":
            r = await http.post("/v1/completions", json=bad_bodies[(i // 8) % len(bad_bodies)])
            return kind, r.status_code, None
        body = {"model": MODEL_NAME, "prompt": prompts[i], "max_tokens": lengths[i],
                "temperature": 0, "stream": True, "ignore_eos": kind == "disconnect"}
        if kind == "disconnect":
            # Long enough to be cut mid-stream, short enough that the longest chat prompt
            # here (62 tokens) still fits the 256-token context (else: a 400, no stream).
            body["max_tokens"] = 160
            body["messages"] = [{"role": "user", "content": prompts[i]}]
            del body["prompt"]
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                if i % 8 == 5:  # leave after the first event; the others leave at the headers
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            assert json.loads(line[len("data: "):])["choices"][0]["delta"][
                                "role"] == "assistant"
                            break
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
        elif kind == "disconnect":
            assert status == 200, (i, status)
        else:
            assert status == 200 and text == want[i], i
    stats = wait_idle(served)
    assert stats["num_running"] == 0
    # Every request that reached the engine is recorded exactly once: the good ones under
    # the reason the reference run gives them, every disconnected stream as an abort. The
    # bad bodies never reach the engine and are not counted.
    expected = {**reasons, "abort": kinds.count("disconnect")}
    total = len(good) + kinds.count("disconnect")
    assert sum(expected.values()) == total == 56
    wait_for_finished(served.url, before_reasons, total)
    time.sleep(0.5)  # a late second record of some request would show up here
    assert wait_for_finished(served.url, before_reasons, total, timeout=0) == expected
    after = scrape(served.url)
    assert after["jaxpage:num_requests_running"] == 0
    assert after["jaxpage:num_requests_waiting"] == 0
    assert after["jaxpage:kv_cache_usage_perc"] == 0
    assert after["jaxpage:e2e_request_latency_seconds_count"] - before.get(
        "jaxpage:e2e_request_latency_seconds_count", 0) == total
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


def http_responses(url: str) -> dict[tuple[str, str], float]:
    """``http_requests_total`` by (route, status)."""
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "jaxpage:http_requests_total":
                key = (sample.labels["route"], sample.labels["status"])
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def test_http_responses_are_counted_by_route_and_status(served):
    before = http_responses(served.url)
    body = {"model": MODEL_NAME, "prompt": [3, 4, 5], "max_tokens": 2, "temperature": 0}
    assert httpx.post(served.url + "/v1/completions", headers=AUTH, json=body,
                      timeout=120).status_code == 200
    assert httpx.post(served.url + "/v1/completions", headers=AUTH,
                      json=dict(body, max_tokens=-1), timeout=60).status_code == 400
    assert httpx.post(served.url + "/v1/completions", json=body, timeout=60).status_code == 401
    assert httpx.get(served.url + "/no/such/route/42", timeout=60).status_code == 404
    after = http_responses(served.url)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    # The scrape before ``after`` is counted too: one /metrics 200.
    assert delta == {("/v1/completions", "200"): 1, ("/v1/completions", "400"): 1,
                     ("/v1/completions", "401"): 1, ("other", "404"): 1,
                     ("/metrics", "200"): 1}


def test_disconnect_mid_stream_frees_blocks_at_once(served):
    """A long stream is cut after its first event; the request is aborted, not finished."""
    # 60 prompt tokens + 190 fit the 256-token context, so this is a real stream (not a 400)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": BASE[3]}],
            "max_tokens": 190, "ignore_eos": True, "temperature": 0, "stream": True}
    before = scrape(served.url)
    before_reasons = finished_by_reason(served.url)
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    stats = wait_idle(served, timeout=10)
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    assert wait_for_finished(served.url, before_reasons, 1) == {"abort": 1}
    after = scrape(served.url)
    generated = after["jaxpage:generation_tokens_total"] - before["jaxpage:generation_tokens_total"]
    assert generated < 190  # it did not run to the end
