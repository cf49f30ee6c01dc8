"""The real server through the official ``openai`` client: sync, async, streaming, chat and
completions, each compared token for token with ``LLM.generate`` on the same engine."""

from __future__ import annotations

import asyncio

import openai
import pytest

from jaxpage import SamplingParams
from tests.engine.prompts import BASE
from tests.server.conftest import API_KEY, MODEL_NAME


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient_factory(served):
    return lambda: openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120)


def greedy(**kw):
    return SamplingParams(temperature=0, **kw)


def test_completions_match_llm_generate(served, client):
    prompts = BASE[:3]
    want = served.reference(lambda llm: llm.generate(prompts, greedy(max_tokens=12),
                                                     use_tqdm=False))
    got = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=12,
                                    temperature=0)
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.finish_reason for c in got.choices] == [w.outputs[0].finish_reason for w in want]
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in want)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_token_id_prompts_and_stop(served, client):
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    want = served.reference(lambda llm: llm.generate(
        [{"prompt_token_ids": i} for i in ids], greedy(max_tokens=10), use_tqdm=False))
    got = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=10, temperature=0)
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
    one = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=10, temperature=0)
    assert one.choices[0].text == want[0].outputs[0].text
    text = want[0].outputs[0].text
    stop = text[3:6]
    cut = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=10,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_streaming_completion_equals_non_streaming(served, client):
    prompt = BASE[3]
    want = served.reference(lambda llm: llm.generate([prompt], greedy(max_tokens=20),
                                                     use_tqdm=False))[0].outputs[0]
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_sync_and_streaming(served, client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    want = served.reference(lambda llm: llm.chat(messages, greedy(max_tokens=16),
                                                 use_tqdm=False))[0]
    got = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16,
                                         temperature=0)
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                            max_completion_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == want.outputs[0].finish_reason


def test_async_client_many_concurrent_requests(served, aclient_factory):
    prompts = BASE[:12]
    want = served.reference(lambda llm: llm.generate(prompts, greedy(max_tokens=14),
                                                     use_tqdm=False))

    async def run():
        async with aclient_factory() as aclient:
            async def one(i, prompt):
                if i % 2:
                    r = await aclient.completions.create(model=MODEL_NAME, prompt=prompt,
                                                         max_tokens=14, temperature=0)
                    return r.choices[0].text
                parts = []
                async for c in await aclient.completions.create(
                        model=MODEL_NAME, prompt=prompt, max_tokens=14, temperature=0,
                        stream=True):
                    parts.append(c.choices[0].text)
                return "".join(parts)
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(run()) == [w.outputs[0].text for w in want]


def test_sampling_features_match_llm_generate(served, client):
    """Penalties, seeded sampling with n, min_tokens, ignore_eos and logprobs over HTTP."""
    prompt = BASE[5]
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=11, n=2,
                            max_tokens=12, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.2, min_tokens=4, ignore_eos=True, logprobs=2)
    want = served.reference(lambda llm: llm.generate([prompt], params, use_tqdm=False))[0]
    got = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0.8, top_p=0.9, seed=11,
        n=2, presence_penalty=0.5, frequency_penalty=0.3, logprobs=2,
        extra_body=dict(top_k=50, min_p=0.01, repetition_penalty=1.2, min_tokens=4,
                        ignore_eos=True))
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    for choice, out in zip(got.choices, want.outputs):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(out.token_ids)
        for value, token, entry, tops in zip(lp.token_logprobs, out.token_ids, out.logprobs,
                                             lp.top_logprobs):
            assert value == pytest.approx(entry[token].logprob, abs=1e-6)
            assert len(tops) in (2, 3)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)


def test_models_route(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
