"""OpenTelemetry tracing for the engine's processes (gateway, simulator replicas, load generator).

Each process owns one ``TracerProvider``. Where spans go follows the standard OTel
environment (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``..._PROTOCOL``, ``..._HEADERS``)
unless the caller passes them, as vLLM's ``--otlp-traces-endpoint`` does. gRPC is the
default protocol, as in vLLM; ``http/protobuf`` selects OTLP/HTTP.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import unquote

from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# Resource attribute the platform reads to label a span source as the simulator (collectors/vllm.py).
SIMULATED_ATTRIBUTE = "llm_observatory.simulated"
# Resource attributes naming the engine config version and the replica group (collectors/attrs.py).
ENGINE_CONFIG_ATTRIBUTE = "llm_observatory.engine_config"
REPLICA_GROUP_ATTRIBUTE = "llm_observatory.replica_group"
# Resource attribute naming the served model: vLLM's llm_request span leaves gen_ai.response.model out.
MODEL_ATTRIBUTE = "llm_observatory.model"
# The OTel GenAI convention's prompt tokens served from a cache (vLLM's prefix cache: its usage's
# prompt_tokens_details.cached_tokens), on the gateway's span and the simulator's llm_request span.
CACHE_READ_ATTRIBUTE = "gen_ai.usage.cache_read.input_tokens"

PROPAGATOR = TraceContextTextMapPropagator()

_PROTOCOLS = ("grpc", "http/protobuf")


def _parse_headers(text: str | None) -> dict[str, str]:
    """``key=value,key2=value2`` as in OTEL_EXPORTER_OTLP_HEADERS (values may be URL-encoded)."""
    headers: dict[str, str] = {}
    for item in (text or "").split(","):
        if "=" in item:
            key, value = item.split("=", 1)
            if key.strip():
                headers[key.strip().lower()] = unquote(value.strip())
    return headers


def build_tracer_provider(
    service_name: str,
    *,
    endpoint: str | None = None,
    protocol: str | None = None,
    headers: Mapping[str, str] | None = None,
    resource_attributes: Mapping[str, object] | None = None,
    schedule_delay_ms: int = 500,
) -> TracerProvider:
    """A provider exporting in batches to ``endpoint`` (or the OTel environment); without either, spans are dropped.

    ``endpoint`` for gRPC is ``host:port`` or ``http://host:port``; for ``http/protobuf``
    the full URL of ``/v1/traces``.
    """
    attributes = {"service.name": service_name}
    attributes.update(resource_attributes or {})
    provider = TracerProvider(resource=Resource.create(attributes))
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint:
        return provider
    protocol = (
        protocol
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    if protocol not in _PROTOCOLS:
        raise ValueError(f"unsupported OTLP protocol {protocol!r}; use one of {', '.join(_PROTOCOLS)}")
    merged_headers = _parse_headers(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or os.environ.get("OTEL_EXPORTER_OTLP_HEADERS")
    )
    merged_headers.update({k.lower(): v for k, v in (headers or {}).items()})
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        target = endpoint.split("://", 1)[-1].rstrip("/")
        exporter = GrpcExporter(endpoint=target, insecure=not endpoint.startswith("https://"),
                                headers=tuple(merged_headers.items()) or None)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter(endpoint=endpoint, headers=merged_headers or None)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_ms))
    return provider


class _MappingGetter(Getter):
    def get(self, carrier, key):
        value = carrier.get(key) if carrier is not None else None
        return [value] if value is not None else None

    def keys(self, carrier):
        return list(carrier.keys()) if carrier is not None else []


class _DictSetter(Setter):
    def set(self, carrier, key, value):
        carrier[key] = value


MAPPING_GETTER = _MappingGetter()
DICT_SETTER = _DictSetter()


def extract_context(headers: Mapping[str, str]):
    """The remote parent carried by a W3C ``traceparent`` header (case-insensitive mapping expected)."""
    return PROPAGATOR.extract(headers, getter=MAPPING_GETTER)


def inject_context(headers: dict[str, str], context=None) -> dict[str, str]:
    """Add ``traceparent`` (and ``tracestate``) for ``context`` (default: the current span) to ``headers``."""
    PROPAGATOR.inject(headers, context=context, setter=DICT_SETTER)
    return headers
