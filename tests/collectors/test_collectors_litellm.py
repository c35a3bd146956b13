"""LiteLLM: the proxy span (or V2's LLM-call span) is the one gateway call; other LiteLLM spans give None."""
import pytest

from collectors import litellm
from collectors.base import SPAN_KIND_CLIENT, SPAN_KIND_INTERNAL, SPAN_KIND_SERVER, STATUS_ERROR, Role

PROXY = "Received Proxy Server Request"


def proxy_span(make_span, payloads, attributes=None, **overrides):
    kwargs = dict(kind=SPAN_KIND_SERVER, scope_name="litellm", resource=payloads.LITELLM_RESOURCE,
                  attributes=payloads.LITELLM_CALL_ATTRIBUTES if attributes is None else attributes,
                  parent_span_id="a3ce929d0e0e4736")
    kwargs.update(overrides)
    return make_span(PROXY, **kwargs)


def test_proxy_span_with_call_attributes(make_span, payloads):
    call = litellm.normalise(proxy_span(make_span, payloads))

    assert call is not None
    assert call.role is Role.GATEWAY
    assert call.convention == "litellm"
    assert call.service == "litellm"
    assert call.name == PROXY
    assert call.parent_span_id == "a3ce929d0e0e4736"
    assert call.model == "hosted_vllm/meta-llama/Llama-3.1-8B-Instruct"
    assert call.request_id == "chatcmpl-9f2c6c1e5b6e4a3f8d0a1b2c3d4e5f60"
    assert (call.prompt_tokens, call.completion_tokens) == (512, 128)
    assert call.streaming is True  # "True", LiteLLM writes the flag as a string
    assert call.ttft_ms is None  # LiteLLM v1 never puts TTFT on a span
    assert call.is_error is False


def test_bare_proxy_span_is_still_the_gateway_hop(make_span, payloads):
    # 2024 releases and releases since the May-2026 fix annotate litellm_request instead.
    call = litellm.normalise(proxy_span(make_span, payloads, attributes={}))
    assert call is not None
    assert call.role is Role.GATEWAY
    for field in ("model", "request_id", "prompt_tokens", "completion_tokens", "streaming", "ttft_ms"):
        assert getattr(call, field) is None, field


def test_pre_2025_internal_kind_proxy_span(make_span, payloads):
    assert litellm.normalise(proxy_span(make_span, payloads, kind=SPAN_KIND_INTERNAL)).role is Role.GATEWAY


def test_older_token_names_and_request_id_fallback(make_span, payloads):
    call = litellm.normalise(proxy_span(make_span, payloads, attributes={
        "gen_ai.request.model": "gpt-3.5-turbo", "llm.request.type": "completion",
        "llm.is_streaming": "False",
        "gen_ai.usage.prompt_tokens": 8, "gen_ai.usage.completion_tokens": 9, "llm.usage.total_tokens": 17,
        "gen_ai.request.id": "c2a2a7a4"}))
    assert call.model == "gpt-3.5-turbo"
    assert (call.prompt_tokens, call.completion_tokens) == (8, 9)
    assert call.streaming is False
    assert call.request_id == "c2a2a7a4"


def test_proxy_span_written_by_the_arize_logger(make_span, payloads):
    call = litellm.normalise(proxy_span(make_span, payloads, attributes={
        "openinference.span.kind": "LLM", "llm.model_name": "gpt-4o", "llm.token_count.prompt": 10,
        "llm.token_count.completion": 4}))
    assert (call.model, call.prompt_tokens, call.completion_tokens) == ("gpt-4o", 10, 4)


@pytest.mark.parametrize("call_type", ["aembedding", "aimage_generation", "atranscription", "arerank",
                                       "acreate_batch", "moderation"])
def test_proxy_spans_of_non_generation_calls(make_span, payloads, call_type):
    attributes = dict(payloads.LITELLM_CALL_ATTRIBUTES, **{"llm.request.type": call_type})
    assert litellm.normalise(proxy_span(make_span, payloads, attributes=attributes)) is None


def test_failed_proxy_request(make_span, payloads):
    call = litellm.normalise(proxy_span(make_span, payloads, attributes={}, status_code=STATUS_ERROR))
    assert call.is_error is True


@pytest.mark.parametrize("name", ["litellm_request", "raw_gen_ai_request", "Failed Proxy Server Request",
                                  "guardrail", "redis", "postgres", "/key/generate"])
def test_other_litellm_spans_are_none(make_span, payloads, name):
    span = make_span(name, attributes=payloads.LITELLM_CALL_ATTRIBUTES, scope_name="litellm",
                     resource=payloads.LITELLM_RESOURCE)
    assert litellm.owns(span)
    assert litellm.normalise(span) is None


def test_renamed_litellm_request_is_owned_and_none(make_span, payloads):
    span = make_span("summarise-ticket", attributes=payloads.LITELLM_CALL_ATTRIBUTES, scope_name="my-tracer")
    assert litellm.owns(span)
    assert litellm.normalise(span) is None


def test_v2_llm_call_span(make_span, payloads):
    span = make_span("chat llama-3.1-8b", kind=SPAN_KIND_CLIENT,
                     attributes=payloads.LITELLM_V2_CALL_ATTRIBUTES,
                     scope_name="litellm.integrations.otel", resource=payloads.LITELLM_RESOURCE)
    call = litellm.normalise(span)
    assert call is not None
    assert call.role is Role.GATEWAY
    assert call.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert call.request_id == "chatcmpl-0a1b"
    assert (call.prompt_tokens, call.completion_tokens) == (512, 128)
    assert call.streaming is True
    assert call.ttft_ms == pytest.approx(121.0)


def test_v2_auxiliary_and_non_text_calls_are_none(make_span, payloads):
    base = payloads.LITELLM_V2_CALL_ATTRIBUTES
    for attributes in (
        {**base, "litellm.request.purpose": "autorouter_classifier"},
        {**base, "gen_ai.operation.name": "embeddings"},
        {**base, "gen_ai.operation.name": "generate_content", "gen_ai.output.type": "image"},
        {**base, "gen_ai.operation.name": None},
    ):
        assert litellm.normalise(make_span("x", kind=SPAN_KIND_CLIENT, attributes=attributes)) is None


def test_v2_error_type(make_span, payloads):
    attributes = {**payloads.LITELLM_V2_CALL_ATTRIBUTES, "error.type": "RateLimitError"}
    assert litellm.normalise(make_span("chat m", attributes=attributes)).is_error is True


def test_junk_values(make_span, payloads):
    call = litellm.normalise(proxy_span(make_span, payloads, attributes={
        "llm.request.type": "acompletion", "llm.is_streaming": "", "gen_ai.response.model": "",
        "gen_ai.request.model": None, "gen_ai.usage.input_tokens": "", "gen_ai.usage.output_tokens": "12.7",
        "gen_ai.response.id": ["x"], "gen_ai.response.time_to_first_chunk": "later"}))
    for field in ("model", "prompt_tokens", "completion_tokens", "streaming", "request_id", "ttft_ms"):
        assert getattr(call, field) is None, field


def test_non_litellm_spans(make_span, payloads):
    assert litellm.normalise(make_span("chat gpt-4o", attributes=payloads.GENAI_CHAT_ATTRIBUTES)) is None
    assert litellm.normalise(payloads.vllm_span()) is None
