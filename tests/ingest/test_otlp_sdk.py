"""End to end with the official OpenTelemetry Python SDK as the client: spans exported over OTLP/HTTP and OTLP/gRPC
by three tracer providers (application, gateway, vLLM engine) come back from the JSON API as one request whose
latency decomposition matches docs/decomposition.md ("The definition") to the microsecond, and feed the latency
summary and /metrics."""
from __future__ import annotations

import datetime as dt
import os
import time
import uuid

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from otlp_payloads import api, metric_total, requests_of

MS = 1_000_000
COMPONENTS = ("network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")
TRANSPORTS = ("http", "http-gzip", "grpc", "grpc-gzip")
PROPAGATOR = TraceContextTextMapPropagator()
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


class RecordingExporter(SpanExporter):
    """Delegates to a real OTLP exporter and keeps each export's result, so a refused export fails loudly."""

    def __init__(self, inner: SpanExporter):
        self.inner = inner
        self.results: list[SpanExportResult] = []

    def export(self, spans):
        result = self.inner.export(spans)
        self.results.append(result)
        return result

    def shutdown(self):
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


def make_exporter(live_platform, transport: str, key: str) -> RecordingExporter:
    if transport.startswith("http"):
        inner = HttpSpanExporter(
            endpoint=f"{live_platform.url}/v1/traces",
            headers={"Authorization": f"Bearer {key}"},
            compression=Compression.Gzip if transport.endswith("gzip") else Compression.NoCompression,
            timeout=30,
        )
    else:
        inner = GrpcSpanExporter(
            endpoint=live_platform.grpc_target,
            insecure=True,
            headers=(("authorization", f"Bearer {key}"),),
            compression=grpc.Compression.Gzip if transport.endswith("gzip") else grpc.Compression.NoCompression,
            timeout=30,
        )
    return RecordingExporter(inner)


class Fleet:
    """One TracerProvider (with its own exporter) per process of the serving path, as in production."""

    def __init__(self, live_platform, transport: str, key: str, services: dict[str, dict], batch: bool = True):
        self.providers: dict[str, TracerProvider] = {}
        self.exporters: dict[str, RecordingExporter] = {}
        for role, resource in services.items():
            provider = TracerProvider(resource=Resource.create(resource))
            exporter = make_exporter(live_platform, transport, key)
            provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
            self.providers[role] = provider
            self.exporters[role] = exporter

    def tracer(self, role: str):
        return self.providers[role].get_tracer(f"tests.{role}", "1.0")

    def flush(self, order=None) -> None:
        """Flush each process in turn (engine first by default: spans arrive out of causal order)."""
        for role in order or reversed(list(self.providers)):
            assert self.providers[role].force_flush(30_000), role
        for role, exporter in self.exporters.items():
            assert exporter.results, f"{role} exported nothing"
            assert all(r is SpanExportResult.SUCCESS for r in exporter.results), (role, exporter.results)

    def shutdown(self) -> None:
        for provider in self.providers.values():
            provider.shutdown()


