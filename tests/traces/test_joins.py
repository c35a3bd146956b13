"""Joins across broken trace propagation (traces/joins.py): one call whose hops landed in several traces is one
row, joined by the response id both sides recorded, marked `joined_by: response_id`; never on an ambiguous id,
never across projects or far apart in time; the same whatever the arrival order, minutes apart or rebuilt."""
from __future__ import annotations

import itertools
import time
import uuid

import pytest
from benchkit.payloads import add_attribute
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from otlp_live_helpers import post_traces, requests_for
from traces.decomposition import decompose_trace
from traces.joins import JOIN_WINDOW_NS, join_traces, lookup_values, normalize_id

from collectors.base import LLMCall, Role

# Mode-independent (joins in ClickHouse; the database only looks the key up): CI runs it once, in the server suite (tests/conftest.py).
pytestmark = pytest.mark.mode_independent(suite="server")

MS = 1_000_000
RID = "chatcmpl-5f1d2a9c0b7e4e43a1d6c2b8e9f0a1b2"


def call(trace, span_id, parent, role, start_ms, end_ms, **kw) -> LLMCall:
    kw.setdefault("convention", {"engine": "vllm", "gateway": "genai", "client": "genai"}[role])
    kw.setdefault("service", {"engine": "vllm", "gateway": "llm-gateway", "client": "app"}[role])
    kw.setdefault("name", "llm_request" if role == "engine" else "chat llama")
    return LLMCall(trace_id=trace, span_id=span_id, parent_span_id=parent, role=Role(role),
                   start_ns=int(round(start_ms * MS)), end_ns=int(round(end_ms * MS)), **kw)


def engine(trace, span_id, parent, start_ms, end_ms, **kw) -> LLMCall:
    figures = dict(engine_e2e_ms=end_ms - start_ms - 2.0, queue_ms=10.0, prefill_ms=40.0,
                   decode_ms=end_ms - start_ms - 60.0, ttft_ms=50.0, prompt_tokens=100, completion_tokens=20,
                   request_id=RID, model="llama", engine_config="cfg")
    figures.update(kw)
    return call(trace, span_id, parent, "engine", start_ms, end_ms, **figures)


def decomposed(*traces):
    """{trace: (calls, parents, times)} and each trace decomposed alone."""
    data = {}
    for trace, calls, extra_parents, times in traces:
        parents = {c.span_id: c.parent_span_id for c in calls}
        parents.update(extra_parents)
        data[trace] = (calls, parents, times)
    records = {t: decompose_trace(calls, parents, times) for t, (calls, parents, times) in data.items()}
    return data, records


def exact_sum(row) -> float:
    return row.network_ms + (row.gateway_ms or 0.0) + row.overhead_ms + row.queue_ms + row.prefill_ms + row.decode_ms


def client_trace(trace="a" * 32, rid=RID, start=0.0, end=1000.0, span="c1"):
    return (trace, [call(trace, span, "", "client", start, end, request_id=rid, ttft_ms=120.0)], {}, None)


def engine_trace(trace="b" * 32, rid=RID, start=20.0, end=980.0, gateway=True, prefix=""):
    calls = [engine(trace, f"{prefix}e1", f"{prefix}g1" if gateway else "", start + 5, end - 5, request_id=rid)]
    if gateway:
        calls.append(call(trace, f"{prefix}g1", "", "gateway", start, end, request_id=rid))
    return (trace, calls, {}, None)


# -- the join itself -----------------------------------------------------------------------------------------
def test_client_and_gateway_engine_in_two_traces_are_one_row():
    data, records = decomposed(client_trace(), engine_trace())
    assert [len(r) for r in records.values()] == [1, 1]  # alone: a client-only row and a gateway+engine row
    joined = join_traces(data, records)
    assert joined["a" * 32] == []
    [row] = joined["b" * 32]
    assert [(h.role, h.trace_id) for h in row.hops] == [("client", "a" * 32), ("gateway", "b" * 32),
                                                         ("engine", "b" * 32)]
    assert row.joined_by == "response_id" and row.linked_trace_ids == ("a" * 32,)
    assert row.trace_id == "b" * 32 and row.request_key == "e1"
    assert row.start_ns == 0 and row.service == "app" and row.e2e_ms == pytest.approx(1000.0)
    assert row.ttft_ms == 120.0  # the client's, as in a propagated trace
    assert row.hops[1].network_ms == pytest.approx(1000 - 960)
    assert row.network_client_gateway_ms == pytest.approx(40.0)
    assert row.e2e_ms == pytest.approx(exact_sum(row), abs=1e-9)


