"""Fuzz the server against its own OpenAPI schema (schemathesis): no input is a 500.

Examples are bounded (and derandomized, so CI replays the same ones) to keep this under
two minutes on two cores; every generated request is sent to the real server.
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


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_input_makes_a_500(case, served):
    response = case.call(base_url=served.url, headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=120)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error)
