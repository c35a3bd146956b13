"""OpenLLMetry/Traceloop LLM spans of both attribute generations; decorator spans are not calls."""
import pytest

from collectors import openllmetry
from collectors.base import SPAN_KIND_CLIENT, STATUS_ERROR, Role

LEGACY_CHUNK = "llm.content.completion.chunk"
CURRENT_CHUNK = "gen_ai.content.completion.chunk"


def test_legacy_streaming_chat(make_span, payloads):
    span = make_span("openai.chat", kind=SPAN_KIND_CLIENT, attributes=payloads.OPENLLMETRY_LEGACY_ATTRIBUTES,
                     events=[(LEGACY_CHUNK, 180.0), (LEGACY_CHUNK, 195.0), (LEGACY_CHUNK, 210.0)],
                     scope_name="opentelemetry.instrumentation.openai.v1",
                     resource={"service.name": "joke-app"})
    call = openllmetry.normalise(span)

    assert call is not None
    assert call.role is Role.CLIENT
    assert call.convention == "openllmetry"
    assert call.service == "joke-app"
    assert call.model == "gpt-4o-2024-08-06"
    assert call.request_id == "chatcmpl-AbCdEf"
    assert (call.prompt_tokens, call.completion_tokens) == (10, 20)
    assert call.streaming is True
    assert call.ttft_ms == pytest.approx(180.0)
    assert call.is_error is False


def test_current_generation_names(make_span, payloads):
    call = openllmetry.normalise(make_span("chat gpt-4o", kind=SPAN_KIND_CLIENT,
                                           attributes=payloads.OPENLLMETRY_CURRENT_ATTRIBUTES,
                                           events=[(CURRENT_CHUNK, 150.0)]))
    assert call is not None
    assert call.model == "gpt-4o-2024-08-06"
    assert (call.prompt_tokens, call.completion_tokens) == (11, 21)
    assert call.streaming is True
    assert call.ttft_ms == pytest.approx(150.0)


def test_non_streaming_chat_has_no_ttft(make_span, payloads):
    attributes = dict(payloads.OPENLLMETRY_LEGACY_ATTRIBUTES, **{"llm.is_streaming": False})
    call = openllmetry.normalise(make_span("openai.chat", kind=SPAN_KIND_CLIENT, attributes=attributes))
    assert call.streaming is False
    assert call.ttft_ms is None


def test_completion_request_type(make_span):
    call = openllmetry.normalise(make_span("openai.completion", attributes={
        "llm.request.type": "completion", "gen_ai.system": "openai",
        "gen_ai.request.model": "gpt-3.5-turbo-instruct",
        "gen_ai.usage.prompt_tokens": 5, "gen_ai.usage.completion_tokens": 7}))
    assert (call.model, call.prompt_tokens, call.completion_tokens) == ("gpt-3.5-turbo-instruct", 5, 7)


def test_missing_optional_attributes_are_none(make_span):
    call = openllmetry.normalise(make_span("openai.chat", attributes={"llm.request.type": "chat"}))
    for field in ("model", "request_id", "prompt_tokens", "completion_tokens", "streaming", "ttft_ms"):
        assert getattr(call, field) is None, field


@pytest.mark.parametrize("kind", ["workflow", "task", "agent", "tool", "unknown"])
def test_decorator_spans_are_not_llm_calls(make_span, kind):
    assert openllmetry.normalise(make_span(f"x.{kind}", attributes={
        "traceloop.span.kind": kind, "traceloop.entity.name": "x", "traceloop.workflow.name": "w",
        "gen_ai.system": "openai"})) is None


@pytest.mark.parametrize("request_type", ["embedding", "rerank", "unknown", 3])
def test_other_request_types_are_not_llm_calls(make_span, request_type):
    assert openllmetry.normalise(make_span("openai.embeddings", attributes={
        "llm.request.type": request_type, "gen_ai.system": "openai",
        "gen_ai.usage.prompt_tokens": 8})) is None


def test_current_generation_embeddings_are_not_llm_calls(make_span):
    assert openllmetry.normalise(make_span("embeddings m", attributes={
        "gen_ai.operation.name": "embeddings", "gen_ai.provider.name": "openai",
        "gen_ai.is_streaming": False})) is None


def test_error_status(make_span, payloads):
    call = openllmetry.normalise(make_span("openai.chat", attributes=payloads.OPENLLMETRY_LEGACY_ATTRIBUTES,
                                           status_code=STATUS_ERROR))
    assert call.is_error is True


def test_junk_values(make_span):
    call = openllmetry.normalise(make_span("openai.chat", attributes={
        "llm.request.type": "chat", "llm.is_streaming": "sometimes", "gen_ai.response.model": 0.5,
        "gen_ai.usage.prompt_tokens": "x", "gen_ai.usage.completion_tokens": float("inf")},
        events=[(LEGACY_CHUNK, -3.0)]))
    for field in ("model", "prompt_tokens", "completion_tokens", "streaming", "ttft_ms"):
        assert getattr(call, field) is None, field


def test_litellm_spans_with_openllmetry_names_belong_to_litellm(make_span, payloads):
    for span in (
        make_span("litellm_request", attributes=payloads.LITELLM_CALL_ATTRIBUTES, scope_name="litellm"),
        make_span("my-generation", attributes=payloads.LITELLM_CALL_ATTRIBUTES),  # renamed, hidden_params
        make_span("Received Proxy Server Request", attributes=payloads.LITELLM_CALL_ATTRIBUTES),
    ):
        assert openllmetry.normalise(span) is None, span.name
