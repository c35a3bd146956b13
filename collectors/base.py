"""Canonical records shared by every normaliser: the span as decoded from OTLP and the LLM call it may describe."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any


class Role(str, enum.Enum):
    """Which hop of an LLM request a span stands for."""

    CLIENT = "client"    # the application calling an LLM (SDK instrumentation)
    GATEWAY = "gateway"  # a proxy/router between the application and the engine
    ENGINE = "engine"    # the inference server itself (vLLM llm_request)


# What answered a request (LLMCall.served_from, llm_requests.served_from; docs/decomposition.md, "Caches"): the
# engine, or the gateway's response cache (its classes, the observatory.cache.served_from of a hit).
SERVED_FROM = ("engine", "exact_cache", "semantic_cache")
CACHE_CLASSES = SERVED_FROM[1:]

# OTLP SpanKind enum values (opentelemetry/proto/trace/v1/trace.proto).
SPAN_KIND_UNSPECIFIED = 0
SPAN_KIND_INTERNAL = 1
SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3
SPAN_KIND_PRODUCER = 4
SPAN_KIND_CONSUMER = 5

# OTLP Status.code values.
STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2


@dataclasses.dataclass(slots=True)
class SpanEvent:
    time_ns: int
    name: str
    attributes: dict[str, Any]


# Non-LLM spans that are a hop's call to the next hop: OTel HTTP client spans (kind CLIENT) and LiteLLM's call to its
# provider (litellm_request, and raw_gen_ai_request with the same times). Their start and end are kept with the
# trace so the decomposition can split a gateway's own processing from the network (traces/decomposition.py).
SPAN_KIND_CLIENT = 3
CALL_SPAN_NAMES = frozenset({"litellm_request", "raw_gen_ai_request"})  # a call span: kind CLIENT or one of these


@dataclasses.dataclass(slots=True)
class SpanView:
    """One validated span, the same whether it came as OTLP protobuf or OTLP JSON.

    Ids are lowercase hex (32 chars for trace ids, 16 for span ids); a root span has
    parent_span_id ''. Attribute values keep their OTLP type: str, int, float, bool,
    list (arrayValue) or dict (kvlistValue); bytes values are hex strings.
    """

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    status_code: int
    status_message: str
    attributes: dict[str, Any]
    events: list[SpanEvent]
    resource: dict[str, Any]
    scope_name: str = ""
    scope_version: str = ""
    links: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (trace_id, span_id) hex

    @property
    def service(self) -> str:
        value = self.resource.get("service.name")
        return value if isinstance(value, str) and value else "unknown_service"


@dataclasses.dataclass(slots=True)
class LLMCall:
    """What one span says about one LLM call, in canonical units (milliseconds, token counts).

    Every optional figure is None when the instrumentation did not report it; a
    normaliser never invents 0.
    """

    trace_id: str
    span_id: str
    parent_span_id: str
    role: Role
    convention: str            # "vllm", "genai", "openinference", "openllmetry", "litellm"
    service: str
    name: str
    start_ns: int
    end_ns: int
    model: str | None = None
    request_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    streaming: bool | None = None
    is_error: bool = False
    # time to first token as seen by this hop
    ttft_ms: float | None = None
    # engine-internal figures (vLLM gen_ai.latency.*), engine role only
    engine_e2e_ms: float | None = None
    queue_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    inference_ms: float | None = None
    # name/hash of the engine configuration that served the call, when known
    engine_config: str | None = None
    # the replica group (fleet group) that served the call, when the engine or gateway says so
    replica_group: str | None = None
    # Caches (appended after replica_group: positional construction elsewhere keeps working).
    # Prompt tokens this hop reports as read from a prefix/prompt cache (GenAI
    # gen_ai.usage.cache_read.input_tokens and its equivalents; collectors.attrs.cached_count).
    cached_prompt_tokens: int | None = None
    # What answered the call, when a gateway says so: "engine", "exact_cache" or "semantic_cache"
    # (observatory.cache.served_from on the platform gateway's span; None when absent).
    served_from: str | None = None
    # Milliseconds the gateway's response cache spent looking the request up (observatory.cache.lookup_ms).
    lookup_ms: float | None = None

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6
