"""Synthetic but realistic OTLP payloads: client → gateway → vLLM llm_request chains, as the SDKs emit them."""
from __future__ import annotations

import os
import random
import time

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

MODELS = ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B-Instruct", "Qwen/Qwen2.5-32B-Instruct")


def add_attribute(attributes, key, value):
    """Append one OTLP KeyValue, typed like the SDKs type Python values, to a repeated attributes field."""
    kv = attributes.add()
    kv.key = key
    if isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    elif isinstance(value, float):
        kv.value.double_value = value
    else:
        kv.value.string_value = value


def _resource(request, service, extra=()):
    rs = request.resource_spans.add()
    for key, value in (("service.name", service), ("telemetry.sdk.language", "python"),
                       ("telemetry.sdk.name", "opentelemetry"), ("telemetry.sdk.version", "1.38.0"), *extra):
        add_attribute(rs.resource.attributes, key, value)
    return rs.scope_spans.add()


def chain_batch(traces: int, rng: random.Random, base_ns: int | None = None, hops: int = 3) -> tuple[bytes, list[str]]:
    """One export request holding `traces` chains of `hops` spans (3: client → gateway → engine; 5: two more
    gateways of other services in front, an edge gateway and a LiteLLM-like proxy; 2: gateway → engine with no
    client span, traffic from uninstrumented callers, whose rows are loose ends the decomposition tries to join
    with other traces by their response id: traces/joins.py)."""
    if hops not in (2, 3, 5):
        raise ValueError("hops must be 2, 3 or 5")
    base_ns = base_ns or time.time_ns() - 60_000_000_000
    request = ExportTraceServiceRequest()
    client_scope = _resource(request, "chat-app")
    client_scope.scope.name = "opentelemetry.instrumentation.openai_v2"
    gateway_scope = _resource(request, "llm-gateway")
    gateway_scope.scope.name = "llm_observatory.gateway"
    engine_scope = _resource(request, "vllm", (("vllm.instrumenting_module_name", "vllm.entrypoints.openai"),
                                               ("vllm.process_id", 4242)))
    engine_scope.scope.name = "vllm.tracing"
    fronts = []
    if hops == 5:
        for service in ("edge-gateway", "litellm-proxy"):
            scope = _resource(request, service)
            scope.scope.name = "llm_observatory.gateway"
            fronts.append(scope)
    trace_ids = []
    for i in range(traces):
        trace_id = os.urandom(16)
        trace_ids.append(trace_id.hex())
        client_id, gateway_id, engine_id = os.urandom(8), os.urandom(8), os.urandom(8)
        model = MODELS[i % len(MODELS)]
        prompt = rng.choice((120, 600, 2000, 7000, 20000))
        completion = rng.randint(16, 512)
        queue, prefill, decode = rng.uniform(0, 0.2), prompt / 40000, completion * rng.uniform(0.008, 0.03)
        cached = prompt // 32 * 16 if i % 4 else 0  # prefix-cache hits: half the prompt, 3 requests in 4
        engine_e2e = queue + prefill + decode + rng.uniform(0.002, 0.01)
        start = base_ns + i * 1_000_000
        engine_start = start + 4_000_000
        engine_end = engine_start + int(engine_e2e * 1e9)
        gateway_end = engine_end + rng.randint(1, 4) * 1_000_000
        client_end = gateway_end + rng.randint(1, 6) * 1_000_000

        parent_of_gateway = client_id if hops > 2 else b""
        for depth, scope in enumerate(fronts, start=1):  # gateways in front: each nested 0.5 ms inside the last
            f = scope.spans.add()
            front_id = os.urandom(8)
            f.trace_id, f.span_id, f.parent_span_id, f.name, f.kind = (trace_id, front_id, parent_of_gateway,
                                                                       f"chat {model}", 2)
            f.start_time_unix_nano = start + depth * 500_000
            f.end_time_unix_nano = client_end - depth * 500_000
            for key, value in (("gen_ai.operation.name", "chat"), ("gen_ai.request.model", model),
                               ("http.request.method", "POST"), ("url.path", "/v1/chat/completions")):
                add_attribute(f.attributes, key, value)
            parent_of_gateway = front_id
        if hops > 2:
            c = client_scope.spans.add()
            c.trace_id, c.span_id, c.name, c.kind = trace_id, client_id, f"chat {model}", 3
            c.start_time_unix_nano, c.end_time_unix_nano = start, client_end
            for key, value in (("gen_ai.operation.name", "chat"), ("gen_ai.provider.name", "openai"),
                               ("gen_ai.request.model", model), ("gen_ai.response.model", model),
                               ("gen_ai.request.max_tokens", 1024), ("gen_ai.request.temperature", 0.7),
                               ("gen_ai.usage.input_tokens", prompt), ("gen_ai.usage.output_tokens", completion),
                               ("gen_ai.response.id", f"chatcmpl-{i}"), ("server.address", "127.0.0.1"),
                               ("server.port", 8100)):
                add_attribute(c.attributes, key, value)

        g = gateway_scope.spans.add()
        g.trace_id, g.span_id, g.parent_span_id, g.name, g.kind = (trace_id, gateway_id, parent_of_gateway,
                                                                   f"chat {model}", 2)
        g.start_time_unix_nano, g.end_time_unix_nano = start + 2_000_000, gateway_end
        for key, value in (("gen_ai.operation.name", "chat"), ("gen_ai.request.model", model),
                           ("gen_ai.usage.input_tokens", prompt), ("gen_ai.usage.output_tokens", completion),
                           ("gen_ai.usage.cache_read.input_tokens", cached),
                           ("http.request.method", "POST"), ("url.path", "/v1/chat/completions"),
                           ("http.response.status_code", 200)):
            add_attribute(g.attributes, key, value)

        e = engine_scope.spans.add()
        e.trace_id, e.span_id, e.parent_span_id, e.name, e.kind = trace_id, engine_id, gateway_id, "llm_request", 2
        e.start_time_unix_nano, e.end_time_unix_nano = engine_start, engine_end
        for key, value in (("gen_ai.response.model", model), ("gen_ai.request.id", f"cmpl-{trace_id.hex()[:12]}"),
                           ("gen_ai.request.temperature", 0.7), ("gen_ai.request.top_p", 1.0),
                           ("gen_ai.request.max_tokens", 1024), ("gen_ai.request.n", 1),
                           ("gen_ai.usage.prompt_tokens", prompt), ("gen_ai.usage.completion_tokens", completion),
                           ("gen_ai.usage.cache_read.input_tokens", cached),
                           ("gen_ai.latency.time_in_queue", queue), ("gen_ai.latency.time_to_first_token", queue + prefill),
                           ("gen_ai.latency.e2e", engine_e2e), ("gen_ai.latency.time_in_model_prefill", prefill),
                           ("gen_ai.latency.time_in_model_decode", decode),
                           ("gen_ai.latency.time_in_model_inference", prefill + decode)):
            add_attribute(e.attributes, key, value)
    return request.SerializeToString(), trace_ids


class ChainTemplate:
    """chain_batch payloads at the cost of a copy: one batch is built, and each call stamps fresh random trace
    ids into a copy of its bytes (span ids repeat across batches, which is fine: spans are keyed by trace and
    span id). For load that must outpace the platform (~0.5 ms a 999-span batch instead of ~25 ms)."""

    def __init__(self, traces: int = 333, seed: int = 1, base_ns: int | None = None):
        self.payload, ids = chain_batch(traces, random.Random(seed), base_ns)
        self.offsets: list[list[int]] = []
        for trace_id in ids:
            raw = bytes.fromhex(trace_id)
            found, at = [], self.payload.find(raw)
            while at != -1:
                found.append(at)
                at = self.payload.find(raw, at + 1)
            assert len(found) == 3, "a trace id's bytes must appear once per span of its chain"
            self.offsets.append(found)

    def batch(self) -> tuple[bytes, list[str]]:
        buf = bytearray(self.payload)
        ids = []
        for offsets in self.offsets:
            raw = os.urandom(16)
            for at in offsets:
                buf[at:at + 16] = raw
            ids.append(raw.hex())
        return bytes(buf), ids
