"""Span builders and a catalogue of spans shaped as each instrumentation emits them (names, types, kinds)."""
from __future__ import annotations

import dataclasses
from typing import Any

from collectors.base import (
    SPAN_KIND_CLIENT,
    SPAN_KIND_INTERNAL,
    SPAN_KIND_SERVER,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_UNSET,
    SpanEvent,
    SpanView,
)

T0 = 1_760_000_000_000_000_000  # a start time in ns since the epoch
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
MS = 1_000_000


def build_span(
    name: str,
    *,
    kind: int = SPAN_KIND_INTERNAL,
    attributes: dict[str, Any] | None = None,
    resource: dict[str, Any] | None = None,
    events: list[tuple[str, float]] | None = None,
    duration_ms: float = 1000.0,
    status_code: int = STATUS_UNSET,
    scope_name: str = "",
    span_id: str = "00f067aa0ba902b7",
    parent_span_id: str = "",
) -> SpanView:
    """A SpanView starting at T0; ``events`` are (name, milliseconds after start)."""
    return SpanView(
        trace_id=TRACE_ID,
        span_id=span_id,
        parent_span_id=parent_span_id,
        name=name,
        kind=kind,
        start_ns=T0,
        end_ns=T0 + int(duration_ms * MS),
        status_code=status_code,
        status_message="",
        attributes=dict(attributes or {}),
        events=[
            SpanEvent(time_ns=T0 + int(at_ms * MS), name=ev_name, attributes={})
            for ev_name, at_ms in events or []
        ],
        resource=dict(resource or {"service.name": "test-service"}),
        scope_name=scope_name,
    )


# --------------------------------------------------------------------------- vLLM

VLLM_RESOURCE = {
    "service.name": "vllm-llama-8b",
    "telemetry.sdk.language": "python",
    "telemetry.sdk.name": "opentelemetry",
    "telemetry.sdk.version": "1.38.0",
    "vllm.instrumenting_module_name": "vllm.llm_engine",
    "vllm.process_id": "48213",
}

VLLM_ATTRIBUTES = {
    "gen_ai.latency.time_to_first_token": 0.0842,
    "gen_ai.latency.e2e": 1.9031,
    "gen_ai.latency.time_in_queue": 0.0121,
    "gen_ai.usage.prompt_tokens": 512,
    "gen_ai.usage.completion_tokens": 128,
    "gen_ai.latency.time_in_model_prefill": 0.0703,
    "gen_ai.latency.time_in_model_decode": 1.8012,
    "gen_ai.latency.time_in_model_inference": 1.8715,
    "gen_ai.request.id": "chatcmpl-9f2c6c1e5b6e4a3f8d0a1b2c3d4e5f60",
    "gen_ai.response.finish_reasons": '["stop"]',
    "gen_ai.request.top_p": 0.95,
    "gen_ai.request.max_tokens": 256,
    "gen_ai.request.temperature": 0.7,
    "gen_ai.request.n": 1,
    "gen_ai.response.model": "meta-llama/Llama-3.1-8B-Instruct",
}


def vllm_span(**overrides: Any) -> SpanView:
    kwargs: dict[str, Any] = dict(
        kind=SPAN_KIND_SERVER,
        attributes=VLLM_ATTRIBUTES,
        resource=VLLM_RESOURCE,
        duration_ms=1903.1,
        scope_name="vllm.llm_engine",
        parent_span_id="b7ad6b7169203331",
    )
    kwargs.update(overrides)
    return build_span("llm_request", **kwargs)


# --------------------------------------------------------------------------- OTel GenAI

GENAI_CHAT_ATTRIBUTES = {
    "gen_ai.operation.name": "chat",
    "gen_ai.provider.name": "openai",
    "gen_ai.request.model": "gpt-4o",
    "gen_ai.request.max_tokens": 200,
    "gen_ai.request.stream": True,
    "gen_ai.response.model": "gpt-4o-2024-08-06",
    "gen_ai.response.id": "chatcmpl-123",
    "gen_ai.response.finish_reasons": ("stop",),
    "gen_ai.response.time_to_first_chunk": 0.5,
    "gen_ai.usage.input_tokens": 100,
    "gen_ai.usage.output_tokens": 180,
    "server.address": "api.openai.com",
    "server.port": 443,
}

