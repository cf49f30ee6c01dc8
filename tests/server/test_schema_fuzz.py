"""Fuzz the server against its own OpenAPI schema (schemathesis): no input is a 500.

Examples are bounded (and derandomized, so CI replays the same ones); every generated
request is sent to the real server. A valid token budget above ``TOKEN_CAP`` is lowered to
it (and ``n`` to 2), so that a body that happens to be valid does not generate until the
context is full: each such example cost ~10 s on two cores. Out-of-range budgets
(negative, not integers) are sent unchanged; ``test_errors.py`` covers too-large ones.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.server.conftest import API_KEY


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_url(served.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")
TOKEN_CAP = 8


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_input_makes_a_500(case, served):
    if isinstance(case.body, dict) and case.path in ("/v1/completions", "/v1/chat/completions"):
        for key in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(key)
            if type(value) is int and value > TOKEN_CAP:
                case.body[key] = TOKEN_CAP
        if "max_tokens" not in case.body and "max_completion_tokens" not in case.body:
            case.body["max_tokens"] = TOKEN_CAP
        if type(case.body.get("n")) is int and case.body["n"] > 2:
            case.body["n"] = 2
    response = case.call(base_url=served.url, headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=120)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error)
