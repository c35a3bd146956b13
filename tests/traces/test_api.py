"""The JSON API against a live platform: input validation (400s with a JSON "error"), summary filters and
grouping, exact percentiles, and an OpenAPI document that describes what the API really answers."""
from __future__ import annotations

import datetime as dt
import json
import time
import urllib.parse
import uuid

import pytest
from otlp_payloads import (
    MS,
    api,
    engine_span,
    export_protobuf,
    http_get,
    pb_request,
    requests_of,
    vllm_resource,
)

TAG = uuid.uuid4().hex[:8]
M1, M2 = f"api-model-one-{TAG}", f"api-model-two-{TAG}"
SVC_A, SVC_B = f"svc-a-{TAG}", f"svc-b-{TAG}"
CFG_1, CFG_2 = f"cfg-1-{TAG}", f"cfg-2-{TAG}"
STABLE, CANARY = f"stable-{TAG}", f"canary-{TAG}"
SUMMARY = "/api/v1/latency/summary"


def engine_request(model: str, service: str, config: str, e2e_s: float, prompt_tokens: int, start_ns: int,
                   replica_group: str | None = None):
    span = engine_span(model=model, e2e_s=e2e_s, queue_s=e2e_s / 8, prefill_s=e2e_s / 4, decode_s=e2e_s / 2,
                       ttft_s=e2e_s / 2, prompt_tokens=prompt_tokens, completion_tokens=11, start_ns=start_ns)
    return vllm_resource(service, engine_config=config, replica_group=replica_group), span


@pytest.fixture(scope="module")
def dataset(live_platform):
    """Three requests of M1 (e2e 100/200/400 ms, svc-a, cfg-1, short prompts; replica groups stable, canary,
    stable), one of M2 (900 ms, svc-b, cfg-2, no replica group)."""
    start = time.time_ns() - 60_000 * MS
    groups = [engine_request(M1, SVC_A, CFG_1, e2e, 100, start + i * MS, replica_group)
              for i, (e2e, replica_group) in enumerate(((0.1, STABLE), (0.4, CANARY), (0.2, STABLE)))]
    groups.append(engine_request(M2, SVC_B, CFG_2, 0.9, 5000, start))
    export_protobuf(live_platform, pb_request(*[(resource, [span]) for resource, span in groups]),
                    live_platform.keys["alpha"])
    live_platform.process.wait_idle()
    return {"traces": [span.trace_id.hex() for _, span in groups]}


def get(live_platform, path: str, token: str | None = "alice"):
    return api(live_platform, path, live_platform.tokens[token] if token else None)


def summary(live_platform, **params):
    status, body = get(live_platform, f"{SUMMARY}?{urllib.parse.urlencode(params)}")
    assert status == 200, body
    return body


# -- /api/v1/requests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("trace_id", ["", "abc", "a" * 31, "a" * 33, "g" * 32, "0x" + "a" * 30, "a" * 32 + "\n",
                                      "a" * 32 + " ", " " + "a" * 32, "a" * 16 + "-" + "a" * 15, "é" * 32])
def test_trace_id_must_be_32_hex_characters(live_platform, trace_id):
    status, body = get(live_platform, f"/api/v1/requests?trace_id={urllib.parse.quote(trace_id)}")
    assert status == 400, body
    assert "trace_id" in body["error"]


def test_trace_id_is_required(live_platform):
    status, body = get(live_platform, "/api/v1/requests")
    assert status == 400 and "trace_id" in body["error"]


def test_trace_id_is_case_insensitive(live_platform, dataset):
    trace_id = dataset["traces"][0]
    [lower] = requests_of(live_platform, trace_id, live_platform.tokens["alice"])
    [upper] = requests_of(live_platform, trace_id.upper(), live_platform.tokens["alice"])
    assert lower == upper and lower["trace_id"] == trace_id


def test_requests_carry_the_replica_group(live_platform, dataset):
    token = live_platform.tokens["alice"]
    [first] = requests_of(live_platform, dataset["traces"][1], token)
    assert first["replica_group"] == CANARY
    [unknown] = requests_of(live_platform, dataset["traces"][3], token)
    assert unknown["replica_group"] == ""  # the engine did not say


def test_unknown_trace_is_an_empty_list(live_platform):
    assert requests_of(live_platform, uuid.uuid4().hex, live_platform.tokens["alice"]) == []


