"""Normalises vLLM's per-request ``llm_request`` span (and the simulator's copy of it) into an ENGINE call.

Source of the names: vllm-project/vllm main (the v0.3x line DESIGN.md cites),
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

The platform's engine simulator emits the same span plus the resource attribute
``llm_observatory.simulated=true``; it is accepted on equal terms.
"""
from __future__ import annotations

from collectors.attrs import as_count, as_text, engine_config_of, is_error, seconds_as_ms
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
    return LLMCall(
        trace_id=span.trace_id,
        span_id=span.span_id,
        parent_span_id=span.parent_span_id,
        role=Role.ENGINE,
        convention=CONVENTION,
        service=span.service,
        name=span.name,
        start_ns=span.start_ns,
        end_ns=span.end_ns,
        model=as_text(attrs.get("gen_ai.response.model")),
        request_id=as_text(attrs.get("gen_ai.request.id")),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        streaming=None,
        is_error=is_error(span),
        ttft_ms=seconds_as_ms(attrs.get("gen_ai.latency.time_to_first_token")),
        engine_e2e_ms=seconds_as_ms(attrs.get("gen_ai.latency.e2e")),
        queue_ms=seconds_as_ms(attrs.get("gen_ai.latency.time_in_queue")),
        prefill_ms=seconds_as_ms(attrs.get("gen_ai.latency.time_in_model_prefill")),
        decode_ms=seconds_as_ms(attrs.get("gen_ai.latency.time_in_model_decode")),
        inference_ms=seconds_as_ms(attrs.get("gen_ai.latency.time_in_model_inference")),
        engine_config=engine_config_of(span),
    )