def test_the_joined_row_is_the_row_of_the_same_call_propagated():
    """Joining changes nothing but the marks: the figures are those of the one-trace chain."""
    data, records = decomposed(client_trace(), engine_trace())
    [joined] = join_traces(data, records)["b" * 32]
    one_trace = [call("b" * 32, "c1", "", "client", 0, 1000, request_id=RID, ttft_ms=120.0),
                 call("b" * 32, "g1", "c1", "gateway", 20, 980, request_id=RID),
                 engine("b" * 32, "e1", "g1", 25, 975, request_id=RID)]
    [propagated] = decompose_trace(one_trace, {c.span_id: c.parent_span_id for c in one_trace})
    for field in ("e2e_ms", "ttft_ms", "network_ms", "gateway_ms", "overhead_ms", "queue_ms", "prefill_ms",
                  "decode_ms", "network_client_gateway_ms", "network_gateway_engine_ms", "model", "request_id",
                  "prompt_tokens", "completion_tokens", "tpot_ms", "status", "start_ns", "service"):
        assert getattr(joined, field) == getattr(propagated, field), field
    assert [(h.role, h.network_ms, h.unattributed_ms) for h in joined.hops] == \
        [(h.role, h.network_ms, h.unattributed_ms) for h in propagated.hops]


def test_litellm_without_forwarding_joins_with_its_processing_split():
    """App + LiteLLM (with its litellm_request call span) in one trace, the gateway + engine in another."""
    a, b = "a" * 32, "b" * 32
    app = [call(a, "c1", "", "client", 0, 1000, request_id=RID),
           call(a, "lit", "http", "gateway", 5, 990, service="litellm-proxy", convention="litellm", request_id=RID)]
    data, records = decomposed((a, app, {"http": "c1", "lreq": "lit"}, {"lreq": (40 * MS, 985 * MS)}),
                               engine_trace(b, start=50, end=970))
    [row] = join_traces(data, records)[b]
    assert [(h.role, h.service) for h in row.hops] == [("client", "app"), ("gateway", "litellm-proxy"),
                                                        ("gateway", "llm-gateway"), ("engine", "vllm")]
    client_hop, litellm_hop, gateway_hop, engine_hop = row.hops
    assert litellm_hop.network_ms == pytest.approx(1000 - 985)
    assert litellm_hop.processing_ms == pytest.approx(985 - 945)  # its span minus litellm_request
    assert gateway_hop.network_ms == pytest.approx(945 - 920)     # litellm_request minus the gateway
    assert row.gateway_ms == pytest.approx(40.0)
    assert row.e2e_ms == pytest.approx(exact_sum(row), abs=1e-9)


def test_three_pieces_client_litellm_and_gateway_engine_chain():
    """OpenInference without HTTP instrumentation (no traceparent) and LiteLLM not forwarding: three traces."""
    a, l, b = "a" * 32, "c" * 32, "b" * 32
    lite = (l, [call(l, "lit", "", "gateway", 10, 990, service="litellm-proxy", convention="litellm",
                     request_id=RID)], {}, None)
    data, records = decomposed(client_trace(a), lite, engine_trace(b, start=30, end=970))
    joined = join_traces(data, records)
    assert joined[a] == [] and joined[l] == []
    [row] = joined[b]
    assert [h.role for h in row.hops] == ["client", "gateway", "gateway", "engine"]
    assert [h.trace_id for h in row.hops] == [a, l, b, b]
    assert row.linked_trace_ids == (a, l)
    assert row.e2e_ms == pytest.approx(exact_sum(row), abs=1e-9)


def test_engine_only_piece_under_a_client():
    data, records = decomposed(client_trace(), engine_trace(gateway=False))
    [row] = join_traces(data, records)["b" * 32]
    assert [h.role for h in row.hops] == ["client", "engine"] and row.network_ms is not None


def test_completions_ids_carry_the_prompt_index_on_the_engine_side():
    assert normalize_id("cmpl-abc123def-0") == "cmpl-abc123def" and normalize_id("short") is None
    assert lookup_values(["cmpl-abc123def"]) == ["cmpl-abc123def", "cmpl-abc123def-0"]
    data, records = decomposed(client_trace(rid="cmpl-abc123def"),
                               engine_trace(rid="cmpl-abc123def-0", gateway=False))
    [row] = join_traces(data, records)["b" * 32]
    assert row.joined_by == "response_id"