def across_process(span) -> trace.Context:
    """Propagate a span's context through W3C traceparent headers, the way it crosses a process boundary."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    assert carrier["traceparent"].startswith("00-")
    return PROPAGATOR.extract(carrier)


def services(tag: str) -> dict[str, dict]:
    return {
        "client": {"service.name": f"chat-app-{tag}", "service.version": "2.4.1"},
        "gateway": {"service.name": f"llm-gateway-{tag}"},
        "engine": {"service.name": f"vllm-{tag}", "vllm.instrumenting_module_name": "vllm.v1.engine.output_processor",
                   "vllm.process_id": str(os.getpid())},
    }


def genai_attributes(model: str, prompt: int, completion: int, ttft_s: float, provider: str) -> dict:
    return {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": 512,
        "gen_ai.request.stream": True,
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.output_tokens": completion,
        "gen_ai.response.time_to_first_chunk": ttft_s,
    }


def vllm_attributes(model: str, request_id: str, f: dict) -> dict:
    """vLLM's llm_request attributes (OutputProcessor.do_tracing): latencies in float seconds."""
    return {
        "gen_ai.request.id": request_id,
        "gen_ai.response.model": model,
        "gen_ai.request.max_tokens": 512,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.95,
        "gen_ai.request.n": 1,
        "gen_ai.usage.prompt_tokens": f["prompt"],
        "gen_ai.usage.completion_tokens": f["completion"],
        "gen_ai.latency.time_in_queue": f["queue_s"],
        "gen_ai.latency.time_to_first_token": f["engine_ttft_s"],
        "gen_ai.latency.e2e": f["engine_e2e_s"],
        "gen_ai.latency.time_in_model_prefill": f["prefill_s"],
        "gen_ai.latency.time_in_model_decode": f["decode_s"],
        "gen_ai.latency.time_in_model_inference": f["prefill_s"] + f["decode_s"],
    }


# Every figure distinct and exactly representable, so a swapped or mis-scaled component cannot pass.
FIGURES = {
    "client_start_ms": 0.0, "client_ms": 1234.5, "client_ttft_s": 0.2345,
    "gateway_start_ms": 21.0, "gateway_ms": 1180.25, "gateway_ttft_s": 0.1875,
    "engine_start_ms": 47.0, "engine_span_ms": 1101.0,
    "engine_e2e_s": 1.1, "queue_s": 0.0125, "prefill_s": 0.0875, "decode_s": 0.95, "engine_ttft_s": 0.1125,
    "prompt": 300, "completion": 101,
}
EXPECTED = {
    "e2e_ms": 1234.5,
    "network_ms": 134.5,            # 1234.5 - 1100
    "client_gateway": 54.25,        # 1234.5 - 1180.25
    "gateway_engine": 80.25,        # 1180.25 - 1100
    "overhead_ms": 50.0,            # 1100 - (12.5 + 87.5 + 950)
    "queue_ms": 12.5,
    "prefill_ms": 87.5,
    "decode_ms": 950.0,
    "ttft_ms": 234.5,               # as seen by the outermost hop (the client)
    "engine_ttft_ms": 112.5,
    "tpot_ms": 9.5,                 # 950 / (101 - 1)
    "prompt_bucket": "<1k",
}


