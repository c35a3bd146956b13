"""Hand-built OTLP payloads (protobuf and OTLP-JSON) and the small HTTP/gRPC/metrics helpers the live-platform
tests share. Payloads are built here byte for byte so tests control exactly what goes on the wire; the tests that
exercise the official OTel SDK exporters build their spans with the SDK instead."""
from __future__ import annotations

import gzip
import json
import os
import struct
import time
import urllib.error
import urllib.request

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

GRPC_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
MS = 1_000_000
SERVER = 2  # OTLP SpanKind
CLIENT = 3
INTERNAL = 1


def new_trace_id() -> bytes:
    return os.urandom(16)


def new_span_id() -> bytes:
    return os.urandom(8)


def any_value(value) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    return AnyValue(string_value=str(value))


def key_values(attributes: dict | list) -> list[KeyValue]:
    """KeyValues in the given order (a list of pairs keeps duplicates and order)."""
    items = attributes.items() if isinstance(attributes, dict) else attributes
    return [KeyValue(key=k, value=any_value(v)) for k, v in items]


def pb_span(trace_id: bytes, span_id: bytes, *, parent: bytes = b"", name: str = "op", kind: int = INTERNAL,
            start_ns: int, end_ns: int, attributes: dict | list = (), events=(), status_code: int = 0) -> Span:
    span = Span(trace_id=trace_id, span_id=span_id, parent_span_id=parent, name=name, kind=kind,
                start_time_unix_nano=start_ns, end_time_unix_nano=end_ns, status=Status(code=status_code))
    span.attributes.extend(key_values(attributes or {}))
    for event_name, time_ns in events:
        span.events.add(name=event_name, time_unix_nano=time_ns)
    return span


def pb_request(*groups) -> ExportTraceServiceRequest:
    """groups: (resource attributes, [Span, ...]) pairs, one ResourceSpans each."""
    request = ExportTraceServiceRequest()
    for resource, spans in groups:
        resource_spans = ResourceSpans()
        resource_spans.resource.attributes.extend(key_values(resource))
        scope_spans = ScopeSpans()
        scope_spans.scope.name = "tests.otlp_payloads"
        scope_spans.spans.extend(spans)
        resource_spans.scope_spans.append(scope_spans)
        request.resource_spans.append(resource_spans)
    return request


def vllm_attributes(*, model: str, request_id: str, queue_s: float, prefill_s: float, decode_s: float,
                    e2e_s: float, ttft_s: float, prompt_tokens: int, completion_tokens: int) -> dict:
    """The attributes vLLM's OutputProcessor.do_tracing writes on `llm_request` (latencies in float seconds)."""
    return {
        "gen_ai.response.model": model,
        "gen_ai.request.id": request_id,
        "gen_ai.request.max_tokens": 512,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.95,
        "gen_ai.request.n": 1,
        "gen_ai.usage.prompt_tokens": prompt_tokens,
        "gen_ai.usage.completion_tokens": completion_tokens,
        "gen_ai.latency.time_in_queue": queue_s,
        "gen_ai.latency.time_to_first_token": ttft_s,
        "gen_ai.latency.e2e": e2e_s,
        "gen_ai.latency.time_in_model_prefill": prefill_s,
        "gen_ai.latency.time_in_model_decode": decode_s,
        "gen_ai.latency.time_in_model_inference": prefill_s + decode_s,
    }


def vllm_resource(service: str = "vllm-engine", engine_config: str | None = None,
                  replica_group: str | None = None) -> dict:
    resource = {"service.name": service, "vllm.instrumenting_module_name": "vllm.v1.engine.output_processor",
                "vllm.process_id": "4242"}
    if engine_config is not None:
        resource["llm_observatory.engine_config"] = engine_config
    if replica_group is not None:
        resource["llm_observatory.replica_group"] = replica_group
    return resource


def engine_span(*, trace_id: bytes | None = None, span_id: bytes | None = None, parent: bytes = b"",
                start_ns: int | None = None, model: str = "meta-llama/Llama-3.1-8B-Instruct", e2e_s: float = 0.5,
                queue_s: float = 0.01, prefill_s: float = 0.04, decode_s: float = 0.4, ttft_s: float = 0.06,
                prompt_tokens: int = 100, completion_tokens: int = 41, extra: dict | list = ()) -> Span:
    """A complete vLLM llm_request span (an engine-only request when it has no LLM parent)."""
    start = start_ns if start_ns is not None else time.time_ns() - 2_000 * MS
    attributes = list(vllm_attributes(
        model=model, request_id=f"chatcmpl-{os.urandom(6).hex()}", queue_s=queue_s, prefill_s=prefill_s,
        decode_s=decode_s, e2e_s=e2e_s, ttft_s=ttft_s, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    ).items())
    attributes += list(extra.items() if isinstance(extra, dict) else extra)
    return pb_span(trace_id or new_trace_id(), span_id or new_span_id(), parent=parent, name="llm_request",
                   kind=SERVER, start_ns=start, end_ns=start + int(e2e_s * 1e9), attributes=attributes)