# -- no join on ambiguity ------------------------------------------------------------------------------------
def test_two_clients_with_one_response_id_join_nothing():
    data, records = decomposed(client_trace("a" * 32), client_trace("d" * 32, span="c2"), engine_trace())
    assert join_traces(data, records) is records


def test_two_engines_reporting_one_id_join_nothing():
    data, records = decomposed(client_trace(), engine_trace("b" * 32), engine_trace("e" * 32, prefix="x"))
    assert join_traces(data, records) is records


def test_pieces_farther_apart_than_the_window_join_nothing():
    far = JOIN_WINDOW_NS / MS + 1000.0
    data, records = decomposed(client_trace(), engine_trace(start=far, end=far + 900))
    assert join_traces(data, records) is records


def test_complete_rows_and_other_ids_are_left_alone():
    """A propagated chain is never a piece; a piece whose id nothing else holds stays as it was."""
    a, b = "a" * 32, "b" * 32
    full = [call(a, "c1", "", "client", 0, 1000, request_id=RID), engine(a, "e1", "c1", 10, 990)]
    data, records = decomposed((a, full, {}, None), engine_trace(b, rid="chatcmpl-other-0000000000"))
    assert join_traces(data, records) is records


def test_agent_trace_with_two_calls_each_joined_to_its_engine_trace():
    a = "a" * 32
    rid2 = "chatcmpl-99999999999999999999999999999999"
    agent = [call(a, "c1", "root", "client", 0, 1000, request_id=RID),
             call(a, "c2", "root", "client", 1100, 1600, request_id=rid2)]
    data, records = decomposed((a, agent, {"root": ""}, None), engine_trace("b" * 32),
                               engine_trace("e" * 32, rid=rid2, start=1120, end=1580, prefix="y"))
    joined = join_traces(data, records)
    assert joined[a] == []
    assert [r.hops[0].span_id for r in joined["b" * 32]] == ["c1"]
    assert [r.hops[0].span_id for r in joined["e" * 32]] == ["c2"]


def test_the_join_does_not_depend_on_the_order_of_traces_or_calls():
    pieces = [client_trace(), engine_trace()]
    expected = None
    for order in itertools.permutations(pieces):
        reordered = [(t, list(reversed(calls)), extra, times) for t, calls, extra, times in order]
        data, records = decomposed(*reordered)
        result = {t: rows for t, rows in join_traces(data, records).items() if rows}
        expected = expected or result
        assert result == expected


# -- through a live platform: OTLP in, API out ---------------------------------------------------------------
CLIENT_KIND, SERVER_KIND = 3, 2


def _span(scope, trace_id, span_id, parent, name, kind, start_ns, end_ns, attributes):
    span = scope.spans.add()
    span.trace_id = bytes.fromhex(trace_id)
    span.span_id = bytes.fromhex(span_id)
    if parent:
        span.parent_span_id = bytes.fromhex(parent)
    span.name, span.kind = name, kind
    span.start_time_unix_nano, span.end_time_unix_nano = start_ns, end_ns
    for key, value in attributes:
        add_attribute(span.attributes, key, value)


def _request(service, scope_name, spans) -> bytes:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    add_attribute(rs.resource.attributes, "service.name", service)
    scope = rs.scope_spans.add()
    scope.scope.name = scope_name
    for span in spans:
        _span(scope, *span)
    return request.SerializeToString()


