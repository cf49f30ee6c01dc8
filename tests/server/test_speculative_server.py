"""A server started with ``speculative_config`` answers exactly as plain decoding does
(streaming or not, through the official client) and exports the speculation counters."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpage import LLM, SamplingParams
from jaxpage.cli import build_parser
from tests.engine.prompts import BASE
from tests.server.conftest import API_KEY, MODEL_NAME, OPTIONS, start_server


class RepeatLast:
    """Proposes the last token again (twice): a random tiny model seldom repeats its
    context, so prompt lookup alone would verify nearly nothing here."""

    def propose(self, request, max_tokens):
        return [request.all_token_ids[-1]] * min(2, max_tokens)


@pytest.fixture(scope="module")
def spec_served(tiny_checkpoints):
    info, server = start_server(tiny_checkpoints["llama"],
                                speculative_config={"method": "ngram",
                                                    "num_speculative_tokens": 2})
    info.engine.submit(lambda: setattr(info.llm.llm_engine.scheduler.speculation, "proposer",
                                       RepeatLast())).result(60)
    yield info
    server.stop()
    info.engine.shutdown()


def test_cli_takes_a_speculative_config_json_object():
    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "ngram"])


def test_completions_equal_plain_decoding_and_metrics_count_drafts(spec_served,
                                                                    tiny_checkpoints):
    plain = LLM(tiny_checkpoints["llama"], **OPTIONS)
    prompts = BASE[:4]
    want = [o.outputs[0].text for o in plain.generate(
        prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)]
    sampled = plain.generate(prompts[0], SamplingParams(temperature=1.0, seed=9, max_tokens=20),
                             use_tqdm=False)[0].outputs[0].text
    client = openai.OpenAI(base_url=spec_served.url + "/v1", api_key=API_KEY, max_retries=0,
                           timeout=120)
    got = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=20,
                                    temperature=0)
    assert [c.text for c in got.choices] == want
    stream = client.completions.create(model=MODEL_NAME, prompt=prompts[1], max_tokens=20,
                                       temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == want[1]
    seeded = client.completions.create(model=MODEL_NAME, prompt=prompts[0], max_tokens=20,
                                       temperature=1.0, seed=9)
    assert seeded.choices[0].text == sampled

    stats = spec_served.stats()
    assert stats["spec_num_draft_tokens"] > 0
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(spec_served.url + "/metrics").text)}
    drafts = families["jaxpage:spec_decode_num_draft_tokens"].samples[0].value
    accepted = families["jaxpage:spec_decode_num_accepted_tokens"].samples[0].value
    assert drafts == stats["spec_num_draft_tokens"] and 0 <= accepted <= drafts
    assert "jaxpage:spec_decode_acceptance_rate" in families