def good_request(**kwargs) -> tuple[bytes, str]:
    """(protobuf body, trace id hex) of one engine-only request that must be accepted and decomposed."""
    span = engine_span(**kwargs)
    return pb_request((vllm_resource(), [span])).SerializeToString(), span.trace_id.hex()


# -- OTLP JSON -------------------------------------------------------------------------------------------


def json_value(value) -> dict:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    return {"stringValue": value}


def json_span(span: Span) -> dict:
    """The OTLP-JSON form of a protobuf Span (hex ids, enum ints, 64-bit ints as strings)."""
    out = {
        "traceId": span.trace_id.hex(),
        "spanId": span.span_id.hex(),
        "name": span.name,
        "kind": span.kind,
        "startTimeUnixNano": str(span.start_time_unix_nano),
        "endTimeUnixNano": str(span.end_time_unix_nano),
        "attributes": [{"key": kv.key, "value": json_value(getattr(kv.value, kv.value.WhichOneof("value")))}
                       for kv in span.attributes],
        "status": {"code": span.status.code},
    }
    if span.parent_span_id:
        out["parentSpanId"] = span.parent_span_id.hex()
    if span.events:
        out["events"] = [{"timeUnixNano": str(e.time_unix_nano), "name": e.name} for e in span.events]
    return out


def json_request(*groups) -> dict:
    """groups: (resource attributes, [span dicts]) pairs."""
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": k, "value": json_value(v)} for k, v in resource.items()]},
                "scopeSpans": [{"scope": {"name": "tests.otlp_payloads"}, "spans": spans}],
            }
            for resource, spans in groups
        ]
    }


# -- talking to a live platform --------------------------------------------------------------------------


def post_traces(platform, body: bytes, *, key: str | None = None, content_type: str | None = "application/x-protobuf",
                encoding: str | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """POST /v1/traces; key=None sends no Authorization header. Returns (status, lower-case headers, body)."""
    sent = dict(headers or {})
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    if content_type is not None:
        sent["Content-Type"] = content_type
    if encoding is not None:
        sent["Content-Encoding"] = encoding
    return platform.process.post("/v1/traces", body, sent)


def export_protobuf(platform, request: ExportTraceServiceRequest | bytes, key: str, *, gzipped: bool = False
                    ) -> ExportTraceServiceResponse:
    """Export over OTLP/HTTP protobuf, assert 200 and return the decoded ExportTraceServiceResponse."""
    body = request if isinstance(request, bytes) else request.SerializeToString()
    status, headers, data = post_traces(platform, gzip.compress(body) if gzipped else body, key=key,
                                        encoding="gzip" if gzipped else None)
    assert status == 200, (status, data[:500])
    assert headers["content-type"] == "application/x-protobuf"
    return ExportTraceServiceResponse.FromString(data)


def export_json(platform, document: dict | bytes, key: str) -> dict:
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    status, headers, data = post_traces(platform, body, key=key, content_type="application/json")
    assert status == 200, (status, data[:500])
    assert headers["content-type"] == "application/json"
    return json.loads(data)


def http_get(url: str, token: str | None = None, method: str = "GET") -> tuple[int, str, bytes]:
    """(status, content type, body) of any request, error statuses included."""
    request = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def api(platform, path: str, token: str | None) -> tuple[int, dict]:
    """GET a JSON API path; every answer of the API, errors included, must be JSON."""
    status, content_type, body = http_get(platform.url + path, token)
    assert content_type.startswith("application/json"), (status, content_type, body[:300])
    return status, json.loads(body)


def requests_of(platform, trace_id: str, token: str, project: str | None = None) -> list[dict]:
    path = f"/api/v1/requests?trace_id={trace_id}" + (f"&project={project}" if project else "")
    status, body = api(platform, path, token)
    assert status == 200, body
    return body["requests"]


def metric_total(platform, name: str, **labels) -> float:
    """Sum of the samples of `name` (e.g. observatory_spans_accepted_total) whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, body = http_get(platform.url + "/metrics")
    assert status == 200
    total = 0.0
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def grpc_export_raw(target: str, body: bytes, metadata=None, timeout: float = 30):
    """Call TraceService/Export with raw bytes (no serializer): returns the raw response bytes or raises grpc.RpcError."""
    import grpc

    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)]) as channel:
        export = channel.unary_unary(GRPC_EXPORT_METHOD, request_serializer=None, response_deserializer=None)
        return export(body, metadata=metadata, timeout=timeout)


def grpc_auth(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


# -- protobuf wire encoding by hand (for layouts the generated classes never write) -----------------


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32/int64 values are encoded as 10-byte two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag(field, 2) + varint(len(payload)) + payload


def fixed64(field: int, value: int) -> bytes:
    return tag(field, 1) + struct.pack("<Q", value)
