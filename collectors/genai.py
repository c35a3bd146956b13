"""Normalises spans that follow the plain OpenTelemetry GenAI semantic conventions.

Sources: open-telemetry/semantic-conventions ``docs/gen-ai/gen-ai-spans.md`` (v1.27–v1.37)
and open-telemetry/semantic-conventions-genai ``docs/gen-ai/client-inference.md``
(where the GenAI conventions moved), cross-checked against the generated
``opentelemetry.semconv._incubating.attributes.gen_ai_attributes`` (0.5xb).

* Inference spans carry ``gen_ai.operation.name`` = ``chat`` | ``text_completion`` |
  ``generate_content``; other operations (``embeddings``, ``retrieval``,
  ``execute_tool``, ``create_agent``, ``invoke_agent``, …) give None. Spans from
  instrumentations older than v1.27 have no operation name; they count when they
  carry ``gen_ai.system`` and a model.
* Provider: ``gen_ai.provider.name`` (current) or ``gen_ai.system`` (deprecated).
  Model: ``gen_ai.response.model``, else ``gen_ai.request.model``.
  Tokens: ``gen_ai.usage.input_tokens``/``output_tokens``, else the deprecated
  ``gen_ai.usage.prompt_tokens``/``completion_tokens``.
  ``request_id``: ``gen_ai.response.id`` (for OpenAI-compatible servers such as vLLM
  this is the id the engine logs as ``gen_ai.request.id``).
* Time to first token: the span attribute the spec defines is
  ``gen_ai.response.time_to_first_chunk`` (double, seconds, streaming only).
  ``gen_ai.server.time_to_first_token`` is a *metric* name in the spec; OpenLIT
  nevertheless writes it (and the older ``gen_ai.server.ttft``) as a span attribute
  in seconds, so both are read as fallbacks.
* Streaming: ``gen_ai.request.stream``; a time to first chunk implies True.
* Cached prompt tokens: ``gen_ai.usage.cache_read.input_tokens`` (the convention since v1.37), else
  ``gen_ai.usage.cache_read_input_tokens`` (the spelling of OpenLLMetry's semconv-ai <= 0.4, copied by
  others); dropped when above the prompt count (``collectors.attrs.cached_count``).
* The platform gateway's response cache (its SERVER span): ``observatory.cache.served_from``
  (``exact_cache`` | ``semantic_cache`` on a hit) and ``observatory.cache.lookup_ms``.
* Errors: span status ERROR, or ``error.type`` set (required on failure by the spec).
* Role: span kind CLIENT (or INTERNAL, allowed for in-process models) → CLIENT;
  kind SERVER → GATEWAY, a GenAI server span being a proxy/front that serves the call.

Spans of the more specific conventions (vLLM ``llm_request``, LiteLLM, OpenInference,
OpenLLMetry), which also carry ``gen_ai.*`` attributes, belong to their own normalisers.
"""
from __future__ import annotations

from collectors import litellm, openinference, openllmetry, vllm
from collectors.attrs import (
    CACHE_LOOKUP_MS_ATTRIBUTE,
    CACHE_SERVED_FROM_ATTRIBUTE,
    as_flag,
    as_text,
    cached_within,
    engine_config_of,
    first_count,
    first_text,
    is_error,
    lookup_ms_of,
    replica_group_of,
    seconds_as_ms,
    served_from_of,
)
from collectors.base import SPAN_KIND_SERVER, LLMCall, Role, SpanView

CONVENTION = "genai"

_GENERATION_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})
_MODEL_KEYS = ("gen_ai.response.model", "gen_ai.request.model")
_PROMPT_KEYS = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens")
_COMPLETION_KEYS = ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens")
_TTFT_KEYS = (
    "gen_ai.response.time_to_first_chunk",
    "gen_ai.server.time_to_first_token",
    "gen_ai.server.ttft",
)


def owns(span: SpanView) -> bool:
    """Carries one of the identifying GenAI attributes (and is not vLLM's own span)."""
    attrs = span.attributes
    return (
        "gen_ai.operation.name" in attrs or "gen_ai.provider.name" in attrs or "gen_ai.system" in attrs
    ) and span.name != vllm.SPAN_NAME


def normalise(span: SpanView) -> LLMCall | None:
    if (
        not owns(span)
        or vllm.owns(span)
        or litellm.owns(span)
        or openinference.owns(span)
        or openllmetry.owns(span)
    ):
        return None
    return normalise_owned(span)


def normalise_owned(span: SpanView) -> LLMCall | None:
    """The CLIENT/GATEWAY call of a GenAI span, or None when its operation does not generate text."""
    attrs = span.attributes
    if "gen_ai.operation.name" in attrs:
        if as_text(attrs.get("gen_ai.operation.name")) not in _GENERATION_OPERATIONS:
            return None
        model = first_text(attrs, _MODEL_KEYS)
    else:
        model = first_text(attrs, _MODEL_KEYS)
        if model is None:
            return None

    ttft_ms = None
    for key in _TTFT_KEYS:
        ttft_ms = seconds_as_ms(attrs.get(key))
        if ttft_ms is not None:
            break
    streaming = as_flag(attrs.get("gen_ai.request.stream"))
    if streaming is None and ttft_ms is not None:
        streaming = True

    prompt_tokens = first_count(attrs, _PROMPT_KEYS)
    cached = attrs.get("gen_ai.usage.cache_read.input_tokens")
    if cached is None:
        cached = attrs.get("gen_ai.usage.cache_read_input_tokens")
    if cached is not None:
        cached = cached_within(cached, prompt_tokens)
    # The response-cache attributes are on the platform gateway's spans only: one dict lookup each when absent.
    served_from = lookup_ms = None
    if CACHE_SERVED_FROM_ATTRIBUTE in attrs:
        served_from = served_from_of(attrs)
    if CACHE_LOOKUP_MS_ATTRIBUTE in attrs:
        lookup_ms = lookup_ms_of(attrs)
    # Positional, in LLMCall's field order: this runs for every GenAI span ingested, and keyword
    # arguments cost ~0.7 µs more than positions (tests/collectors check every field).
    return LLMCall(
        span.trace_id,
        span.span_id,
        span.parent_span_id,
        Role.GATEWAY if span.kind == SPAN_KIND_SERVER else Role.CLIENT,
        CONVENTION,
        span.service,
        span.name,
        span.start_ns,
        span.end_ns,
        model,
        as_text(attrs.get("gen_ai.response.id")),  # request_id
        prompt_tokens,
        first_count(attrs, _COMPLETION_KEYS),
        streaming,
        is_error(span),
        ttft_ms,
        None,  # engine_e2e_ms
        None,  # queue_ms
        None,  # prefill_ms
        None,  # decode_ms
        None,  # inference_ms
        engine_config_of(span),
        replica_group_of(span),
        cached,  # cached_prompt_tokens
        served_from,
        lookup_ms,
    )