# -- /api/v1/latency/summary: validation ---------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    {"since": "yesterday"},
    {"until": "2026-02-30T00:00:00Z"},
    {"since": "2026-01-01T25:00:00Z"},
    {"until": "1700000000"},
    {"since": "2026-01-01T00:00:00+25:00"},
    {"since": "2026-01-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"},          # empty range
    {"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"},          # reversed
    {"since": "2026-01-01T00:00:00+00:00", "until": "2025-12-31T23:00:00-01:00"},  # equal instants
    {"since": "2024-01-01T00:00:00Z", "until": "2025-02-05T00:00:01Z"},          # 401 days
    {"since": "2000-01-01T00:00:00Z"},                                           # ~27 years up to now
    # year-1 edges: outside what the store can hold, and easy to overflow while parsing
    {"until": "0001-01-01T00:30:00Z"},
    {"until": "0001-01-01T00:30:00+01:00"},
    {"since": "0001-01-01T00:00:00Z", "until": "0001-01-01T00:30:00Z"},
    {"since": "9999-12-31T23:00:00Z", "until": "9999-12-31T23:59:59-01:00"},
])
def test_bad_time_ranges_are_400(live_platform, params):
    status, body = get(live_platform, f"{SUMMARY}?{urllib.parse.urlencode(params)}")
    assert status == 400, (params, status, body)
    assert body["error"]


def test_time_range_defaults_and_limits(live_platform, dataset):
    body = summary(live_platform)
    until = dt.datetime.fromisoformat(body["until"].replace("Z", "+00:00"))
    since = dt.datetime.fromisoformat(body["since"].replace("Z", "+00:00"))
    assert until - since == dt.timedelta(hours=1)
    assert abs((dt.datetime.now(dt.timezone.utc) - until).total_seconds()) < 60
    assert summary(live_platform, since="", until="")["group_by"] == ["model"]  # empty means default
    exactly = summary(live_platform, since="2024-01-01T00:00:00Z", until="2025-02-04T00:00:00Z")  # 400 days
    assert (exactly["since"], exactly["until"]) == ("2024-01-01T00:00:00Z", "2025-02-04T00:00:00Z")
    naive = summary(live_platform, since="2026-01-01T00:00:00", until="2026-01-01T03:00:00+02:00")
    assert (naive["since"], naive["until"]) == ("2026-01-01T00:00:00Z", "2026-01-01T01:00:00Z")  # naive = UTC


@pytest.mark.parametrize("group_by", ["colour", "model,Model", "MODEL", "model,,service", ",model",
                                      "model;service", "trace_id", "start_time"])
def test_bad_group_by_is_400(live_platform, group_by):
    status, body = get(live_platform, f"{SUMMARY}?group_by={urllib.parse.quote(group_by)}")
    assert status == 400, body
    assert "group_by" in body["error"]


def test_group_by_combinations(live_platform, dataset):
    body = summary(live_platform, group_by="service,engine_config,prompt_bucket", model=M1)
    assert body["group_by"] == ["service", "engine_config", "prompt_bucket"]
    [group] = body["groups"]
    assert group["key"] == {"service": SVC_A, "engine_config": CFG_1, "prompt_bucket": "<256"}
    assert group["count"] == 3
    # A dimension named twice is taken once (the OpenAPI pattern cannot say "no repeats", so the API accepts them).
    assert summary(live_platform, group_by="model,service,model")["group_by"] == ["model", "service"]
    overall = summary(live_platform, group_by="", model=M1)
    assert overall["group_by"] == [] and [g["key"] for g in overall["groups"]] == [{}]
    assert overall["groups"][0]["count"] == 3
    by_group = summary(live_platform, group_by="replica_group", model=M1, exact="1")
    assert {g["key"]["replica_group"]: (g["count"], g["e2e_ms"]["p50"]) for g in by_group["groups"]} == {
        STABLE: (2, pytest.approx(200.0, abs=0.001)), CANARY: (1, pytest.approx(400.0, abs=0.001))}


# -- filters and percentiles -----------------------------------------------------------------------------------


@pytest.mark.parametrize("filters, expected", [
    ({"model": M1}, {M1: 3}),
    ({"model": M2}, {M2: 1}),
    ({"service": SVC_B}, {M2: 1}),
    ({"service": SVC_A}, {M1: 3}),
    ({"engine_config": CFG_1}, {M1: 3}),
    ({"engine_config": CFG_2}, {M2: 1}),
    ({"prompt_bucket": "<16k", "service": SVC_B}, {M2: 1}),
    ({"model": M1, "service": SVC_B}, {}),
    ({"model": M1, "engine_config": CFG_1, "service": SVC_A}, {M1: 3}),
    ({"replica_group": CANARY}, {M1: 1}),
    ({"replica_group": STABLE, "model": M1}, {M1: 2}),
    ({"replica_group": CANARY, "model": M2}, {}),
    ({"model": "no-such-model"}, {}),
    ({"model": "' OR 1=1 --"}, {}),
])
def test_filters(live_platform, dataset, filters, expected):
    body = summary(live_platform, group_by="model", **filters)
    assert body["filters"] == filters
    assert {g["key"]["model"]: g["count"] for g in body["groups"]} == expected


