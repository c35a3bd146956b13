"""vLLM llm_request spans (and the simulator's) become ENGINE calls with the latency breakdown in ms."""
import pytest

from collectors import vllm
from collectors.base import SPAN_KIND_INTERNAL, STATUS_ERROR, Role


def test_typical_llm_request(payloads):
    span = payloads.vllm_span()
    call = vllm.normalise(span)

    assert call is not None
    assert call.role is Role.ENGINE
    assert call.convention == "vllm"
    assert call.service == "vllm-llama-8b"
    assert call.name == "llm_request"
    assert (call.trace_id, call.span_id) == (span.trace_id, span.span_id)
    assert call.parent_span_id == "b7ad6b7169203331"
    assert (call.start_ns, call.end_ns) == (span.start_ns, span.end_ns)
    assert call.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert call.request_id == "chatcmpl-9f2c6c1e5b6e4a3f8d0a1b2c3d4e5f60"
    assert (call.prompt_tokens, call.completion_tokens) == (512, 128)
    assert call.ttft_ms == pytest.approx(84.2)
    assert call.engine_e2e_ms == pytest.approx(1903.1)
    assert call.queue_ms == pytest.approx(12.1)
    assert call.prefill_ms == pytest.approx(70.3)
    assert call.decode_ms == pytest.approx(1801.2)
    assert call.inference_ms == pytest.approx(1871.5)
    assert call.streaming is None  # vLLM does not say
    assert call.is_error is False
    assert call.engine_config is None
    assert call.replica_group is None


def test_simulator_span_is_accepted_with_its_engine_config(payloads):
    span = payloads.vllm_span(resource={
        "service.name": "engine-sim-0",
        "llm_observatory.simulated": True,
        "llm_observatory.engine_config": "cfg-7f3a",
        "llm_observatory.replica_group": "canary",
    })
    call = vllm.normalise(span)
    assert call is not None
    assert call.role is Role.ENGINE
    assert call.service == "engine-sim-0"
    assert call.engine_config == "cfg-7f3a"
    assert call.replica_group == "canary"
    assert call.prefill_ms == pytest.approx(70.3)


def test_engine_config_from_span_attribute(payloads):
    attributes = {**payloads.VLLM_ATTRIBUTES, "llm_observatory.engine_config": "cfg-b"}
    span = payloads.vllm_span(attributes=attributes)
    assert vllm.normalise(span).engine_config == "cfg-b"


def test_missing_optional_attributes_are_none_not_zero(payloads):
    # An aborted request: no first token, so vLLM's timestamps for prefill/decode are missing.
    span = payloads.vllm_span(attributes={
        "gen_ai.latency.e2e": 0.5,
        "gen_ai.latency.time_in_queue": 0.5,
        "gen_ai.usage.prompt_tokens": 40,
        "gen_ai.request.id": "cmpl-1",
    })
    call = vllm.normalise(span)
    assert call is not None
    assert call.engine_e2e_ms == pytest.approx(500.0)
    assert call.queue_ms == pytest.approx(500.0)
    for field in ("prefill_ms", "decode_ms", "inference_ms", "ttft_ms", "completion_tokens", "model"):
        assert getattr(call, field) is None, field


def test_numbers_as_strings_are_coerced(payloads):
    span = payloads.vllm_span(attributes={
        "gen_ai.latency.e2e": "1.25",
        "gen_ai.latency.time_in_queue": "0.01",
        "gen_ai.usage.prompt_tokens": "512",
        "gen_ai.usage.completion_tokens": 128.0,
    })
    call = vllm.normalise(span)
    assert call.engine_e2e_ms == pytest.approx(1250.0)
    assert call.queue_ms == pytest.approx(10.0)
    assert (call.prompt_tokens, call.completion_tokens) == (512, 128)


def test_junk_values_become_none_without_raising(payloads):
    span = payloads.vllm_span(attributes={
        "gen_ai.latency.e2e": "fast",
        "gen_ai.latency.time_in_queue": -0.002,
        "gen_ai.latency.time_in_model_prefill": float("nan"),
        "gen_ai.latency.time_in_model_decode": True,
        "gen_ai.latency.time_in_model_inference": [1.0],
        "gen_ai.latency.time_to_first_token": None,
        "gen_ai.usage.prompt_tokens": -5,
        "gen_ai.usage.completion_tokens": 12.5,
        "gen_ai.request.id": {"id": 1},
        "gen_ai.response.model": "",
    })
    call = vllm.normalise(span)
    assert call is not None
    for field in ("engine_e2e_ms", "queue_ms", "prefill_ms", "decode_ms", "inference_ms", "ttft_ms",
                  "prompt_tokens", "completion_tokens", "request_id", "model"):
        assert getattr(call, field) is None, field


def test_error_status(payloads):
    assert vllm.normalise(payloads.vllm_span(status_code=STATUS_ERROR)).is_error is True


def test_other_spans_are_not_vllm(make_span, payloads):
    assert vllm.normalise(make_span("load_weights", resource=payloads.VLLM_RESOURCE)) is None
    assert vllm.normalise(make_span("llm_request", attributes={"gen_ai.usage.prompt_tokens": 3})) is None
    assert vllm.normalise(make_span("chat gpt-4o", attributes=payloads.GENAI_CHAT_ATTRIBUTES)) is None


def test_span_kind_does_not_matter(payloads):
    assert vllm.normalise(payloads.vllm_span(kind=SPAN_KIND_INTERNAL)) is not None


def test_vllm_032_span_takes_the_model_from_the_resource(payloads):
    """vLLM 0.32 leaves gen_ai.response.model out (and temperature when 0): the launcher's resource names it."""
    attributes = {k: v for k, v in payloads.VLLM_ATTRIBUTES.items()
                  if k not in ("gen_ai.response.model", "gen_ai.request.temperature")}
    resource = {**payloads.VLLM_RESOURCE, "llm_observatory.model": "tiny-llama"}
    call = vllm.normalise(payloads.vllm_span(attributes=attributes, resource=resource))
    assert call is not None and call.model == "tiny-llama"
    assert call.queue_ms is not None and call.decode_ms is not None
    # Neither: no model (the decomposition then takes the gateway's or the client's).
    assert vllm.normalise(payloads.vllm_span(attributes=attributes)).model is None
    # The span's own attribute, where a vLLM version sets it, wins over the resource.
    both = vllm.normalise(payloads.vllm_span(resource=resource))
    assert both.model == payloads.VLLM_ATTRIBUTES["gen_ai.response.model"]
