"""No request makes the live reward server fail: every malformed body gets a 4xx and the connection stays open.

Three layers, all against a real uvicorn on loopback (`live_reward_server`):

- named malformed bodies that used to answer 500 and reset the keep-alive connection (non-finite numbers,
  lone surrogates, texts longer than the classifier), each followed by a second request on the same socket;
- JSON-like documents built by Hypothesis with what Python's parser accepts and JSON does not (NaN, Infinity,
  1e999, lone surrogates), plus random byte flips;
- Schemathesis on the server's own OpenAPI schema, positive (bodies the schema allows) and negative (bodies it
  does not), with zero 5xx.

`REDTEAM_GRPO_FUZZ_EXAMPLES` sets the examples of each fuzzed case. The default, 150, keeps the file under a
minute on 2 CPU cores; a thorough run is `REDTEAM_GRPO_FUZZ_EXAMPLES=2500 pytest tests/server/test_openapi_fuzz.py
-k "no_input and POST"`: 4 Schemathesis cases on the POST endpoints, 10,000 requests, about 15 minutes on 2
shared CPU cores, most of it the classifier scoring the schema-valid bodies (~0.3 s each, up to 64 texts).
The operations are driven with Hypothesis directly (schemathesis' lazy pytest fixture loader does not work
with this pytest), one test per operation and mode, so a failure names the endpoint.
"""

from __future__ import annotations

import http.client
import json
import os
from urllib.parse import urlsplit

import hypothesis
import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

OPERATIONS = ["GET /health", "GET /ready", "POST /score", "POST /embed"]
FUZZ_EXAMPLES = int(os.environ.get("REDTEAM_GRPO_FUZZ_EXAMPLES", "150"))
FUZZ_SETTINGS = hypothesis.settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(hypothesis.HealthCheck)
)
MAX_CHARS = 2000  # the live server's --max-chars (tests/server/conftest.py)


def _post_then_probe(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict, int]:
    """(status, JSON answer) of POST /score with `body`, and the status of GET /health on the same connection.

    A server that fails on a request resets the keep-alive connection: the probe then raises.
    """
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("POST", "/score", body, {"content-type": content_type})
        response = connection.getresponse()
        status, raw = response.status, response.read()
        connection.request("GET", "/health")
        probe = connection.getresponse()
        probe.read()
        return status, json.loads(raw), probe.status
    finally:
        connection.close()


LONG_TEXT = "the cat sat on the mat. " * 30  # ~720 characters, far beyond the classifier's 128 tokens


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b'{"texts": [NaN]}', 422, "NaN is not a JSON number"),
        (b'{"texts": NaN}', 422, "NaN is not a JSON number"),
        (b'{"texts": ["a"], "prompts": [Infinity]}', 422, "Infinity is not a JSON number"),
        (b'{"texts": [-Infinity]}', 422, "-Infinity is not a JSON number"),
        (b'{"texts": [1e999]}', 422, "1e999 is beyond the range of a float"),
        (b'{"texts": ["\\ud800"]}', 422, "$.texts[0] holds a lone UTF-16 surrogate"),
        (b'{"texts": ["a"], "prompts": ["x\\udfff"]}', 422, "$.prompts[0] holds a lone UTF-16 surrogate"),
        (b'{"texts": "\\ud800"}', 422, "$.texts holds a lone UTF-16 surrogate"),
        (b'{"\\ud800": ["a"]}', 422, "a key of $ holds a lone UTF-16 surrogate"),
        (b'{"texts": [' + b"9" * 5000 + b"]}", 422, "too many digits"),
        (b"[" * 100_000 + b"]" * 100_000, 422, "nested too deeply"),
        (b'{"texts": ["\xff"]}', 422, "not valid UTF-8"),
        (b'{"texts": ["a"', 422, "JSON decode error"),
        (b"", 422, "Field required"),
        (b'{"texts": {"a": 1}}', 422, "valid list"),
        (json.dumps({"texts": ["a" * (MAX_CHARS + 1)]}).encode(), 422, f"the limit is {MAX_CHARS} (--max-chars)"),
        # well-formed: a surrogate *pair* is one character, NUL is a character, a long text is cut by the scorer
        (b'{"texts": ["\\ud83d\\ude00", "\\u0000", ""]}', 200, None),
        (json.dumps({"texts": [LONG_TEXT, "you are an idiot. " + LONG_TEXT]}).encode(), 200, None),
    ],
)
def test_a_malformed_body_gets_a_4xx_that_names_it_and_the_connection_stays_open(
    live_reward_server, body, status, message
):
    got, answer, probe = _post_then_probe(live_reward_server, body)
    assert (got, probe) == (status, 200), answer
    if message is not None:
        assert message in json.dumps(answer["detail"], ensure_ascii=False)