@pytest.mark.parametrize("flag", ["1", "true", "yes", "TRUE"])
def test_exact_percentiles(live_platform, dataset, flag):
    body = summary(live_platform, group_by="model", model=M1, exact=flag)
    assert body["quantiles"]["method"] == "exact"
    [group] = body["groups"]
    assert (group["count"], group["errors"]) == (3, 0)
    # quantilesExact over the sorted values [100, 200, 400]: the element at floor(q * n)
    assert group["e2e_ms"] == {"p50": pytest.approx(200.0, abs=0.001), "p95": pytest.approx(400.0, abs=0.001),
                               "p99": pytest.approx(400.0, abs=0.001)}
    assert group["decode_ms"] == {"p50": pytest.approx(100.0, abs=0.001), "p95": pytest.approx(200.0, abs=0.001)}
    assert group["queue_ms"]["p50"] == pytest.approx(25.0, abs=0.001)
    assert group["network_ms"] == {"p50": None, "p95": None}  # engine-only requests: network not observed
    assert group["tpot_ms"]["p50"] == pytest.approx(10.0, abs=0.001)  # 100 / (11 - 1)


def test_approximate_percentiles_by_default(live_platform, dataset):
    for exact in ("", "0", "no"):
        body = summary(live_platform, group_by="model", model=M1, exact=exact)
        assert body["quantiles"]["method"] == "t-digest" and body["quantiles"]["error"]
        [group] = body["groups"]
        assert group["count"] == 3
        for q in ("p50", "p95", "p99"):
            assert 100.0 - 0.001 <= group["e2e_ms"][q] <= 400.0 + 0.001
    [single] = summary(live_platform, group_by="model", model=M2)["groups"]
    assert single["e2e_ms"]["p50"] == pytest.approx(900.0, abs=0.001)


# -- errors are JSON -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("path", ["/api/v1/requests?trace_id=" + "a" * 32, SUMMARY])
def test_other_methods_are_405_json(live_platform, method, path):
    status, content_type, body = http_get(live_platform.url + path, live_platform.tokens["alice"], method=method)
    assert status == 405
    assert content_type.startswith("application/json"), (content_type, body[:200])
    assert json.loads(body)["error"]


@pytest.mark.parametrize("path", ["/api/v1/nope", "/api/v1/requests/extra", "/api/v2/requests", "/api/"])
def test_unknown_api_paths_are_404_json(live_platform, path):
    status, body = get(live_platform, path)
    assert status == 404 and body["error"]


def test_head_is_allowed_like_get(live_platform):
    status, _, body = http_get(live_platform.url + SUMMARY, live_platform.tokens["alice"], method="HEAD")
    assert status == 200 and body == b""


# -- OpenAPI -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openapi(live_platform):
    status, content_type, body = http_get(live_platform.url + "/api/v1/openapi.json")
    assert status == 200 and content_type.startswith("application/json")
    return json.loads(body)


def resolve(document: dict, ref: str) -> dict:
    assert ref.startswith("#/"), ref
    node = document
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def test_openapi_document_is_3_1_with_both_paths(openapi):
    assert openapi["openapi"] == "3.1.0"
    assert openapi["info"]["title"] and openapi["info"]["version"]
    assert {"/api/v1/requests", "/api/v1/latency/summary"} <= set(openapi["paths"])
    [scheme] = openapi["components"]["securitySchemes"].values()
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    parameters = {p["name"]: p for p in openapi["paths"]["/api/v1/requests"]["get"]["parameters"]}
    assert parameters["trace_id"]["required"] is True
    summary_parameters = {p["name"] for p in openapi["paths"]["/api/v1/latency/summary"]["get"]["parameters"]}
    assert {"since", "until", "group_by", "exact", "project", "model", "service", "engine_config",
            "prompt_bucket", "replica_group"} <= summary_parameters


def test_openapi_refs_resolve(openapi):
    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref":
                    assert isinstance(resolve(openapi, value), dict), value
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(openapi)


def test_openapi_documents_every_error_status(openapi):
    """Each endpoint can answer 400 (bad input or several projects), 401, 403 (token without project),
    404 (unknown project) and 503; each must be documented with the Error schema."""
    for path in ("/api/v1/requests", "/api/v1/latency/summary"):
        responses = openapi["paths"][path]["get"]["responses"]
        for status in ("200", "400", "401", "403", "404", "503"):
            assert status in responses, (path, status)
        for status in ("400", "401", "403", "404", "503"):
            schema = responses[status]["content"]["application/json"]["schema"]
            assert resolve(openapi, schema["$ref"])["required"] == ["error"]


def test_openapi_schemas_cover_the_real_answers(live_platform, dataset, openapi):
    schemas = openapi["components"]["schemas"]
    [row] = requests_of(live_platform, dataset["traces"][0], live_platform.tokens["alice"])
    assert set(row) <= set(schemas["Request"]["properties"]), set(row) - set(schemas["Request"]["properties"])
    assert set(row["hops"][0]) <= set(schemas["Hop"]["properties"])
    body = summary(live_platform, group_by="model", model=M1)
    response_schema = openapi["paths"]["/api/v1/latency/summary"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]
    if "$ref" in response_schema:
        response_schema = resolve(openapi, response_schema["$ref"])
    assert set(body) <= set(response_schema["properties"]), set(body) - set(response_schema["properties"])
    assert set(body["groups"][0]) <= set(schemas["SummaryGroup"]["properties"])
