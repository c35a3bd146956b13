"""Normalises OpenLLMetry (Traceloop) LLM spans into CLIENT calls.

Sources: traceloop/openllmetry, ``packages/opentelemetry-semantic-conventions-ai``
(``opentelemetry/semconv_ai/__init__.py`` up to v0.4.x, its ``MIGRATION.md`` and
``_testing.py`` for v0.5.x) and ``opentelemetry-instrumentation-openai``
(``shared/chat_wrappers.py``, ``v1/responses_wrappers.py``: ``ChatStream._process_item``).

Two generations of names are in the wild:

===========================  ===============================  ==================================
what                         semconv-ai <= 0.4.x              semconv-ai >= 0.5 (OTel-aligned)
===========================  ===============================  ==================================
request type                 ``llm.request.type`` chat|...    ``gen_ai.operation.name``
streaming flag (bool)        ``llm.is_streaming``             ``gen_ai.is_streaming``
total tokens                 ``llm.usage.total_tokens``       ``gen_ai.usage.total_tokens``
one event per stream chunk   ``llm.content.completion.chunk`` ``gen_ai.content.completion.chunk``
cached prompt tokens         ``gen_ai.usage.cache_read_input_tokens`` ``gen_ai.usage.cache_read.input_tokens``
===========================  ===============================  ==================================

(semconv-ai's ``MIGRATION.md``: ``GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS`` changed its string value in 0.5; both
are read, the newer first, and a count above the prompt count is dropped.)

Both carry ``gen_ai.system`` (``gen_ai.provider.name`` in the new one),
``gen_ai.request.model``, ``gen_ai.response.model``, ``gen_ai.response.id`` and the
tokens as ``gen_ai.usage.prompt_tokens``/``completion_tokens`` (older) or
``gen_ai.usage.input_tokens``/``output_tokens``. LLM spans are kind CLIENT, named
``openai.chat`` (older) or ``chat <model>`` (newer).

Time to first token: OpenLLMetry records ``llm.openai.chat_completions.streaming_time_to_first_token``
only as a *metric*; on the span, the streaming wrappers add one chunk event per
received chunk, so TTFT is the first chunk event's time minus the span start.

Spans made by the Traceloop SDK decorators (``traceloop.span.kind`` = workflow, task,
agent, tool) and LLM spans of other request types (embedding, rerank, unknown) give None.
"""
from __future__ import annotations

from collectors import litellm, openinference, vllm
from collectors.attrs import (
    as_text,
    cached_count,
    first_count,
    first_event_offset_ms,
    first_flag,
    first_text,
    hop_call,
)
from collectors.base import LLMCall, Role, SpanView

CONVENTION = "openllmetry"
CHUNK_EVENTS = frozenset({"llm.content.completion.chunk", "gen_ai.content.completion.chunk"})

_LEGACY_REQUEST_TYPES = frozenset({"chat", "completion"})
_GENERATION_OPERATIONS = frozenset({"chat", "text_completion", "generate_content", "completion"})
_MODEL_KEYS = ("gen_ai.response.model", "gen_ai.request.model")
_PROMPT_KEYS = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens")
_COMPLETION_KEYS = ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens")
CACHED_KEYS = ("gen_ai.usage.cache_read.input_tokens", "gen_ai.usage.cache_read_input_tokens")


def owns(span: SpanView) -> bool:
    """Carries an attribute only OpenLLMetry writes (LiteLLM v1 copies some, so LiteLLM is asked first)."""
    attrs = span.attributes
    return (
        "llm.request.type" in attrs
        or "llm.is_streaming" in attrs
        or "gen_ai.is_streaming" in attrs
        or "llm.usage.total_tokens" in attrs
        or "traceloop.span.kind" in attrs
    )


def normalise(span: SpanView) -> LLMCall | None:
    if not owns(span) or vllm.owns(span) or litellm.owns(span) or openinference.owns(span):
        return None
    return normalise_owned(span)


def normalise_owned(span: SpanView) -> LLMCall | None:
    """The CLIENT call of an OpenLLMetry span, or None for decorator spans and non-generation requests."""
    attrs = span.attributes
    if "traceloop.span.kind" in attrs:
        return None
    request_type = as_text(attrs.get("llm.request.type"))
    if request_type is not None:
        if request_type not in _LEGACY_REQUEST_TYPES:
            return None
    elif as_text(attrs.get("gen_ai.operation.name")) not in _GENERATION_OPERATIONS:
        return None

    streaming = first_flag(attrs, ("llm.is_streaming", "gen_ai.is_streaming"))
    ttft_ms = first_event_offset_ms(span, CHUNK_EVENTS)
    if streaming is None and ttft_ms is not None:
        streaming = True

    prompt_tokens = first_count(attrs, _PROMPT_KEYS)
    return hop_call(
        span, Role.CLIENT, CONVENTION, model=first_text(attrs, _MODEL_KEYS), request_id=as_text(attrs.get("gen_ai.response.id")),
        prompt_tokens=prompt_tokens, completion_tokens=first_count(attrs, _COMPLETION_KEYS),
        streaming=streaming, ttft_ms=ttft_ms, cached_prompt_tokens=cached_count(attrs, CACHED_KEYS, prompt_tokens),
    )