# opentelemetry-instrumentation-openai-v2 before the v1.37 rename: deprecated names.
GENAI_DEPRECATED_ATTRIBUTES = {
    "gen_ai.operation.name": "chat",
    "gen_ai.system": "openai",
    "gen_ai.request.model": "gpt-3.5-turbo",
    "gen_ai.response.model": "gpt-3.5-turbo-0125",
    "gen_ai.response.id": "chatcmpl-9XtcaF1Q0cm8pL2fcOIblCL8cmhVO",
    "gen_ai.usage.prompt_tokens": 8,
    "gen_ai.usage.completion_tokens": 9,
}

# --------------------------------------------------------------------------- OpenInference

OPENINFERENCE_LLM_ATTRIBUTES = {
    "openinference.span.kind": "LLM",
    "input.value": '{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o-mini", '
                   '"stream": true}',
    "input.mime_type": "application/json",
    "llm.invocation_parameters": '{"model": "gpt-4o-mini", "stream": true, '
                                 '"stream_options": {"include_usage": true}}',
    "llm.input_messages.0.message.role": "user",
    "llm.input_messages.0.message.content": "hi",
    "llm.output_messages.0.message.role": "assistant",
    "llm.output_messages.0.message.content": "Hello! How can I help?",
    "llm.model_name": "gpt-4o-mini-2024-07-18",
    "llm.token_count.prompt": 12,
    "llm.token_count.completion": 20,
    "llm.token_count.total": 32,
    "llm.provider": "openai",
    "llm.system": "openai",
    "output.value": "Hello! How can I help?",
    "output.mime_type": "text/plain",
}

# --------------------------------------------------------------------------- OpenLLMetry

# opentelemetry-instrumentation-openai with semconv-ai 0.4.x, streaming, inside a Traceloop workflow.
OPENLLMETRY_LEGACY_ATTRIBUTES = {
    "llm.request.type": "chat",
    "gen_ai.system": "openai",
    "gen_ai.request.model": "gpt-4o",
    "gen_ai.request.max_tokens": 100,
    "llm.is_streaming": True,
    "llm.headers": "None",
    "gen_ai.openai.api_base": "https://api.openai.com/v1/",
    "gen_ai.prompt.0.role": "user",
    "gen_ai.prompt.0.content": "Tell me a joke about OpenTelemetry",
    "gen_ai.response.model": "gpt-4o-2024-08-06",
    "gen_ai.response.id": "chatcmpl-AbCdEf",
    "llm.usage.total_tokens": 30,
    "gen_ai.usage.completion_tokens": 20,
    "gen_ai.usage.prompt_tokens": 10,
    "gen_ai.completion.0.finish_reason": "stop",
    "gen_ai.completion.0.role": "assistant",
    "gen_ai.completion.0.content": "Why did the span ...",
    "traceloop.workflow.name": "joke_generation",
    "traceloop.entity.path": "joke_creation",
}

# semconv-ai >= 0.5: OTel-aligned names plus gen_ai.is_streaming / gen_ai.usage.total_tokens.
OPENLLMETRY_CURRENT_ATTRIBUTES = {
    "gen_ai.operation.name": "chat",
    "gen_ai.provider.name": "openai",
    "gen_ai.request.model": "gpt-4o",
    "gen_ai.is_streaming": True,
    "gen_ai.response.model": "gpt-4o-2024-08-06",
    "gen_ai.response.id": "chatcmpl-GhIjKl",
    "gen_ai.usage.input_tokens": 11,
    "gen_ai.usage.output_tokens": 21,
    "gen_ai.usage.total_tokens": 32,
}

# --------------------------------------------------------------------------- LiteLLM

LITELLM_RESOURCE = {
    "service.name": "litellm",
    "deployment.environment": "production",
    "model_id": "litellm",
}

# What LiteLLM's set_attributes writes (acompletion through the proxy to a vLLM deployment).
LITELLM_CALL_ATTRIBUTES = {
    "metadata.user_api_key_hash": "88dc28d0f030c55ed4ab77ed8faf098196cb1c05df778539800c9f1243fe6b4b",
    "metadata.user_api_key_alias": "",
    "metadata.user_api_key_team_id": "",
    "metadata.user_api_key_user_id": "default_user_id",
    "metadata.requester_ip_address": "10.0.0.7",
    "hidden_params": '{"model_id": "d1f2", "api_base": "http://vllm:8000/v1", '
                     '"litellm_overhead_time_ms": 2.3}',
    "gen_ai.cost.input_cost": 0.0,
    "gen_ai.request.model": "llama-3.1-8b",
    "llm.request.type": "acompletion",
    "gen_ai.system": "hosted_vllm",
    "gen_ai.request.max_tokens": 256,
    "llm.is_streaming": "True",
    "gen_ai.response.id": "chatcmpl-9f2c6c1e5b6e4a3f8d0a1b2c3d4e5f60",
    "gen_ai.response.model": "hosted_vllm/meta-llama/Llama-3.1-8B-Instruct",
    "gen_ai.usage.total_tokens": 640,
    "gen_ai.usage.output_tokens": 128,
    "gen_ai.usage.input_tokens": 512,
    "gen_ai.operation.name": "acompletion",
    "gen_ai.request.id": "c2a2a7a4-1f0e-4f53-9a3c-0d6b1c1e8a77",
}

