"""Normalises vLLM's per-request ``llm_request`` span (and the simulator's copy of it) into an ENGINE call.

Source of the names: vllm-project/vllm main (the v0.3x line docs/engine.md names),
``vllm/tracing/utils.py`` (``SpanAttributes``),
``vllm/tracing/otel.py`` (resource: ``vllm.instrumenting_module_name``,
``vllm.process_id`` as a string) and ``OutputProcessor.do_tracing`` in
``vllm/v1/engine/output_processor.py``: one span named ``llm_request``, kind SERVER,
started at the request's arrival time, parented on the incoming ``traceparent``.
Its latencies are float seconds:

    gen_ai.latency.time_in_queue          scheduled_ts - queued_ts        -> queue_ms
    gen_ai.latency.time_in_model_prefill  first_token_ts - scheduled_ts   -> prefill_ms
    gen_ai.latency.time_in_model_decode   last_token_ts - first_token_ts  -> decode_ms
    gen_ai.latency.time_in_model_inference last_token_ts - scheduled_ts   -> inference_ms
    gen_ai.latency.e2e                    finish - arrival                -> engine_e2e_ms
    gen_ai.latency.time_to_first_token    first token - arrival           -> ttft_ms

plus ``gen_ai.usage.{prompt_tokens,completion_tokens}``, ``gen_ai.request.id`` (the
external request id, e.g. ``chatcmpl-…``), ``gen_ai.request.{max_tokens,temperature,
top_p,n}`` (each only when set) and, in the versions that set it,
``gen_ai.response.model``. vLLM never says whether the request streamed.

Cached prompt tokens (prefix-cache hits): the GenAI convention's ``gen_ai.usage.cache_read.input_tokens``
(what the platform's simulator writes), else ``gen_ai.usage.cached_tokens``
(``SpanAttributes.GEN_AI_USAGE_CACHED_TOKENS`` of later vLLM mains). vLLM 0.32's span carries no cached-token
attribute (its ``tracing/utils.py`` and ``do_tracing``): its prefix-cache hits reach the row through the
gateway's span. A count above the prompt count is dropped (``collectors.attrs.cached_count``).

vLLM 0.32 does not set ``gen_ai.response.model`` (measured on a real run), so the model
falls back to the resource attribute ``llm_observatory.model``, which the platform's
launcher puts in ``OTEL_RESOURCE_ATTRIBUTES`` (the served model name); teams running
their own vLLM set it the same way. Without either, the request row takes the model
from the gateway or client hop (traces/decomposition.py).

The platform's engine simulator emits the same span plus the resource attribute
``llm_observatory.simulated=true``; it is accepted on equal terms.
"""
from __future__ import annotations

from collectors.attrs import (
    as_count,
    as_text,
    cached_within,
    engine_config_of,
    is_error,
    model_resource_of,
    replica_group_of,
    seconds_as_ms,
)
from collectors.base import LLMCall, Role, SpanView

CONVENTION = "vllm"
SPAN_NAME = "llm_request"


def owns(span: SpanView) -> bool:
    """An ``llm_request`` span from vLLM or the simulator (name first, then at most three lookups)."""
    if span.name != SPAN_NAME:
        return False
    return (
        "gen_ai.latency.e2e" in span.attributes
        or "vllm.instrumenting_module_name" in span.resource
        or "llm_observatory.simulated" in span.resource
    )


def normalise(span: SpanView) -> LLMCall | None:
    return normalise_owned(span) if owns(span) else None


def normalise_owned(span: SpanView) -> LLMCall:
    """Build the ENGINE call of a span already known to be a vLLM ``llm_request``."""
    attrs = span.attributes
    prompt_tokens = as_count(attrs.get("gen_ai.usage.prompt_tokens"))
    if prompt_tokens is None:
        prompt_tokens = as_count(attrs.get("gen_ai.usage.input_tokens"))
    completion_tokens = as_count(attrs.get("gen_ai.usage.completion_tokens"))
    if completion_tokens is None:
        completion_tokens = as_count(attrs.get("gen_ai.usage.output_tokens"))
    cached = attrs.get("gen_ai.usage.cache_read.input_tokens")
    if cached is None:
        cached = attrs.get("gen_ai.usage.cached_tokens")
    if cached is not None:
        cached = cached_within(cached, prompt_tokens)
    # Positional, in LLMCall's field order: this runs for every engine span ingested, and 22
    # keyword arguments cost ~0.7 µs more than positions (tests/collectors check every field).
    return LLMCall(
        span.trace_id,
        span.span_id,
        span.parent_span_id,
        Role.ENGINE,
        CONVENTION,
        span.service,
        span.name,
        span.start_ns,
        span.end_ns,
        as_text(attrs.get("gen_ai.response.model")) or model_resource_of(span),  # model
        as_text(attrs.get("gen_ai.request.id")),  # request_id
        prompt_tokens,
        completion_tokens,
        None,  # streaming: vLLM never says
        is_error(span),
        seconds_as_ms(attrs.get("gen_ai.latency.time_to_first_token")),  # ttft_ms
        seconds_as_ms(attrs.get("gen_ai.latency.e2e")),  # engine_e2e_ms
        seconds_as_ms(attrs.get("gen_ai.latency.time_in_queue")),  # queue_ms
        seconds_as_ms(attrs.get("gen_ai.latency.time_in_model_prefill")),  # prefill_ms
        seconds_as_ms(attrs.get("gen_ai.latency.time_in_model_decode")),  # decode_ms
        seconds_as_ms(attrs.get("gen_ai.latency.time_in_model_inference")),  # inference_ms
        engine_config_of(span),
        replica_group_of(span),
        cached,  # cached_prompt_tokens
    )
