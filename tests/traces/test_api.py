"""The JSON API against a live platform: input validation (400s with a JSON "error"), summary filters and
grouping, exact percentiles, and an OpenAPI document that describes what the API really answers."""
from __future__ import annotations

import datetime as dt
import json
import time
import urllib.parse
import uuid

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, set_span_in_context
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
CACHES = "/api/v1/caches"
M3 = f"api-model-cached-{TAG}"


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


# -- caches: rows and /api/v1/caches, from spans the OpenTelemetry SDK exported ---------------------------------


@pytest.fixture(scope="module")
def cached(live_platform):
    """Through the gateway, M3: two engine-served requests (1000 prompt tokens, 768 and 0 of them cached), an exact
    response-cache hit under a client and a semantic hit with no client; real SDK exporters, one per process."""
    def tracer(service: str, **resource):
        provider = TracerProvider(resource=Resource.create({"service.name": service, **resource}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
            endpoint=f"{live_platform.url}/v1/traces", headers={"Authorization": f"Bearer {live_platform.keys['alpha']}"})))
        return provider

    providers = [tracer("chat-app"), tracer("llm-gateway"), tracer("vllm", **{"llm_observatory.simulated": True})]
    app, gateway, engine = (p.get_tracer("test") for p in providers)
    hour = (time.time_ns() - 600 * 10**9) // (3600 * 10**9) * 3600 * 10**9
    base, traces = hour + 60 * 10**9, {}
    chat = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": M3,
            "gen_ai.usage.input_tokens": 1000, "gen_ai.usage.output_tokens": 20}

    def span(tracer_, name, kind, start_ms, end_ms, parent=None, **attributes):
        s = tracer_.start_span(name, kind=kind, context=set_span_in_context(parent) if parent else None,
                               start_time=base + int(start_ms * MS), attributes=attributes)
        s.end(end_time=base + int(end_ms * MS))
        return s

    for label, offset, cached_tokens in (("hit768", 0, 768), ("hit0", 2000, 0)):
        client = span(app, "chat", SpanKind.CLIENT, offset, offset + 1200, **chat)
        gw = span(gateway, "chat", SpanKind.SERVER, offset + 10, offset + 1190, client,
                  **chat, **{"gen_ai.usage.cache_read.input_tokens": cached_tokens, "observatory.cache.result": "miss",
                             "observatory.cache.lookup_ms": 0.3, "observatory.cache.miss_reason": "absent"})
        span(engine, "llm_request", SpanKind.SERVER, offset + 20, offset + 1120, gw, **{
            "gen_ai.latency.e2e": 1.1, "gen_ai.latency.time_in_queue": 0.05, "gen_ai.latency.time_in_model_prefill":
            0.15, "gen_ai.latency.time_in_model_decode": 0.8, "gen_ai.usage.prompt_tokens": 1000,
            "gen_ai.usage.completion_tokens": 20, "gen_ai.usage.cache_read.input_tokens": cached_tokens,
            "gen_ai.response.model": M3})
        traces[label] = format(client.get_span_context().trace_id, "032x")
    client = span(app, "chat", SpanKind.CLIENT, 4000, 4040, **chat)
    span(gateway, "chat", SpanKind.SERVER, 4005, 4035, client, **chat, **{
        "observatory.cache.result": "hit", "observatory.cache.served_from": "exact_cache",
        "observatory.cache.lookup_ms": 2.5, "observatory.cache.key": "ab" * 32})
    traces["exact"] = format(client.get_span_context().trace_id, "032x")
    semantic = span(gateway, "chat", SpanKind.SERVER, 5000, 5020, **chat, **{
        "observatory.cache.result": "hit", "observatory.cache.served_from": "semantic_cache",
        "observatory.cache.lookup_ms": 9.0, "observatory.cache.similarity": 0.95})
    traces["semantic"] = format(semantic.get_span_context().trace_id, "032x")
    for provider in providers:
        provider.shutdown()
    live_platform.process.wait_idle()
    return traces, dt.datetime.fromtimestamp(hour // 10**9, dt.timezone.utc)


def test_rows_say_what_served_them_and_their_cached_tokens(live_platform, cached):
    traces, _ = cached
    token = live_platform.tokens["alice"]
    [miss] = requests_of(live_platform, traces["hit768"], token)
    assert (miss["served_from"], miss["cached_prompt_tokens"], miss["lookup_ms"]) == ("engine", 768, None)
    assert (miss["queue_ms"], miss["prefill_ms"]) == (pytest.approx(50.0), pytest.approx(150.0))
    [exact] = requests_of(live_platform, traces["exact"], token)
    assert (exact["served_from"], exact["lookup_ms"], exact["cached_prompt_tokens"]) == ("exact_cache", 2.5, None)
    assert [h["role"] for h in exact["hops"]] == ["client", "gateway"]
    assert (exact["queue_ms"], exact["prefill_ms"], exact["decode_ms"]) == (0.0, 0.0, 0.0)
    assert exact["overhead_ms"] == pytest.approx(30.0 - 2.5) and exact["network_ms"] == pytest.approx(10.0)
    assert exact["e2e_ms"] == pytest.approx(exact["network_ms"] + exact["lookup_ms"] + exact["overhead_ms"])
    [semantic] = requests_of(live_platform, traces["semantic"], token)
    assert (semantic["served_from"], semantic["network_ms"], semantic["overhead_ms"]) == (
        "semantic_cache", None, pytest.approx(11.0))


def test_caches_per_model_and_the_engine_s_own_summary(live_platform, cached):
    _, hour = cached
    status, body = get(live_platform, f"{CACHES}?" + urllib.parse.urlencode({
        "since": hour.isoformat(), "until": (hour + dt.timedelta(hours=1)).isoformat(), "step": "1h", "by": "model",
        "model": M3}))
    assert status == 200, body
    assert (body["step"], body["by"], body["filters"]) == ("1h", "model", {"model": M3})
    [bucket] = body["buckets"]
    [group] = bucket["groups"]
    assert group["key"] == {"model": M3} and group["requests"] == 4
    assert (group["reported_prompt_tokens"], group["cached_prompt_tokens"]) == (2000, 768)
    assert group["token_hit_ratio"] == pytest.approx(768 / 2000)
    assert (group["requests_with_hit"], group["requests_reporting_cached"], group["request_hit_ratio"]) == (1, 2, 0.5)
    assert group["prefill_ms_per_uncached_token"] == pytest.approx(300.0 / (232 + 1000))
    assert group["engine"] == {"requests": 2, "e2e_ms_p50": pytest.approx(1200.0)}
    exact = group["response_cache"]["exact_cache"]
    assert (exact["requests"], exact["share"], exact["e2e_ms_p50"]) == (1, 0.25, pytest.approx(40.0))
    assert exact["latency_saved_ms"] == pytest.approx(1200.0 - 40.0)
    assert group["response_cache"]["semantic_cache"]["latency_saved_ms"] == pytest.approx(1200.0 - 20.0)
    by_class = summary(live_platform, group_by="served_from", model=M3, since=hour.isoformat())
    assert {g["key"]["served_from"]: g["count"] for g in by_class["groups"]} == {
        "engine": 2, "exact_cache": 1, "semantic_cache": 1}
    [engine_only] = summary(live_platform, group_by="", model=M3, served_from="engine", since=hour.isoformat())["groups"]
    assert engine_only["count"] == 2 and engine_only["queue_ms"]["p50"] == pytest.approx(50.0)


@pytest.mark.parametrize("params", [{"step": "0m"}, {"step": "5x"}, {"step": "31d"}, {"by": "gateway"},
                                    {"by": "model,service"}, {"served_from": "engine", "prompt_bucket": "<2k"},
                                    {"since": "2025-01-01T00:00:00Z", "until": "2025-03-01T00:00:00Z", "step": "1m"}])
def test_bad_cache_queries_are_400(live_platform, params):
    status, body = get(live_platform, f"{CACHES}?{urllib.parse.urlencode(params)}")
    assert status == 400 and body["error"], (params, body)


def test_caches_need_a_token_and_see_only_its_projects(live_platform, cached):
    assert get(live_platform, CACHES, token=None)[0] == 401
    status, body = get(live_platform, f"{CACHES}?project=no-such-project")
    assert status == 404, body


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
    assert {"/api/v1/requests", "/api/v1/latency/summary", CACHES} <= set(openapi["paths"])
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
    for path in ("/api/v1/requests", "/api/v1/latency/summary", CACHES):
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


def test_openapi_schemas_cover_the_cache_answers(live_platform, cached, openapi):
    schemas = openapi["components"]["schemas"]
    [row] = requests_of(live_platform, cached[0]["exact"], live_platform.tokens["alice"])
    assert set(row) == set(schemas["Request"]["properties"])
    _, body = get(live_platform, f"{CACHES}?model={M3}")
    group = next(g for b in body["buckets"] for g in b["groups"])
    assert set(body) == set(schemas["Caches"]["properties"]) and set(group) == set(schemas["CacheGroup"]["properties"])
    assert set(group["response_cache"]["exact_cache"]) == set(schemas["CacheClass"]["properties"])