class Call:
    """One chat completion split over two traces: the app's (client span) and the gateway's (gateway + engine)."""

    def __init__(self, base_ns: int, response_id: str | None = None):
        self.app_trace, self.engine_trace = uuid.uuid4().hex, uuid.uuid4().hex
        self.client, self.gateway, self.engine = (uuid.uuid4().hex[:16] for _ in range(3))
        self.rid = response_id or f"chatcmpl-{uuid.uuid4().hex}"
        self.base = base_ns

    def app(self) -> bytes:
        return _request("chat-app", "opentelemetry.instrumentation.openai_v2", [(
            self.app_trace, self.client, "", "chat llama", CLIENT_KIND, self.base, self.base + 800 * MS,
            [("gen_ai.operation.name", "chat"), ("gen_ai.provider.name", "openai"), ("gen_ai.request.model", "llama"),
             ("gen_ai.response.id", self.rid), ("gen_ai.usage.input_tokens", 50),
             ("gen_ai.usage.output_tokens", 20)])])

    def serving(self, gateway_parent: str = "", with_gateway: bool = True) -> list[bytes]:
        """The gateway's span and the engine's, in two exports (or the engine's alone, a root)."""
        gateway = _request("llm-gateway", "llm_observatory.gateway", [(
            self.engine_trace, self.gateway, gateway_parent, "chat llama", SERVER_KIND, self.base + 30 * MS, self.base + 770 * MS,
            [("gen_ai.operation.name", "chat"), ("gen_ai.request.model", "llama"), ("gen_ai.response.id", self.rid),
             ("http.request.method", "POST"), ("url.path", "/v1/chat/completions")])])
        engine_span = _request("vllm", "vllm.tracing.otel", [(
            self.engine_trace, self.engine, self.gateway if with_gateway else "", "llm_request", SERVER_KIND, self.base + 35 * MS,
            self.base + 760 * MS,
            [("gen_ai.request.id", self.rid), ("gen_ai.response.model", "llama"), ("gen_ai.usage.prompt_tokens", 50),
             ("gen_ai.usage.completion_tokens", 20), ("gen_ai.latency.time_in_queue", 0.01),
             ("gen_ai.latency.time_to_first_token", 0.06), ("gen_ai.latency.e2e", 0.72),
             ("gen_ai.latency.time_in_model_prefill", 0.05), ("gen_ai.latency.time_in_model_decode", 0.65),
             ("gen_ai.latency.time_in_model_inference", 0.70)])])
        return [gateway, engine_span] if with_gateway else [engine_span]


def _send(live, body: bytes, key: str = "alpha") -> None:
    status, _, answer = post_traces(live.process, live.keys[key], body)
    assert status == 200, answer


def _rows(live, trace_id: str, token: str = "alice") -> list[dict]:
    return requests_for(live.process, live.tokens[token], trace_id)


def _assert_joined(live, c: Call) -> dict:
    for trace in (c.app_trace, c.engine_trace):  # found by either trace
        rows = _rows(live, trace)
        assert len(rows) == 1, rows
    [row] = rows
    assert row["trace_id"] == c.engine_trace and row["joined_by"] == "response_id"
    assert row["linked_trace_ids"] == [c.app_trace]
    assert [(h["role"], h["trace_id"]) for h in row["hops"]] == [
        ("client", c.app_trace), ("gateway", c.engine_trace), ("engine", c.engine_trace)]
    assert row["e2e_ms"] == pytest.approx(800.0) and row["request_id"] == c.rid
    parts = [row[k] for k in ("network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")]
    assert sum(parts) == pytest.approx(row["e2e_ms"], abs=1e-6)
    return row


