"""The request rows of a trace must not depend on how its spans arrive (docs/decomposition.md, "Late spans
and arrival order": "Spans of one request may arrive in any order, minutes apart, in different export
batches", and the result does not depend on arrival order).

End to end through a live platform: a fixed set of traces is split into spans, shuffled, cut into
batches (each protobuf or OTLP/JSON, optionally decomposed in between), sent, and the rows of
/api/v1/requests compared with those of an in-order, single-batch delivery of the same traces.
Each delivery uses fresh trace and span ids (a random salt), so deliveries never see each other;
rows are compared after mapping the ids back.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import time
import uuid

import pytest
from benchkit.payloads import add_attribute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from otlp_live_helpers import post_traces, requests_for, to_otlp_json

# Mode-independent (the decomposition in ClickHouse; the database only looks the key up): CI runs it once, in the embedded suite (tests/conftest.py).
pytestmark = pytest.mark.mode_independent(suite="embedded")

MS = 1_000_000
CLIENT_KIND, SERVER_KIND, INTERNAL_KIND = 3, 2, 1
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


# -- trace templates -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SpanSpec:
    key: str
    parent: str  # key of the parent span in the same trace, '' for a root
    role: str  # 'client' | 'gateway' | 'engine' | 'http' | 'internal'
    start_ms: float
    end_ms: float
    prompt: int = 200
    completion: int = 50
    queue_s: float = 0.02
    prefill_s: float = 0.05
    decode_s: float = 0.4
    error: bool = False


RESOURCES = {
    "client": ("chat-app", "opentelemetry.instrumentation.openai_v2", ()),
    "http": ("chat-app", "opentelemetry.instrumentation.httpx", ()),
    "internal": ("chat-app", "agent.framework", ()),
    "gateway": ("llm-gateway", "llm_observatory.gateway", ()),
    "engine": ("vllm", "vllm.tracing", (("vllm.instrumenting_module_name", "vllm.entrypoints.openai"),
                                        ("vllm.process_id", 4242))),
    # A LiteLLM proxy in front of the gateway, forwarding the traceparent it received (so the gateway's span is
    # its sibling), and its litellm_request call span: a chain of two gateways, LiteLLM's processing split off.
    "proxy": ("litellm-proxy", "litellm", ()),
    "lreq": ("litellm-proxy", "litellm", ()),
}


def chain(prefix: str, parent: str, t0: float, *, gateway=True, client=True, http=False, **engine_kw):
    """client -> [http] -> gateway -> engine, nested in time, starting at t0 ms."""
    spans = []
    top = parent
    if client:
        spans.append(SpanSpec(f"{prefix}client", top, "client", t0, t0 + 560))
        top = f"{prefix}client"
    if http:
        spans.append(SpanSpec(f"{prefix}http", top, "http", t0 + 1, t0 + 558))
        top = f"{prefix}http"
    if gateway:
        spans.append(SpanSpec(f"{prefix}gateway", top, "gateway", t0 + 3, t0 + 555))
        top = f"{prefix}gateway"
    spans.append(SpanSpec(f"{prefix}engine", top, "engine", t0 + 6, t0 + 540, **engine_kw))
    return spans


TEMPLATES: dict[str, list[SpanSpec]] = {
    "full_chain": chain("", "", 0),
    "engine_only": chain("", "", 1000, gateway=False, client=False, prompt=3000, completion=2),
    "gateway_engine": chain("", "", 2000, client=False, queue_s=0.0, completion=1),
    "agent_two_calls": [
        SpanSpec("agent", "", "internal", 3000, 4400),
        *chain("first_", "agent", 3010, gateway=False),
        *chain("second_", "agent", 3700, gateway=False, prompt=900, completion=120, decode_s=0.3),
    ],
    "http_in_the_middle": chain("", "", 5000, http=True, prompt=1500),
    "litellm_chain": [
        SpanSpec("client", "", "client", 7000, 7600),
        SpanSpec("http", "client", "http", 7001, 7598),
        SpanSpec("proxy", "http", "proxy", 7003, 7596),
        SpanSpec("lreq", "proxy", "lreq", 7040, 7590),
        SpanSpec("gateway", "http", "gateway", 7050, 7585),
        SpanSpec("engine", "gateway", "engine", 7053, 7575),
    ],
    "gateway_retry": [
        SpanSpec("client", "", "client", 6000, 6900),
        SpanSpec("gateway", "client", "gateway", 6002, 6895),
        SpanSpec("engine_failed", "gateway", "engine", 6005, 6100, completion=0, decode_s=0.0, error=True),
        SpanSpec("engine_ok", "gateway", "engine", 6120, 6880),
    ],
}
SPAN_KEYS = [(name, spec.key) for name, specs in TEMPLATES.items() for spec in specs]
SPECS = {(name, spec.key): spec for name, specs in TEMPLATES.items() for spec in specs}
EXPECTED_ROWS = {"full_chain": 1, "engine_only": 1, "gateway_engine": 1, "agent_two_calls": 2,
                 "http_in_the_middle": 1, "litellm_chain": 1, "gateway_retry": 2}
BASE_NS = (time.time_ns() // 1_000_000_000 - 600) * 1_000_000_000  # one base for every delivery


# -- building OTLP ---------------------------------------------------------------------------------
def trace_id_of(salt: str, template: str) -> str:
    return hashlib.sha256(f"{salt}/{template}".encode()).hexdigest()[:32]


def span_id_of(salt: str, template: str, key: str) -> str:
    return hashlib.sha256(f"{salt}/{template}/{key}".encode()).hexdigest()[:16]


def _attributes(template: str, spec: SpanSpec) -> list[tuple[str, object]]:
    if spec.role == "proxy":  # LiteLLM's proxy span (collectors/litellm.py)
        return [("llm.request.type", "completion"), ("gen_ai.request.model", MODEL), ("llm.is_streaming", "False")]
    if spec.role == "lreq":
        return [("gen_ai.request.model", MODEL)]
    if spec.role in ("client", "gateway"):
        attrs = [("gen_ai.operation.name", "chat"), ("gen_ai.request.model", MODEL),
                 ("gen_ai.response.model", MODEL), ("gen_ai.usage.input_tokens", spec.prompt),
                 ("gen_ai.usage.output_tokens", spec.completion)]
        if spec.role == "client":
            attrs += [("gen_ai.provider.name", "openai"), ("server.address", "gateway.internal")]
        else:
            attrs += [("http.request.method", "POST"), ("url.path", "/v1/chat/completions")]
        return attrs
    if spec.role == "engine":
        overhead_s = 0.004
        e2e = spec.queue_s + spec.prefill_s + spec.decode_s + overhead_s
        return [("gen_ai.response.model", MODEL), ("gen_ai.request.id", f"cmpl-{template}-{spec.key}"),
                ("gen_ai.request.max_tokens", 1024), ("gen_ai.request.temperature", 0.7),
                ("gen_ai.usage.prompt_tokens", spec.prompt), ("gen_ai.usage.completion_tokens", spec.completion),
                ("gen_ai.latency.time_in_queue", spec.queue_s),
                ("gen_ai.latency.time_to_first_token", spec.queue_s + spec.prefill_s),
                ("gen_ai.latency.e2e", e2e), ("gen_ai.latency.time_in_model_prefill", spec.prefill_s),
                ("gen_ai.latency.time_in_model_decode", spec.decode_s),
                ("gen_ai.latency.time_in_model_inference", spec.prefill_s + spec.decode_s)]
    if spec.role == "http":
        return [("http.request.method", "POST"), ("url.full", "http://gateway.internal/v1/chat/completions"),
                ("server.address", "gateway.internal"), ("http.response.status_code", 200)]
    return [("app.step", "plan")]


def build_request(items: list[tuple[str, str]], salt: str, base_ns: int = BASE_NS,
                  times: dict | None = None) -> ExportTraceServiceRequest:
    """One export request holding these (template, span key) spans, grouped by resource and scope."""
    request = ExportTraceServiceRequest()
    scopes = {}
    for template, key in items:
        spec = SPECS[(template, key)]
        service, scope_name, extra = RESOURCES[spec.role]
        scope = scopes.get(spec.role)
        if scope is None:
            rs = request.resource_spans.add()
            for k, v in (("service.name", service), ("telemetry.sdk.language", "python"), *extra):
                add_attribute(rs.resource.attributes, k, v)
            scope = scopes[spec.role] = rs.scope_spans.add()
            scope.scope.name = scope_name
        span = scope.spans.add()
        span.trace_id = bytes.fromhex(trace_id_of(salt, template))
        span.span_id = bytes.fromhex(span_id_of(salt, template, key))
        if spec.parent:
            span.parent_span_id = bytes.fromhex(span_id_of(salt, template, spec.parent))
        span.name = {"client": f"chat {MODEL}", "gateway": f"chat {MODEL}", "engine": "llm_request",
                     "http": "POST", "internal": "agent.run", "proxy": "Received Proxy Server Request",
                     "lreq": "litellm_request"}[spec.role]
        span.kind = {"client": CLIENT_KIND, "http": CLIENT_KIND, "gateway": SERVER_KIND, "engine": SERVER_KIND,
                     "internal": INTERNAL_KIND, "proxy": SERVER_KIND, "lreq": INTERNAL_KIND}[spec.role]
        start_ms, end_ms = (times or {}).get((template, key), (spec.start_ms, spec.end_ms))
        span.start_time_unix_nano = base_ns + int(start_ms * MS)
        span.end_time_unix_nano = base_ns + int(end_ms * MS)
        if spec.error:
            span.status.code = 2
        for k, v in _attributes(template, spec):
            add_attribute(span.attributes, k, v)
    return request


def send(live, request: ExportTraceServiceRequest, as_json: bool = False) -> None:
    body = to_otlp_json(request) if as_json else request.SerializeToString()
    status, _, answer = post_traces(live.process, live.keys["alpha"], body, as_json=as_json)
    assert status == 200, answer
    assert b"rejected" not in answer.lower(), answer


# -- reading back ----------------------------------------------------------------------------------
def normalised_rows(live, salt: str, templates=TEMPLATES) -> dict[str, list[dict]]:
    """{template: rows} with every salted trace/span id mapped back to its template/key."""
    names = {}
    for template in templates:
        names[trace_id_of(salt, template)] = f"<trace {template}>"
        for spec in TEMPLATES[template]:
            names[span_id_of(salt, template, spec.key)] = f"<span {spec.key}>"

    def norm(value):
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items()}
        if isinstance(value, list):
            return [norm(v) for v in value]
        if isinstance(value, str):
            return names.get(value, value)
        return value

    token = live.tokens["alice"]
    return {t: norm(requests_for(live.process, token, trace_id_of(salt, t))) for t in templates}


def diff(actual: dict, expected: dict) -> str:
    lines = []
    for template in expected:
        if actual.get(template) != expected[template]:
            lines.append(f"{template}:\n  got      {actual.get(template)}\n  expected {expected[template]}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def in_order_rows(live_platform):
    """The rows of every template delivered in order, in one protobuf batch."""
    salt = f"ref-{uuid.uuid4().hex}"
    send(live_platform, build_request(SPAN_KEYS, salt))
    live_platform.process.wait_idle(60)
    rows = normalised_rows(live_platform, salt)
    # The reference itself must be right, or comparing with it proves little.
    assert {t: len(r) for t, r in rows.items()} == EXPECTED_ROWS, rows
    assert [h["role"] for h in rows["full_chain"][0]["hops"]] == ["client", "gateway", "engine"]
    assert [h["role"] for h in rows["http_in_the_middle"][0]["hops"]] == ["client", "gateway", "engine"]
    assert all("http" not in h["span_id"] for h in rows["http_in_the_middle"][0]["hops"])
    assert [h["role"] for h in rows["engine_only"][0]["hops"]] == ["engine"]
    assert rows["engine_only"][0]["network_ms"] is None
    assert [h["role"] for h in rows["gateway_engine"][0]["hops"]] == ["gateway", "engine"]
    assert sorted(r["request_key"] for r in rows["agent_two_calls"]) == ["<span first_engine>",
                                                                         "<span second_engine>"]
    [litellm] = rows["litellm_chain"]
    assert [(h["role"], h["service"]) for h in litellm["hops"]] == [
        ("client", "chat-app"), ("gateway", "litellm-proxy"), ("gateway", "llm-gateway"), ("engine", "vllm")]
    assert litellm["gateway_ms"] == pytest.approx(593 - 550, abs=1e-3)  # LiteLLM's span minus litellm_request
    assert litellm["hops"][2]["network_ms"] == pytest.approx(550 - 535, abs=1e-3)
    for template_rows in rows.values():
        for row in template_rows:
            parts = [row[k] for k in ("network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")]
            if None not in parts:
                assert sum(parts) + (row["gateway_ms"] or 0.0) == pytest.approx(row["e2e_ms"], abs=1e-6)
    return rows


# -- properties ------------------------------------------------------------------------------------
@st.composite
def deliveries(draw):
    """A permutation of every span, cut into 1..5 batches, each with an encoding and a 'decompose now' flag."""
    order = draw(st.permutations(SPAN_KEYS))
    batches = draw(st.integers(min_value=1, max_value=5))
    cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=len(order) - 1),
                               min_size=batches - 1, max_size=batches - 1)))
    bounds = [0, *cuts, len(order)]
    parts = [order[a:b] for a, b in zip(bounds, bounds[1:])]
    as_json = draw(st.lists(st.booleans(), min_size=len(parts), max_size=len(parts)))
    settle = draw(st.lists(st.booleans(), min_size=len(parts), max_size=len(parts)))
    return list(zip(parts, as_json, settle))


@given(delivery=deliveries())
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_rows_do_not_depend_on_span_order_or_batching(live_platform, in_order_rows, delivery):
    salt = uuid.uuid4().hex
    for part, as_json, settle in delivery:
        send(live_platform, build_request(part, salt), as_json=as_json)
        if settle:  # let the platform decompose the partial trace before the next batch arrives
            live_platform.process.wait_idle(60)
    live_platform.process.wait_idle(60)
    rows = normalised_rows(live_platform, salt)
    assert rows == in_order_rows, diff(rows, in_order_rows)


# -- deterministic late arrivals -------------------------------------------------------------------
def _deliver_in_steps(live, template: str, steps: list[list[str]], salt: str, times=None, base_ns=BASE_NS):
    for keys in steps:
        send(live, build_request([(template, k) for k in keys], salt, base_ns=base_ns, times=times))
        live.process.wait_idle(60)


def test_client_span_arriving_after_the_engine_was_decomposed(live_platform, in_order_rows):
    salt = uuid.uuid4().hex
    _deliver_in_steps(live_platform, "full_chain", [["engine", "gateway"]], salt)
    partial = normalised_rows(live_platform, salt, ["full_chain"])["full_chain"]
    assert len(partial) == 1 and [h["role"] for h in partial[0]["hops"]] == ["gateway", "engine"]
    _deliver_in_steps(live_platform, "full_chain", [["client"]], salt)
    final = normalised_rows(live_platform, salt, ["full_chain"])
    assert final["full_chain"] == in_order_rows["full_chain"]


def test_engine_arriving_last_replaces_the_gateway_anchored_row(live_platform, in_order_rows):
    """Before the engine span arrives, the gateway anchors its own row (a different request_key): that
    row must be cancelled, not left next to the final one."""
    salt = uuid.uuid4().hex
    _deliver_in_steps(live_platform, "full_chain", [["client"], ["gateway"]], salt)
    partial = normalised_rows(live_platform, salt, ["full_chain"])["full_chain"]
    assert len(partial) == 1 and partial[0]["request_key"] == "<span gateway>"
    _deliver_in_steps(live_platform, "full_chain", [["engine"]], salt)
    final = normalised_rows(live_platform, salt, ["full_chain"])
    assert final["full_chain"] == in_order_rows["full_chain"]


def test_second_agent_call_and_the_agent_root_arriving_late(live_platform, in_order_rows):
    salt = uuid.uuid4().hex
    _deliver_in_steps(live_platform, "agent_two_calls",
                      [["first_engine"], ["second_client", "first_client"], ["second_engine"], ["agent"]], salt)
    final = normalised_rows(live_platform, salt, ["agent_two_calls"])
    assert final["agent_two_calls"] == in_order_rows["agent_two_calls"]


def test_http_span_in_the_middle_arriving_last(live_platform, in_order_rows):
    """Until the http span arrives, the client is cut off from the gateway (a missing link): the client
    anchors a row of its own. When the link arrives, that row must disappear."""
    salt = uuid.uuid4().hex
    _deliver_in_steps(live_platform, "http_in_the_middle", [["engine", "gateway", "client"]], salt)
    partial = normalised_rows(live_platform, salt, ["http_in_the_middle"])["http_in_the_middle"]
    assert len(partial) == 2, partial
    _deliver_in_steps(live_platform, "http_in_the_middle", [["http"]], salt)
    final = normalised_rows(live_platform, salt, ["http_in_the_middle"])
    assert final["http_in_the_middle"] == in_order_rows["http_in_the_middle"]


def test_late_outer_hop_moving_the_request_to_the_previous_day(live_platform):
    """The engine span starts just after midnight UTC; the client span that arrives later started just
    before it. The request's start_time (the outermost hop's) moves to the previous day, i.e. to another
    daily partition of llm_requests: exactly one row must remain, in the API and in the summary."""
    midnight = dt.datetime.now(dt.timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    base_ns = int(midnight.timestamp()) * 1_000_000_000  # today 00:00:00 UTC (at most a day ago)
    times = {("full_chain", "client"): (-300, 600), ("full_chain", "gateway"): (-200, 590),
             ("full_chain", "engine"): (100, 580)}
    salt = uuid.uuid4().hex
    token = live_platform.tokens["alice"]
    trace_id = trace_id_of(salt, "full_chain")

    def summary_count() -> int:
        window = {"since": midnight - dt.timedelta(hours=2), "until": midnight + dt.timedelta(hours=2)}
        query = "&".join(f"{k}={v.isoformat().replace('+00:00', 'Z')}" for k, v in window.items())
        status, body = live_platform.process.get(f"/api/v1/latency/summary?group_by=&exact=1&{query}", token)
        assert status == 200, body
        return sum(g["count"] for g in body["groups"])

    count_before = summary_count()
    _deliver_in_steps(live_platform, "full_chain", [["engine"]], salt, times=times, base_ns=base_ns)
    rows = requests_for(live_platform.process, token, trace_id)
    assert len(rows) == 1 and rows[0]["start_time"].startswith(midnight.date().isoformat()), rows
    assert summary_count() == count_before + 1

    _deliver_in_steps(live_platform, "full_chain", [["gateway", "client"]], salt, times=times, base_ns=base_ns)
    rows = requests_for(live_platform.process, token, trace_id)
    previous_day = (midnight - dt.timedelta(days=1)).date().isoformat()
    assert len(rows) == 1, rows
    assert rows[0]["start_time"].startswith(previous_day), rows
    assert [h["role"] for h in rows[0]["hops"]] == ["client", "gateway", "engine"]
    assert summary_count() == count_before + 1
