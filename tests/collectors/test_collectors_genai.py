"""Plain OTel GenAI inference spans, current and deprecated attribute names."""
import pytest

from collectors import genai
from collectors.base import SPAN_KIND_CLIENT, SPAN_KIND_INTERNAL, SPAN_KIND_SERVER, STATUS_ERROR, Role


def test_typical_streaming_chat_client_span(make_span, payloads):
    span = make_span("chat gpt-4o", kind=SPAN_KIND_CLIENT, attributes=payloads.GENAI_CHAT_ATTRIBUTES,
                     resource={"service.name": "support-bot"})
    call = genai.normalise(span)

    assert call is not None
    assert call.role is Role.CLIENT
    assert call.convention == "genai"
    assert call.service == "support-bot"
    assert call.model == "gpt-4o-2024-08-06"
    assert call.request_id == "chatcmpl-123"
    assert (call.prompt_tokens, call.completion_tokens) == (100, 180)
    assert call.streaming is True
    assert call.ttft_ms == pytest.approx(500.0)
    assert call.is_error is False
    for field in ("engine_e2e_ms", "queue_ms", "prefill_ms", "decode_ms", "inference_ms"):
        assert getattr(call, field) is None


def test_deprecated_names(make_span, payloads):
    call = genai.normalise(make_span("chat gpt-3.5-turbo", kind=SPAN_KIND_CLIENT,
                                     attributes=payloads.GENAI_DEPRECATED_ATTRIBUTES))
    assert call is not None
    assert call.model == "gpt-3.5-turbo-0125"
    assert (call.prompt_tokens, call.completion_tokens) == (8, 9)
    assert call.request_id == "chatcmpl-9XtcaF1Q0cm8pL2fcOIblCL8cmhVO"


def test_current_names_win_over_deprecated_ones(make_span):
    call = genai.normalise(make_span("chat m", attributes={
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
        "gen_ai.usage.input_tokens": 10, "gen_ai.usage.prompt_tokens": 99,
        "gen_ai.usage.output_tokens": 20, "gen_ai.usage.completion_tokens": 99}))
    assert (call.prompt_tokens, call.completion_tokens) == (10, 20)


def test_pre_operation_name_spans_need_a_model(make_span):
    legacy = {"gen_ai.system": "openai", "gen_ai.request.model": "gpt-3.5-turbo",
              "gen_ai.usage.prompt_tokens": 8}
    call = genai.normalise(make_span("openai.chat", kind=SPAN_KIND_CLIENT, attributes=legacy))
    assert call.model == "gpt-3.5-turbo"
    assert genai.normalise(make_span("openai.chat", attributes={"gen_ai.system": "openai"})) is None


@pytest.mark.parametrize("operation", ["chat", "text_completion", "generate_content"])
def test_generation_operations(make_span, operation):
    call = genai.normalise(make_span(f"{operation} m", attributes={
        "gen_ai.operation.name": operation, "gen_ai.provider.name": "gcp.gemini"}))
    assert call is not None
    assert call.model is None


@pytest.mark.parametrize(
    "operation",
    ["embeddings", "retrieval", "execute_tool", "create_agent", "invoke_agent", "invoke_workflow", 7],
)
def test_non_generation_operations_are_not_llm_calls(make_span, operation):
    assert genai.normalise(make_span("op", attributes={
        "gen_ai.operation.name": operation, "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-4o"})) is None


def test_missing_optional_attributes_are_none(make_span):
    call = genai.normalise(make_span("chat", kind=SPAN_KIND_CLIENT, attributes={
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai"}))
    for field in ("model", "request_id", "prompt_tokens", "completion_tokens", "streaming", "ttft_ms",
                  "engine_config", "replica_group"):
        assert getattr(call, field) is None, field


def test_non_streaming_request(make_span, payloads):
    attributes = dict(payloads.GENAI_CHAT_ATTRIBUTES, **{"gen_ai.request.stream": False})
    del attributes["gen_ai.response.time_to_first_chunk"]
    call = genai.normalise(make_span("chat gpt-4o", kind=SPAN_KIND_CLIENT, attributes=attributes))
    assert call.streaming is False
    assert call.ttft_ms is None


def test_time_to_first_chunk_implies_streaming(make_span):
    call = genai.normalise(make_span("chat", attributes={
        "gen_ai.operation.name": "chat", "gen_ai.system": "openai",
        "gen_ai.response.time_to_first_chunk": "0.25"}))
    assert call.streaming is True
    assert call.ttft_ms == pytest.approx(250.0)


def test_openlit_ttft_span_attribute_is_a_fallback(make_span):
    call = genai.normalise(make_span("chat gpt-4o", attributes={
        "gen_ai.operation.name": "chat", "gen_ai.system": "openai",
        "gen_ai.server.time_to_first_token": 0.31}))
    assert call.ttft_ms == pytest.approx(310.0)


def test_server_kind_is_a_gateway_and_internal_a_client(make_span, payloads):
    attributes = payloads.GENAI_CHAT_ATTRIBUTES
    server = genai.normalise(make_span("chat", kind=SPAN_KIND_SERVER, attributes=attributes))
    internal = genai.normalise(make_span("chat", kind=SPAN_KIND_INTERNAL, attributes=attributes))
    assert server.role is Role.GATEWAY
    assert internal.role is Role.CLIENT


def test_errors_from_status_or_error_type(make_span):
    base = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai"}
    assert genai.normalise(make_span("chat", attributes=base, status_code=STATUS_ERROR)).is_error
    assert genai.normalise(make_span("chat", attributes={**base, "error.type": "timeout"})).is_error
    assert not genai.normalise(make_span("chat", attributes=base)).is_error


def test_junk_values(make_span):
    call = genai.normalise(make_span("chat", attributes={
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
        "gen_ai.response.model": ["gpt-4o"], "gen_ai.request.model": None,
        "gen_ai.usage.input_tokens": "lots", "gen_ai.usage.output_tokens": -1,
        "gen_ai.request.stream": "perhaps", "gen_ai.response.time_to_first_chunk": -0.2,
        "gen_ai.response.id": 3.5}))
    for field in ("model", "prompt_tokens", "completion_tokens", "streaming", "ttft_ms", "request_id"):
        assert getattr(call, field) is None, field


def test_spans_of_more_specific_conventions_are_refused(make_span, payloads):
    assert genai.normalise(payloads.vllm_span()) is None
    for attributes in (payloads.OPENLLMETRY_LEGACY_ATTRIBUTES, payloads.OPENLLMETRY_CURRENT_ATTRIBUTES):
        assert genai.normalise(make_span("chat gpt-4o", attributes=attributes)) is None
    assert genai.normalise(make_span("Received Proxy Server Request",
                                     attributes=payloads.LITELLM_CALL_ATTRIBUTES)) is None
    assert genai.normalise(make_span("chat m", attributes=payloads.LITELLM_V2_CALL_ATTRIBUTES)) is None
    assert genai.normalise(make_span("ChatCompletion", attributes={
        **payloads.OPENINFERENCE_LLM_ATTRIBUTES, "gen_ai.system": "openai"})) is None
    # an llm_request lacking vLLM markers is still nobody's GenAI span
    assert genai.normalise(make_span("llm_request", attributes={"gen_ai.system": "x",
                                                                "gen_ai.request.model": "m"})) is None