LITELLM_V2_CALL_ATTRIBUTES = {
    "gen_ai.operation.name": "chat",
    "gen_ai.provider.name": "hosted_vllm",
    "gen_ai.request.model": "llama-3.1-8b",
    "gen_ai.response.model": "meta-llama/Llama-3.1-8B-Instruct",
    "gen_ai.response.id": "chatcmpl-0a1b",
    "gen_ai.response.time_to_first_chunk": 0.121,
    "gen_ai.usage.input_tokens": 512,
    "gen_ai.usage.output_tokens": 128,
    "litellm.call_id": "c2a2a7a4-1f0e-4f53-9a3c-0d6b1c1e8a77",
    "litellm.call_type": "acompletion",
    "litellm.request.streaming": True,
    "litellm.provider.model": "hosted_vllm/meta-llama/Llama-3.1-8B-Instruct",
    "server.address": "vllm",
    "server.port": 8000,
}

HTTP_SERVER_ATTRIBUTES = {
    "http.request.method": "POST",
    "url.scheme": "http",
    "url.path": "/v1/chat/completions",
    "http.route": "/v1/chat/completions",
    "http.response.status_code": 200,
    "server.address": "gateway",
    "server.port": 8100,
    "client.address": "10.0.0.7",
    "user_agent.original": "OpenAI/Python 1.54.0",
    "network.protocol.version": "1.1",
}


@dataclasses.dataclass(frozen=True)
class Sample:
    label: str
    span: SpanView
    convention: str | None  # which convention must claim it as an LLM call (None: nobody)