def test_a_text_longer_than_the_classifier_is_scored_and_flagged_through_the_server(live_reward_server):
    status, answer, _ = _post_then_probe(
        live_reward_server, json.dumps({"texts": [LONG_TEXT, "you are an idiot. " + LONG_TEXT, "hi"]}).encode()
    )
    assert status == 200
    clean, toxic, short = answer["results"]
    assert [r["truncated"] for r in answer["results"]] == [True, True, False]
    assert clean["score"] < 0.5 < toxic["score"] and short["truncated"] is False
    assert answer["scorer"]["details"]["max_length"] == 128


def test_non_strict_json_in_any_content_type_is_refused(live_reward_server):
    status, answer, probe = _post_then_probe(live_reward_server, b'{"texts": [NaN]}', content_type="text/plain")
    assert (status, probe) == (422, 200) and "NaN" in answer["detail"]


# Lone surrogates (category Cs) are what a JSON escape can carry and UTF-8 cannot; Hypothesis leaves them out
# of its characters unless asked.
_ANY_CHARACTER = st.characters() | st.characters(codec=None, categories=["Cs"])
_JSON_LIKE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(_ANY_CHARACTER, max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(_ANY_CHARACTER, max_size=8), children),
    max_leaves=12,
)
_BODIES = st.one_of(
    _JSON_LIKE,
    st.fixed_dictionaries({"texts": st.lists(_JSON_LIKE, min_size=1, max_size=4)}),
    st.fixed_dictionaries({"texts": st.lists(st.text(_ANY_CHARACTER, max_size=40), min_size=1, max_size=4)}),
    st.fixed_dictionaries(
        {"texts": st.lists(st.text(max_size=20), min_size=1, max_size=3), "prompts": st.lists(_JSON_LIKE, max_size=3)}
    ),
)


def test_json_like_documents_and_flipped_bytes_never_make_the_server_fail(live_reward_server):
    parts = urlsplit(live_reward_server)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)  # one keep-alive connection

    flips = st.lists(st.tuples(st.integers(0, 10**6), st.binary(min_size=1, max_size=2)), max_size=2)

    @hypothesis.given(document=_BODIES, flips=st.just([]) | flips)  # half the bodies stay well-formed JSON
    @FUZZ_SETTINGS
    def fuzz(document, flips):
        body = bytearray(json.dumps(document).encode())  # ensure_ascii: surrogates as \udXXX, NaN as NaN
        for position, replacement in flips:
            at = position % (len(body) + 1)
            body[at : at + len(replacement)] = replacement
        connection.request("POST", "/score", bytes(body), {"content-type": "application/json"})
        response = connection.getresponse()
        answer = response.read()
        assert response.status < 500, (bytes(body), answer)

    try:
        fuzz()
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("label", "mode"),
    [
        ("GET /health", GenerationMode.POSITIVE),
        ("GET /ready", GenerationMode.POSITIVE),
        ("POST /score", GenerationMode.POSITIVE),
        ("POST /score", GenerationMode.NEGATIVE),
        ("POST /embed", GenerationMode.POSITIVE),
        ("POST /embed", GenerationMode.NEGATIVE),
    ],
    ids=lambda x: x.value if isinstance(x, GenerationMode) else x,
)
def test_no_input_the_schema_describes_makes_the_server_fail(live_reward_server, label, mode):
    schema = schemathesis.openapi.from_url(live_reward_server + "/openapi.json")
    operations = {op.label: op for op in (result.ok() for result in schema.get_all_operations())}
    assert set(operations) == set(OPERATIONS)  # a new endpoint must be added here, and so fuzzed

    @hypothesis.given(case=operations[label].as_strategy(generation_mode=mode))
    @FUZZ_SETTINGS
    def fuzz(case):
        case.call_and_validate(checks=[not_a_server_error])

    fuzz()
