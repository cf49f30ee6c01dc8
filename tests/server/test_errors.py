"""Bad input gets OpenAI-shaped errors with the right status; the server stays healthy."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as client:
        yield client


def assert_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **fields}


@pytest.mark.parametrize("body,param", [
    (completion(max_tokens=0), "max_tokens"),
    (completion(max_tokens="5"), "max_tokens"),          # strings are not integers
    (completion(temperature=-1), "temperature"),
    (completion(top_p=0), "top_p"),
    (completion(top_k=-2), "top_k"),
    (completion(n=0), "n"),
    (completion(presence_penalty=3), "presence_penalty"),
    (completion(repetition_penalty=0), "repetition_penalty"),
    (completion(logprobs=21), "logprobs"),
    (completion(stop=[""]), "stop"),
    (completion(min_tokens=9), "min_tokens"),              # more than max_tokens
    (completion(prompt=[]), "prompt"),
    (completion(prompt=[1, "a"]), "prompt"),
    (completion(prompt=[10**9]), "prompt"),
    (completion(prompt=[60000]), "prompt"),                # outside the vocabulary
    (completion(prompt=None), "prompt"),
    (completion(max_tokens=256), "max_tokens"),            # prompt + max_tokens > context
    (completion(prompt="word " * 400), None),              # prompt alone longer than context
    (completion(logit_bias={"1": 200}), "logit_bias"),     # out of [-100, 100]
    (completion(echo=True), "echo"),
    (completion(stream="yes"), "stream"),
    ({"model": MODEL_NAME}, "prompt"),
])
def test_bad_completion_requests_are_400(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL_NAME, "messages": []}, "messages"),
    ({"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
      "max_completion_tokens": 10**6}, "max_tokens"),
])
def test_bad_chat_requests_are_400(http, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("raw", [b"{", b"not json", b"[1, 2]", b"null", b"\xff\xfe", b""])
def test_malformed_json_is_400(http, raw):
    response = http.post("/v1/completions", content=raw,
                         headers={"Content-Type": "application/json"})
    assert_error(response, 400)


def test_unknown_model_is_404(http):
    assert_error(http.post("/v1/completions", json=completion(model="gpt-9")), 404, "model")


def test_api_key(served):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(served.url + "/v1/completions", json=completion(), headers=headers)
        assert_error(response, 401)
    assert httpx.get(served.url + "/health").status_code == 200  # /health needs no key


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_tokenize_round_trip(http):
    ids = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 256
    text = http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text.endswith("Hello world")
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    assert_error(http.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={}), 400)


def test_full_waiting_queue_is_503_with_retry_after(served, http):
    """With the engine thread held, queued adds see the waiting queue fill up in order."""
    engine = served.engine
    release = threading.Event()
    blocker = engine.submit(lambda: release.wait(60))
    engine.max_waiting_requests = 2
    results = [None] * 5

    def send(i):
        results[i] = http.post("/v1/completions", json=completion(max_tokens=2))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(5)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)  # every request is queued behind the blocker
    finally:
        release.set()
        for t in threads:
            t.join(60)
        engine.max_waiting_requests = None
    blocker.result(10)
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 200, 503, 503, 503], codes
    for r in results:
        if r.status_code == 503:
            assert_error(r, 503)
            assert r.headers["Retry-After"] == "1"
    assert http.post("/v1/completions", json=completion()).status_code == 200
