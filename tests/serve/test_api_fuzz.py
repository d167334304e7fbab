"""Property-based API fuzzing from the server's own OpenAPI schema (hypothesis, no schemathesis needed).

Each generated request follows the schema's shapes field by field, or breaks them (wrong JSON
types, out-of-range numbers, junk, missing fields, lone surrogates, odd headers). Every answer
must be a documented status with OpenAI's error body, never a 500, and nothing may reach the
server's error log. The default suite runs API_FUZZ_CASES=40 cases; `pytest -m apifuzz` the
long run (API_FUZZ_LONG, default 2000).
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "smollm2-135m"
KEY = "key-fuzz-0001"
DOCUMENTED = {200, 400, 401, 404, 405, 413, 421, 503}

junk = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)
words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24) | st.sampled_from(
    ["<|im_end|>", "<|im_start|>system\n", "\ud800", "\x00", "word " * 5, "\u0001" * 50])


def from_schema(node: dict, defs: dict, depth: int = 0):
    """A strategy for values of one OpenAPI schema node: valid shapes, sometimes anything at all."""
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[1]]
    options = []
    if "anyOf" in node or "oneOf" in node:
        options += [from_schema(n, defs, depth + 1) for n in node.get("anyOf", node.get("oneOf"))]
    elif "enum" in node or "const" in node:
        options.append(st.sampled_from(node.get("enum", [node.get("const")])))
    else:
        kind = node.get("type")
        if kind == "string":
            options.append(st.just(MODEL) if node.get("title") == "Model" else words)
        elif kind == "integer":
            options.append(st.integers(-3, 40) | st.sampled_from([2 ** 70, -2 ** 64, 10 ** 12, 8193]))
        elif kind == "number":
            options.append(st.floats(-1, 3, allow_nan=False) | st.sampled_from(  # issue 38: tiny, NaN, inf
                [1e30, -0.0, 1e-300, 5e-324, 1e-45, float("nan"), float("inf")]))
        elif kind == "boolean":
            options.append(st.booleans())
        elif kind == "null":
            options.append(st.none())
        elif kind == "array" and depth < 4:
            options.append(st.lists(from_schema(node.get("items", {}), defs, depth + 1), max_size=3))
        elif kind == "object" and depth < 4:
            options.append(objects(node, defs, depth + 1))
    options.append(junk)  # type confusion: any JSON where this field goes
    return st.one_of(*options)


def objects(node: dict, defs: dict, depth: int = 0):
    props = node.get("properties", {})
    if not props:
        return st.dictionaries(st.text(max_size=6), junk, max_size=3)
    fields = {k: from_schema(v, defs, depth) for k, v in props.items()}
    return st.fixed_dictionaries({k: fields[k] for k in node.get("required", [])},
                                 optional={k: v for k, v in fields.items() if k not in node.get("required", [])})


@pytest.fixture(scope="module")
def fuzzed(smollm2):
    """A server with keys and tiny caps, so that the requests the schema allows are cheap to answer."""
    from attnlab.serve import Keys, PolicySpec, ServeConfig, create_app
    from tests.serve.conftest import running
    app = create_app(smollm2, ServeConfig(MODEL, PolicySpec("sink", 64, 4, "cache"), max_prompt_tokens=96, chunk=64,
                                          max_tokens=2, max_tokens_cap=3, max_bytes=64 << 20, max_sessions=4,
                                          queue_timeout=30), Keys(api=[KEY]))
    schema = app.openapi()  # the schema is built even though /openapi.json is not served
    with running(app) as url:
        yield url, app, schema


def requests(schema):
    defs = schema["components"]["schemas"]
    paths = {"/v1/chat/completions": "ChatRequest", "/v1/completions": "CompletionRequest"}
    bodies = st.sampled_from(sorted(paths)).flatmap(
        lambda p: st.tuples(st.just(p), objects(defs[paths[p]], defs) | junk))
    headers = st.sampled_from([{"authorization": f"Bearer {KEY}"}] * 6 + [
        {}, {"authorization": "Bearer nope"}, {"authorization": f"Bearer {KEY}", "host": "evil.example"},
        {"authorization": f"Bearer {KEY}", "content-type": "text/plain"}])
    gets = st.sampled_from(["/v1/models", "/v1/models/x", "/v1/sessions", "/v1/sessions/zz/cache", "/nowhere",
                            "/openapi.json", "/health"])
    return st.one_of(st.tuples(st.just("POST"), bodies, headers), st.tuples(st.just("GET"), gets, headers))


def run_fuzz(fuzzed, cases: int, caplog):
    url, app, schema = fuzzed
    seen = Counter()
    client = httpx.Client(base_url=url, timeout=60)

    @settings(max_examples=cases, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests(schema))
    def one(req):
        method, target, headers = req
        if method == "GET":
            r = client.get(target, headers=headers)
        else:
            path, body = target
            raw = json.dumps(body)  # escapes lone surrogates, as a hostile client would send them
            r = client.post(path, content=raw, headers={"content-type": "application/json", **headers})
        seen[r.status_code] += 1
        assert r.status_code in DOCUMENTED, (req, r.status_code, r.text[:300])
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    with caplog.at_level(logging.ERROR):
        one()
    tracebacks = [rec for rec in caplog.records if rec.exc_info or "Traceback" in rec.getMessage()]
    print(f"\nAPI fuzz: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}, "
          f"server errors {app.state.stats['server_errors']}, tracebacks logged {len(tracebacks)}")
    assert app.state.stats["server_errors"] == 0 and not tracebacks
    assert client.get("/health").json()["status"] == "ok"
    assert seen[200] > 0 and seen[400] > 0  # the fuzzer reached the model and the validator alike
    return seen


def test_api_fuzz_short(fuzzed, caplog):
    run_fuzz(fuzzed, int(os.environ.get("API_FUZZ_CASES", 40)), caplog)


@pytest.mark.apifuzz
def test_api_fuzz_long(fuzzed, caplog):
    run_fuzz(fuzzed, int(os.environ.get("API_FUZZ_LONG", 2000)), caplog)