def emit_chat(fleet: Fleet, t0: int, f: dict, *, engine_model: str, alias: str, parent_context=None) -> dict:
    """client (CLIENT) -> gateway (SERVER) -> vLLM llm_request (SERVER), with explicit timestamps; returns span ids."""
    client = fleet.tracer("client").start_span(
        f"chat {alias}", kind=trace.SpanKind.CLIENT, context=parent_context,
        start_time=t0 + int(f["client_start_ms"] * MS),
        attributes={**genai_attributes(alias, f["prompt"], f["completion"], f["client_ttft_s"], "openai"),
                    "server.address": "gateway.internal", "server.port": 8100},
    )
    gateway = fleet.tracer("gateway").start_span(
        f"chat {alias}", kind=trace.SpanKind.SERVER, context=across_process(client),
        start_time=t0 + int(f["gateway_start_ms"] * MS),
        attributes=genai_attributes(alias, f["prompt"], f["completion"], f["gateway_ttft_s"], "vllm"),
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    engine_start = t0 + int(f["engine_start_ms"] * MS)
    engine = fleet.tracer("engine").start_span(
        "llm_request", kind=trace.SpanKind.SERVER, context=across_process(gateway), start_time=engine_start,
        attributes=vllm_attributes(engine_model, request_id, f),
    )
    engine.end(end_time=engine_start + int(f["engine_span_ms"] * MS))
    gateway.end(end_time=t0 + int((f["gateway_start_ms"] + f["gateway_ms"]) * MS))
    client.end(end_time=t0 + int((f["client_start_ms"] + f["client_ms"]) * MS))
    ids = {role: format(span.get_span_context().span_id, "016x")
           for role, span in (("client", client), ("gateway", gateway), ("engine", engine))}
    ids["trace"] = format(client.get_span_context().trace_id, "032x")
    ids["request_id"] = request_id
    return ids


def assert_decomposition(row: dict, expected: dict) -> None:
    approx = lambda value: pytest.approx(value, abs=0.001)  # noqa: E731
    for name in ("e2e_ms", "network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms", "ttft_ms",
                 "engine_ttft_ms", "tpot_ms"):
        assert row[name] == approx(expected[name]), name
    assert row["network_ms_per_hop"] == {
        "client_gateway": approx(expected["client_gateway"]),
        "gateway_engine": approx(expected["gateway_engine"]),
    }
    assert row["prompt_bucket"] == expected["prompt_bucket"]
    assert sum(row[name] for name in COMPONENTS) == approx(row["e2e_ms"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_client_gateway_vllm_chain_is_decomposed_exactly(live_platform, transport):
    tag = f"{transport}-{uuid.uuid4().hex[:8]}"
    model = f"meta-llama/Llama-3.1-8B-Instruct-{tag}"
    protocol = "http" if transport.startswith("http") else "grpc"
    accepted_before = metric_total(live_platform, "observatory_spans_accepted_total", protocol=protocol)
    decoded_before = {decoder: metric_total(live_platform, "observatory_ingest_decoded_payloads_total", decoder=decoder)
                      for decoder in ("c", "python")}

    fleet = Fleet(live_platform, transport, live_platform.keys["alpha"], services(tag))
    try:
        t0 = time.time_ns() - 5_000 * MS
        ids = emit_chat(fleet, t0, FIGURES, engine_model=model, alias="llama-3.1-8b")
        fleet.flush()
    finally:
        fleet.shutdown()
    live_platform.process.wait_idle()

    [row] = requests_of(live_platform, ids["trace"], live_platform.tokens["alice"])
    assert row["trace_id"] == ids["trace"]
    assert row["request_key"] == ids["engine"]
    assert row["request_id"] == ids["request_id"]
    assert row["model"] == model  # the engine's gen_ai.response.model wins over the client's alias
    assert row["service"] == f"chat-app-{tag}"  # the outermost hop's service
    assert (row["prompt_tokens"], row["completion_tokens"]) == (300, 101)
    assert row["status"] == "ok"
    started = dt.datetime.fromisoformat(row["start_time"].replace("Z", "+00:00"))
    assert started == EPOCH + dt.timedelta(microseconds=t0 // 1000)  # the outermost hop's start
    assert_decomposition(row, EXPECTED)

    hops = row["hops"]
    assert [h["role"] for h in hops] == ["client", "gateway", "engine"]
    assert [h["span_id"] for h in hops] == [ids["client"], ids["gateway"], ids["engine"]]
    assert [h["service"] for h in hops] == [f"chat-app-{tag}", f"llm-gateway-{tag}", f"vllm-{tag}"]
    assert [h["convention"] for h in hops] == ["genai", "genai", "vllm"]
    assert [h["start_ns"] for h in hops] == [t0, t0 + 21 * MS, t0 + 47 * MS]
    assert [h["duration_ms"] for h in hops] == [pytest.approx(v, abs=0.001) for v in (1234.5, 1180.25, 1101.0)]
    assert [h["ttft_ms"] for h in hops] == [pytest.approx(v, abs=0.001) for v in (234.5, 187.5, 112.5)]

    # the other tenant's view of the same trace is empty
    assert requests_of(live_platform, ids["trace"], live_platform.tokens["bob"]) == []

    status, summary = api(live_platform, "/api/v1/latency/summary?group_by=model,prompt_bucket",
                          live_platform.tokens["alice"])
    assert status == 200, summary
    [group] = [g for g in summary["groups"] if g["key"]["model"] == model]
    assert group["key"] == {"model": model, "prompt_bucket": "<1k"}
    assert (group["count"], group["errors"]) == (1, 0)
    for metric, value in (("e2e_ms", 1234.5), ("ttft_ms", 234.5), ("tpot_ms", 9.5)):
        assert group[metric] == {q: pytest.approx(value, abs=0.001) for q in ("p50", "p95", "p99")}, metric
    for metric in COMPONENTS:
        assert group[metric] == {q: pytest.approx(EXPECTED[metric], abs=0.001) for q in ("p50", "p95")}, metric

    accepted = metric_total(live_platform, "observatory_spans_accepted_total", protocol=protocol)
    assert accepted - accepted_before == 3
    # What the real SDK exporters send takes the C fast path of decoding (ingest/_otlp_fast.c), none of it Python's.
    decoded = {decoder: metric_total(live_platform, "observatory_ingest_decoded_payloads_total", decoder=decoder)
               for decoder in ("c", "python")}
    assert decoded["c"] > decoded_before["c"] and decoded["python"] == decoded_before["python"], (decoded_before, decoded)


def test_agent_trace_with_two_llm_calls_gives_two_requests(live_platform):
    """An agent root with a tool call between two chat calls: one request row per LLM call, each with its hops."""
    tag = f"agent-{uuid.uuid4().hex[:8]}"
    model = f"qwen2.5-7b-{tag}"
    second = dict(FIGURES, client_start_ms=0.0, client_ms=820.75, client_ttft_s=0.3005, gateway_start_ms=9.0,
                  gateway_ms=790.5, gateway_ttft_s=0.2875, engine_start_ms=30.0, engine_span_ms=751.0,
                  engine_e2e_s=0.75, queue_s=0.125, prefill_s=0.25, decode_s=0.3125, engine_ttft_s=0.3875,
                  prompt=1500, completion=26)
    fleet = Fleet(live_platform, "grpc", live_platform.keys["alpha"], services(tag), batch=False)
    try:
        t0 = time.time_ns() - 10_000 * MS
        agent = fleet.tracer("client").start_span(
            "invoke_agent travel-planner", kind=trace.SpanKind.INTERNAL, start_time=t0,
            attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "travel-planner",
                        "gen_ai.provider.name": "openai"},
        )
        root = trace.set_span_in_context(agent)
        first = emit_chat(fleet, t0 + 5 * MS, FIGURES, engine_model=model, alias="qwen", parent_context=root)
        tool = fleet.tracer("client").start_span(
            "execute_tool search_flights", kind=trace.SpanKind.INTERNAL, context=root, start_time=t0 + 1300 * MS,
            attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search_flights"},
        )
        tool.end(end_time=t0 + 1400 * MS)
        later = emit_chat(fleet, t0 + 1500 * MS, second, engine_model=model, alias="qwen", parent_context=root)
        agent.end(end_time=t0 + 2400 * MS)
        fleet.flush(order=["engine", "client", "gateway"])
    finally:
        fleet.shutdown()
    assert first["trace"] == later["trace"]
    live_platform.process.wait_idle()

    rows = requests_of(live_platform, first["trace"], live_platform.tokens["alice"])
    assert [r["request_key"] for r in rows] == [first["engine"], later["engine"]]  # ordered by start
    assert [r["request_id"] for r in rows] == [first["request_id"], later["request_id"]]
    for row, ids in zip(rows, (first, later)):
        assert [h["span_id"] for h in row["hops"]] == [ids["client"], ids["gateway"], ids["engine"]]
        assert [h["role"] for h in row["hops"]] == ["client", "gateway", "engine"]
    assert_decomposition(rows[0], EXPECTED)
    assert_decomposition(rows[1], {
        "e2e_ms": 820.75, "network_ms": 70.75, "client_gateway": 30.25, "gateway_engine": 40.5,
        "overhead_ms": 62.5, "queue_ms": 125.0, "prefill_ms": 250.0, "decode_ms": 312.5, "ttft_ms": 300.5,
        "engine_ttft_ms": 387.5, "tpot_ms": 12.5, "prompt_bucket": "<4k",
    })


def test_openinference_llm_span_above_vllm_is_the_client_hop(live_platform):
    """An OpenInference (Phoenix) LLM span directly above llm_request: a two-hop request whose ttft comes from
    the "First Token Stream Event" and whose network is the client's e2e minus the engine's."""
    tag = f"oi-{uuid.uuid4().hex[:8]}"
    model = f"mistral-7b-{tag}"
    roles = {"client": {"service.name": f"rag-app-{tag}", "openinference.project.name": "default"},
             "engine": services(tag)["engine"]}
    fleet = Fleet(live_platform, "http", live_platform.keys["alpha"], roles)
    try:
        t0 = time.time_ns() - 3_000 * MS
        client = fleet.tracer("client").start_span(
            "ChatCompletion", kind=trace.SpanKind.INTERNAL, start_time=t0,
            attributes={
                "openinference.span.kind": "LLM",
                "llm.model_name": "mistral-7b-instruct",
                "llm.provider": "openai",
                "llm.system": "openai",
                "llm.invocation_parameters": '{"model": "mistral-7b-instruct", "stream": true}',
                "llm.token_count.prompt": 700,
                "llm.token_count.completion": 65,
                "llm.token_count.total": 765,
                "input.value": '{"messages": [{"role": "user", "content": "hi"}]}',
                "input.mime_type": "application/json",
            },
        )
        client.add_event("First Token Stream Event", timestamp=t0 + int(321.25 * MS))
        f = dict(FIGURES, engine_e2e_s=0.8, queue_s=0.0625, prefill_s=0.1875, decode_s=0.5, engine_ttft_s=0.25,
                 prompt=700, completion=65)
        engine_start = t0 + 40 * MS
        engine = fleet.tracer("engine").start_span(
            "llm_request", kind=trace.SpanKind.SERVER, context=across_process(client), start_time=engine_start,
            attributes=vllm_attributes(model, "chatcmpl-oi", f),
        )
        engine.end(end_time=engine_start + 801 * MS)
        client.end(end_time=t0 + int(905.5 * MS))
        fleet.flush()
    finally:
        fleet.shutdown()
    live_platform.process.wait_idle()

    trace_id = format(client.get_span_context().trace_id, "032x")
    [row] = requests_of(live_platform, trace_id, live_platform.tokens["alice"])
    assert [h["role"] for h in row["hops"]] == ["client", "engine"]
    assert [h["convention"] for h in row["hops"]] == ["openinference", "vllm"]
    assert row["hops"][0]["span_id"] == format(client.get_span_context().span_id, "016x")
    assert row["service"] == f"rag-app-{tag}"
    assert row["model"] == model
    assert (row["prompt_tokens"], row["completion_tokens"]) == (700, 65)
    approx = lambda value: pytest.approx(value, abs=0.001)  # noqa: E731
    assert row["e2e_ms"] == approx(905.5)
    assert row["ttft_ms"] == approx(321.25)  # event time - client span start
    assert row["hops"][0]["ttft_ms"] == approx(321.25)
    assert row["engine_ttft_ms"] == approx(250.0)
    assert row["network_ms"] == approx(105.5)  # 905.5 - 800
    assert row["network_ms_per_hop"] == {"client_gateway": None, "gateway_engine": None}  # no gateway observed
    assert row["overhead_ms"] == approx(50.0)  # 800 - (62.5 + 187.5 + 500)
    assert (row["queue_ms"], row["prefill_ms"], row["decode_ms"]) == (approx(62.5), approx(187.5), approx(500.0))
    assert row["tpot_ms"] == approx(500.0 / 64)
    assert row["prompt_bucket"] == "<1k"
    assert sum(row[name] for name in COMPONENTS) == approx(row["e2e_ms"])
