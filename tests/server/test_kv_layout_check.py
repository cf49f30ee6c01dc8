"""Before the proxy starts, prefill and decode instances must agree on how KV pages are
laid out (and each must have the role it is given)."""

import httpx
import pytest

from jaxpage.server.proxy.disaggregated import check_kv_layouts

LAYOUT = {"kv_shards": 2, "num_layers": 3, "block_size": 8, "kv_heads": 2, "head_dim": 16,
          "dtype": "float32"}


def _client(layouts: dict[str, dict]) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        base = f"http://{request.url.host}:{request.url.port}"
        if base not in layouts:
            raise httpx.ConnectError("down")
        assert request.url.path == "/kv_layout"
        return httpx.Response(200, json=layouts[base])

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_agreeing_instances_pass_and_unreachable_ones_are_left_to_requests():
    client = _client({"http://p:1": {**LAYOUT, "kv_role": "prefill"},
                      "http://d:2": {**LAYOUT, "kv_role": "decode"}})
    check_kv_layouts(["http://p:1"], ["http://d:2", "http://d:3"], client)


def test_differing_tensor_parallel_sizes_are_refused():
    client = _client({"http://p:1": {**LAYOUT, "kv_role": "prefill"},
                      "http://d:2": {**LAYOUT, "kv_role": "decode", "kv_shards": 1}})
    with pytest.raises(ValueError, match="lay KV pages out differently.*'kv_shards': 1"):
        check_kv_layouts(["http://p:1"], ["http://d:2"], client)


def test_an_instance_with_the_wrong_role_is_refused():
    client = _client({"http://p:1": {**LAYOUT, "kv_role": "decode"},
                      "http://d:2": {**LAYOUT, "kv_role": "decode"}})
    with pytest.raises(ValueError, match="http://p:1 was given as a prefill instance but "
                                         "was started with kv_role='decode'"):
        check_kv_layouts(["http://p:1"], ["http://d:2"], client)
