"""LoRA adapters over HTTP with the ``openai`` client: an adapter's name as ``model``,
``--lora-modules`` at start-up, vLLM's load / unload routes, and the errors of each."""

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpage import LoRARequest, SamplingParams
from jaxpage.cli import build_parser
from tests.reference import make_lora_adapter
from tests.server.conftest import API_KEY, MODEL_NAME, start_server

PROMPT = [5, 17, 99, 3, 250, 1000, 42, 8]


@pytest.fixture(scope="module")
def adapter_paths(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("served_lora")
    base = tiny_checkpoints["llama"]
    return {"every": make_lora_adapter(base, str(root / "every"), rank=8, alpha=16, seed=41),
            "attn": make_lora_adapter(base, str(root / "attn"), rank=4, alpha=8, seed=42,
                                      target_modules=["q_proj", "v_proj"])}


@pytest.fixture(scope="module")
def lora_served(tiny_checkpoints, adapter_paths):
    info, server = start_server(tiny_checkpoints["llama"], enable_lora=True, max_loras=2,
                                max_lora_rank=8,
                                lora_modules={"every": adapter_paths["every"]})
    yield info
    server.stop()
    info.engine.shutdown()


def _client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def _expected_text(served, lora: LoRARequest | None) -> str:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return served.reference(lambda llm: llm.generate(
        [{"prompt_token_ids": PROMPT}], params, lora_request=lora,
        use_tqdm=False)[0].outputs[0].text)


def _complete(client, model: str, stream: bool = False) -> str:
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    if not stream:
        response = client.completions.create(**kwargs)
        assert response.model == model
        return response.choices[0].text
    return "".join(chunk.choices[0].text for chunk in
                   client.completions.create(stream=True, **kwargs) if chunk.choices)


def test_adapters_are_models_and_load_and_unload_over_http(lora_served, adapter_paths):
    client = _client(lora_served)
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == [MODEL_NAME, "every"]
    assert models["every"].model_extra["parent"] == MODEL_NAME

    every = LoRARequest("every", 1, adapter_paths["every"])
    expected = _expected_text(lora_served, every)
    assert expected != _expected_text(lora_served, None)
    assert _complete(client, "every") == expected
    assert _complete(client, "every", stream=True) == expected
    assert _complete(client, MODEL_NAME) == _expected_text(lora_served, None)
    chat = client.chat.completions.create(model="every", max_tokens=4,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "every"

    loaded = client.post("/load_lora_adapter", cast_to=httpx.Response,
                         body={"lora_name": "attn", "lora_path": adapter_paths["attn"]})
    assert loaded.status_code == 200 and "attn" in loaded.text
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "every", "attn"]
    attn = LoRARequest("attn", 2, adapter_paths["attn"])
    assert _complete(client, "attn") == _expected_text(lora_served, attn)

    with pytest.raises(openai.BadRequestError, match="already been loaded"):
        client.post("/load_lora_adapter", cast_to=httpx.Response,
                    body={"lora_name": "attn", "lora_path": adapter_paths["attn"]})
    with pytest.raises(openai.BadRequestError, match="not a directory"):
        client.post("/load_lora_adapter", cast_to=httpx.Response,
                    body={"lora_name": "bad", "lora_path": "/no/such/adapter"})

    unloaded = client.post("/unload_lora_adapter", cast_to=httpx.Response,
                           body={"lora_name": "attn"})
    assert unloaded.status_code == 200
    with pytest.raises(openai.NotFoundError) as error:
        _complete(client, "attn")
    assert error.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError, match="cannot be found"):
        client.post("/unload_lora_adapter", cast_to=httpx.Response, body={"lora_name": "attn"})
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "every"]
    # A request that resolved "attn" before the unload loads it into the engine again;
    # loading the name anew (other files) replaces that stale copy.
    lora_served.reference(lambda llm: llm.llm_engine.loras.get(attn))
    reloaded = client.post("/load_lora_adapter", cast_to=httpx.Response,
                           body={"lora_name": "attn", "lora_path": adapter_paths["every"]})
    assert reloaded.status_code == 200
    assert _complete(client, "attn") == expected  # now "every"'s weights under that name
    client.post("/unload_lora_adapter", cast_to=httpx.Response, body={"lora_name": "attn"})
    stats = lora_served.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(lora_served.url + "/metrics").text)}
    info, = families["jaxpage:lora_requests_info"].samples
    assert info.labels == {"model_name": MODEL_NAME, "max_lora": "2",
                           "running_lora_adapters": "", "waiting_lora_adapters": ""}
    loads, = [s for s in families["jaxpage:lora_slot_loads"].samples
              if s.name.endswith("_total")]
    assert loads.value == 3  # every, attn, then attn anew


def test_lora_routes_on_a_server_without_lora_are_400(served):
    client = _client(served)
    with pytest.raises(openai.BadRequestError, match="enable-lora"):
        client.post("/load_lora_adapter", cast_to=httpx.Response,
                    body={"lora_name": "x", "lora_path": "/tmp"})
    with pytest.raises(openai.BadRequestError, match="enable-lora"):
        client.post("/unload_lora_adapter", cast_to=httpx.Response, body={"lora_name": "x"})


def test_serve_parses_lora_modules_both_ways():
    args = build_parser().parse_args(
        ["serve", "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/b/chat"}'])
    assert args.lora_modules == [("sql", "/a/sql"), ("chat", "/b/chat")]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "no-path"])
