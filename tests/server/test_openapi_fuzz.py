"""Schemathesis against the live server's own OpenAPI schema: whatever the schema allows, no 5xx.

The operations are driven with Hypothesis directly (schemathesis' lazy pytest fixture loader does not work
with this pytest), one test per operation, so a failure names the endpoint.
"""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error

OPERATIONS = ["GET /health", "GET /ready", "POST /score", "POST /embed"]


@pytest.mark.parametrize("label", OPERATIONS)
def test_no_input_makes_the_server_fail(live_reward_server, label):
    schema = schemathesis.openapi.from_url(live_reward_server + "/openapi.json")
    operations = {op.label: op for op in (result.ok() for result in schema.get_all_operations())}
    assert set(operations) == set(OPERATIONS)  # a new endpoint must be added here, and so fuzzed

    @hypothesis.given(case=operations[label].as_strategy())
    @hypothesis.settings(max_examples=60, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
    def fuzz(case):
        case.call_and_validate(checks=[not_a_server_error])

    fuzz()