ORDERS = {
    "app first": lambda c: [[c.app()], c.serving()],
    "serving first": lambda c: [c.serving(), [c.app()]],
    "engine, app, then gateway": lambda c: [[c.serving()[1]], [c.app()], [c.serving()[0]]],
    "all in one go": lambda c: [[c.app(), *c.serving()]],
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_pieces_arriving_apart_in_any_order_become_one_row(live_platform, order):
    c = Call(time.time_ns() - 120 * 1_000_000_000)
    for step in ORDERS[order](c):
        for body in step:
            _send(live_platform, body)
        live_platform.process.wait_idle(60)  # decomposed in between: the first piece gets its own row first
    _assert_joined(live_platform, c)


def test_a_late_second_claimant_undoes_the_join(live_platform):
    """A join made earlier is cancelled when another trace turns up with the same id: no join on ambiguity."""
    c = Call(time.time_ns() - 120 * 1_000_000_000)
    for body in [c.app(), *c.serving()]:
        _send(live_platform, body)
    live_platform.process.wait_idle(60)
    _assert_joined(live_platform, c)
    twin = Call(c.base + 5 * MS, response_id=c.rid)
    _send(live_platform, twin.app())
    live_platform.process.wait_idle(60)
    assert [h["role"] for r in _rows(live_platform, c.app_trace) for h in r["hops"]] == ["client"]
    assert [h["role"] for r in _rows(live_platform, twin.app_trace) for h in r["hops"]] == ["client"]
    [row] = _rows(live_platform, c.engine_trace)
    assert [h["role"] for h in row["hops"]] == ["gateway", "engine"] and row["joined_by"] == ""


def test_projects_never_join(live_platform):
    """The same response id in another project is not a partner, and does not make the join ambiguous."""
    c = Call(time.time_ns() - 120 * 1_000_000_000)
    other = Call(c.base, response_id=c.rid)
    _send(live_platform, other.app(), key="beta")
    for body in other.serving():
        _send(live_platform, body, key="beta")
    _send(live_platform, c.app())
    live_platform.process.wait_idle(60)
    for body in c.serving():
        _send(live_platform, body)
    live_platform.process.wait_idle(60)
    _assert_joined(live_platform, c)
    [beta_row] = _rows(live_platform, other.engine_trace, token="bob")
    assert beta_row["linked_trace_ids"] == [other.app_trace]
    assert _rows(live_platform, other.engine_trace) == []  # alice reads alpha only


def test_a_piece_from_before_a_restart_is_read_back_and_joined(fresh_platform_factory):
    """The app's piece was decomposed by the process before (nothing of it in memory now): the partner lookup and
    the rebuild read it from ClickHouse, and the result is the same row."""
    platform = fresh_platform_factory()
    c = Call(time.time_ns() - 120 * 1_000_000_000)
    _send(platform, c.app())
    platform.process.wait_idle(60)
    assert [h["role"] for r in _rows(platform, c.app_trace) for h in r["hops"]] == ["client"]
    platform.process.stop(cleanup=False)
    platform.process.start()
    for body in c.serving():
        _send(platform, body)
    platform.process.wait_idle(60)
    _assert_joined(platform, c)


def test_summary_groups_and_filters_by_the_gateways_of_a_request(fresh_platform_factory):
    """`gateway` is the path through the gateways ('' for none); summaries group and filter by it (from the rows:
    the rollups do not carry it)."""
    platform = fresh_platform_factory()
    base = time.time_ns() - 300 * 1_000_000_000
    direct, bare, proxied = Call(base), Call(base + 10 * MS), Call(base + 20 * MS)
    for body in direct.serving():
        _send(platform, body)
    _send(platform, bare.serving(with_gateway=False)[0])
    litellm_span = uuid.uuid4().hex[:16]
    _send(platform, _request("litellm-proxy", "litellm", [(
        proxied.engine_trace, litellm_span, "", "Received Proxy Server Request", SERVER_KIND, base, base + 900 * MS,
        [("llm.request.type", "completion"), ("gen_ai.request.model", "llama")])]))
    for body in proxied.serving(gateway_parent=litellm_span):
        _send(platform, body)
    platform.process.wait_idle(60)
    assert [r["gateway"] for r in _rows(platform, proxied.engine_trace)] == ["litellm-proxy > llm-gateway"]
    assert [r["gateway"] for r in _rows(platform, bare.engine_trace)] == [""]
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(base / 1e9 - 60))
    token = platform.tokens["alice"]
    status, answer = platform.process.get(f"/api/v1/latency/summary?group_by=gateway&since={since}", token)
    assert status == 200, answer
    assert {g["key"]["gateway"]: g["count"] for g in answer["groups"]} == {
        "": 1, "llm-gateway": 1, "litellm-proxy > llm-gateway": 1}, answer
    status, answer = platform.process.get(
        f"/api/v1/latency/summary?group_by=service&gateway=litellm-proxy%20%3E%20llm-gateway&since={since}", token)
    assert status == 200, answer
    assert answer["filters"] == {"gateway": "litellm-proxy > llm-gateway"}
    assert [(g["key"], g["count"]) for g in answer["groups"]] == [({"service": "litellm-proxy"}, 1)]


def test_a_token_of_several_projects_finds_a_trace_without_naming_the_project(live_platform):
    """GET /requests?trace_id= with a token that reads alpha and beta searches both; each row names its project.
    (The README's quick-start curl has no ?project=, and a second project must not break it.)"""
    token = live_platform.process.manage("create_api_token", "--user", "carol", "--role", "viewer",
                                         "--project", "alpha", "--project", "beta")
    c = Call(time.time_ns() - 60 * 1_000_000_000)
    for body in c.serving():
        _send(live_platform, body, key="beta")
    live_platform.process.wait_idle(60)
    [row] = requests_for(live_platform.process, token, c.engine_trace)
    assert row["project"] == "beta" and row["trace_id"] == c.engine_trace
    assert requests_for(live_platform.process, token, uuid.uuid4().hex) == []
    status, body = live_platform.process.get(f"/api/v1/requests?trace_id={c.engine_trace}&project=alpha", token)
    assert status == 200 and body["requests"] == []
    status, body = live_platform.process.get(f"/api/v1/requests?trace_id={c.engine_trace}&project=gamma", token)
    assert status == 404, body
