"""OpenInference LLM spans: model/tokens from llm.*, TTFT from the First Token Stream Event."""
import pytest

from collectors import openinference
from collectors.base import STATUS_ERROR, Role

FIRST_TOKEN = "First Token Stream Event"


def test_typical_streaming_llm_span(make_span, payloads):
    span = make_span("ChatCompletion", attributes=payloads.OPENINFERENCE_LLM_ATTRIBUTES,
                     events=[(FIRST_TOKEN, 230.0)], scope_name="openinference.instrumentation.openai",
                     resource={"service.name": "rag-app"})
    call = openinference.normalise(span)

    assert call is not None
    assert call.role is Role.CLIENT
    assert call.convention == "openinference"
    assert call.service == "rag-app"
    assert call.name == "ChatCompletion"
    assert call.model == "gpt-4o-mini-2024-07-18"
    assert (call.prompt_tokens, call.completion_tokens) == (12, 20)
    assert call.streaming is True
    assert call.ttft_ms == pytest.approx(230.0)
    assert call.request_id is None
    assert call.is_error is False


def test_non_streaming_span_has_no_ttft(make_span, payloads):
    attributes = dict(payloads.OPENINFERENCE_LLM_ATTRIBUTES,
                      **{"llm.invocation_parameters": '{"model": "gpt-4o-mini", "temperature": 0.1}'})
    call = openinference.normalise(make_span("ChatCompletion", attributes=attributes))
    assert call.ttft_ms is None
    assert call.streaming is None  # the parameters do not say


def test_explicit_stream_false(make_span):
    call = openinference.normalise(make_span("ChatCompletion", attributes={
        "openinference.span.kind": "LLM", "llm.invocation_parameters": '{"stream":false,"model":"m"}'}))
    assert call.streaming is False


def test_stream_flag_without_first_token_event(make_span):
    call = openinference.normalise(make_span("ChatCompletion", attributes={
        "openinference.span.kind": "LLM", "llm.invocation_parameters": '{"stream":true}'}))
    assert call.streaming is True
    assert call.ttft_ms is None


def test_completion_tokens_from_total(make_span):
    call = openinference.normalise(make_span("llm", attributes={
        "openinference.span.kind": "LLM", "llm.token_count.prompt": 12, "llm.token_count.total": 32}))
    assert call.completion_tokens == 20
    inconsistent = openinference.normalise(make_span("llm", attributes={
        "openinference.span.kind": "LLM", "llm.token_count.prompt": 40, "llm.token_count.total": 32}))
    assert inconsistent.completion_tokens is None


def test_model_name_preference(make_span):
    call = openinference.normalise(make_span("llm", attributes={
        "openinference.span.kind": "LLM", "llm.request.model_name": "auto",
        "llm.model_name": "gpt-4o", "llm.response.model_name": "gpt-4o-2024-08-06"}))
    assert call.model == "gpt-4o-2024-08-06"


def test_missing_optional_attributes_are_none(make_span):
    call = openinference.normalise(make_span("llm", attributes={"openinference.span.kind": "LLM"}))
    for field in ("model", "prompt_tokens", "completion_tokens", "streaming", "ttft_ms", "request_id"):
        assert getattr(call, field) is None, field


@pytest.mark.parametrize(
    "kind", ["CHAIN", "AGENT", "TOOL", "RETRIEVER", "EMBEDDING", "RERANKER", "GUARDRAIL", "EVALUATOR",
             "PROMPT", "UNKNOWN", "", None, 3]
)
def test_other_span_kinds_are_not_llm_calls(make_span, kind):
    assert openinference.normalise(make_span("step", attributes={
        "openinference.span.kind": kind, "llm.model_name": "gpt-4o", "llm.token_count.prompt": 3})) is None


def test_lowercase_kind_is_tolerated(make_span):
    span = make_span("llm", attributes={"openinference.span.kind": "llm"})
    assert openinference.normalise(span) is not None


def test_response_id_from_the_recorded_response(make_span):
    """The response JSON the instrumentor records as output.value holds the id the engine reports (the join key
    when no traceparent reached the server); anything that is not such a document gives None."""
    base = {"openinference.span.kind": "LLM", "output.mime_type": "application/json"}
    body = '{"id": "chatcmpl-abc123", "object": "chat.completion", "choices": []}'
    assert openinference.normalise(make_span("ChatCompletion", attributes=dict(
        base, **{"output.value": body}))).request_id == "chatcmpl-abc123"
    for value, mime in [(body, "text/plain"), ('{"id": 42}', "application/json"), ("[1, 2]", "application/json"),
                        ('{"id": "x"', "application/json"), ("{" + " " * openinference.MAX_OUTPUT_SCAN + "}",
                                                               "application/json"), (None, "application/json")]:
        attributes = dict(base, **{"output.mime_type": mime})
        if value is not None:
            attributes["output.value"] = value
        assert openinference.normalise(make_span("ChatCompletion", attributes=attributes)).request_id is None


def test_error_status(make_span):
    call = openinference.normalise(make_span("ChatCompletion", attributes={"openinference.span.kind": "LLM"},
                                             status_code=STATUS_ERROR))
    assert call.is_error is True


def test_junk_values(make_span):
    call = openinference.normalise(make_span("llm", attributes={
        "openinference.span.kind": "LLM", "llm.model_name": 3.2, "llm.token_count.prompt": "twelve",
        "llm.token_count.completion": -4, "llm.token_count.total": None,
        "llm.invocation_parameters": '{"stream": tru'}))
    for field in ("model", "prompt_tokens", "completion_tokens", "streaming"):
        assert getattr(call, field) is None, field
    not_a_dict = openinference.normalise(make_span("llm", attributes={
        "openinference.span.kind": "LLM", "llm.invocation_parameters": '["stream"]'}))
    assert not_a_dict.streaming is None
    nested = openinference.normalise(make_span("llm", attributes={
        "openinference.span.kind": "LLM", "llm.invocation_parameters": '{"stream": ' + "[" * 100_000}))
    assert nested.streaming is None


def test_litellm_spans_written_with_openinference_names_belong_to_litellm(make_span):
    span = make_span("litellm_request", scope_name="litellm",
                     attributes={"openinference.span.kind": "LLM", "llm.model_name": "gpt-4o"})
    assert openinference.normalise(span) is None