def catalogue() -> list[Sample]:
    """Realistic spans of every convention, LLM and not, for the no-double-claim checks."""
    litellm_scope = {"scope_name": "litellm", "resource": LITELLM_RESOURCE}
    return [
        # vLLM / simulator
        Sample("vllm llm_request", vllm_span(), "vllm"),
        Sample(
            "simulator llm_request",
            vllm_span(resource={
                "service.name": "engine-sim-0",
                "llm_observatory.simulated": True,
                "llm_observatory.engine_config": "cfg-7f3a",
            }),
            "vllm",
        ),
        Sample("vllm model-load span", build_span("load_weights", resource=VLLM_RESOURCE), None),
        Sample("llm_request without vLLM markers", build_span("llm_request", attributes={"x": 1}), None),
        # plain GenAI
        Sample("genai chat client", build_span("chat gpt-4o", kind=SPAN_KIND_CLIENT,
                                               attributes=GENAI_CHAT_ATTRIBUTES), "genai"),
        Sample("genai deprecated names", build_span("chat gpt-3.5-turbo", kind=SPAN_KIND_CLIENT,
                                                    attributes=GENAI_DEPRECATED_ATTRIBUTES), "genai"),
        Sample("genai server span", build_span("chat llama", kind=SPAN_KIND_SERVER,
                                               attributes=GENAI_CHAT_ATTRIBUTES), "genai"),
        Sample("genai embeddings", build_span("embeddings m", kind=SPAN_KIND_CLIENT, attributes={
            "gen_ai.operation.name": "embeddings", "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "text-embedding-3-small", "gen_ai.usage.input_tokens": 9}), None),
        Sample("genai execute_tool", build_span("execute_tool get_weather", attributes={
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather"}), None),
        Sample("genai invoke_agent", build_span("invoke_agent planner", attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.provider.name": "openai",
            "gen_ai.agent.name": "planner", "gen_ai.request.model": "gpt-4o"}), None),
        # OpenInference
        Sample("openinference LLM", build_span("ChatCompletion", attributes=OPENINFERENCE_LLM_ATTRIBUTES,
                                               events=[("First Token Stream Event", 230.0)],
                                               scope_name="openinference.instrumentation.openai"),
               "openinference"),
        *[
            Sample(f"openinference {kind}", build_span(kind.title(), attributes={
                "openinference.span.kind": kind, "input.value": "q", "output.value": "a",
                "llm.model_name": "gpt-4o", "gen_ai.system": "openai"}), None)
            for kind in ("CHAIN", "AGENT", "TOOL", "RETRIEVER", "EMBEDDING", "RERANKER", "GUARDRAIL")
        ],
        # OpenLLMetry
        Sample("openllmetry legacy chat", build_span("openai.chat", kind=SPAN_KIND_CLIENT,
                                                     attributes=OPENLLMETRY_LEGACY_ATTRIBUTES,
                                                     events=[("llm.content.completion.chunk", 180.0),
                                                             ("llm.content.completion.chunk", 195.0)],
                                                     scope_name="opentelemetry.instrumentation.openai.v1"),
               "openllmetry"),
        Sample("openllmetry current chat", build_span("chat gpt-4o", kind=SPAN_KIND_CLIENT,
                                                      attributes=OPENLLMETRY_CURRENT_ATTRIBUTES,
                                                      events=[("gen_ai.content.completion.chunk", 150.0)]),
               "openllmetry"),
        Sample("openllmetry workflow", build_span("joke_generation.workflow", attributes={
            "traceloop.span.kind": "workflow", "traceloop.workflow.name": "joke_generation",
            "traceloop.entity.name": "joke_generation", "traceloop.entity.input": "{}"}), None),
        Sample("openllmetry task", build_span("joke_creation.task", attributes={
            "traceloop.span.kind": "task", "traceloop.entity.name": "joke_creation",
            "gen_ai.system": "openai"}), None),
        Sample("openllmetry embedding", build_span("openai.embeddings", kind=SPAN_KIND_CLIENT, attributes={
            "llm.request.type": "embedding", "gen_ai.system": "openai",
            "gen_ai.request.model": "text-embedding-ada-002", "gen_ai.usage.prompt_tokens": 8}), None),
        # LiteLLM
        Sample("litellm proxy span with call attributes",
               build_span("Received Proxy Server Request", kind=SPAN_KIND_SERVER,
                          attributes=LITELLM_CALL_ATTRIBUTES, **litellm_scope), "litellm"),
        Sample("litellm bare proxy span",
               build_span("Received Proxy Server Request", kind=SPAN_KIND_SERVER, **litellm_scope),
               "litellm"),
        Sample("litellm_request", build_span("litellm_request", attributes=LITELLM_CALL_ATTRIBUTES,
                                             **litellm_scope), None),
        Sample("litellm_request renamed by generation_name",
               build_span("summarise-ticket", attributes=LITELLM_CALL_ATTRIBUTES,
                          resource=LITELLM_RESOURCE, scope_name="custom-tracer"), None),
        Sample("litellm raw_gen_ai_request", build_span("raw_gen_ai_request", attributes={
            "llm.hosted_vllm.model": "meta-llama/Llama-3.1-8B-Instruct", "llm.hosted_vllm.stream": True,
            "llm.hosted_vllm.id": "chatcmpl-9f2c"}, **litellm_scope), None),
        Sample("litellm failed request", build_span("Failed Proxy Server Request", status_code=STATUS_ERROR,
                                                    attributes={"exception": "AuthenticationError"},
                                                    **litellm_scope), None),
        Sample("litellm guardrail", build_span("guardrail", attributes={
            "openinference.span.kind": "GUARDRAIL", "guardrail_name": "pii", "guardrail_mode": "pre_call"},
            **litellm_scope), None),
        Sample("litellm service span", build_span("redis", attributes={
            "call_type": "async_get_cache", "service": "redis"}, **litellm_scope), None),
        Sample("litellm arize-style litellm_request", build_span("litellm_request", attributes={
            "openinference.span.kind": "LLM", "llm.model_name": "gpt-4o", "llm.token_count.prompt": 10},
            **litellm_scope), None),
        Sample("litellm v2 llm call", build_span("chat llama-3.1-8b", kind=SPAN_KIND_CLIENT,
                                                 attributes=LITELLM_V2_CALL_ATTRIBUTES,
                                                 scope_name="litellm.integrations.otel",
                                                 resource=LITELLM_RESOURCE), "litellm"),
        # Nobody's
        Sample("http server", build_span("POST /v1/chat/completions", kind=SPAN_KIND_SERVER,
                                         attributes=HTTP_SERVER_ATTRIBUTES, status_code=STATUS_OK,
                                         scope_name="opentelemetry.instrumentation.fastapi"), None),
        Sample("db client", build_span("SELECT observatory", kind=SPAN_KIND_CLIENT, attributes={
            "db.system.name": "postgresql", "db.operation.name": "SELECT", "db.namespace": "observatory"}),
            None),
        Sample("no attributes", build_span("work"), None),
    ]
