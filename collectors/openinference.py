"""Normalises OpenInference (Arize Phoenix) LLM spans into CLIENT calls.

Sources: Arize-ai/openinference,
``python/openinference-semantic-conventions/src/openinference/semconv/trace/__init__.py``
(``SpanAttributes``, ``OpenInferenceSpanKindValues``) and the OpenAI instrumentor
(``openinference-instrumentation-openai``: ``_request.py``,
``_request_attributes_extractor.py``, ``_stream.py``).

* Only ``openinference.span.kind == "LLM"`` is an LLM call; CHAIN, AGENT, TOOL,
  RETRIEVER, EMBEDDING, RERANKER, GUARDRAIL, EVALUATOR, PROMPT, UNKNOWN give None.
  Instrumentors start these spans with the default kind (INTERNAL) and names such as
  ``ChatCompletion``; the role is CLIENT whatever the kind.
* Model: ``llm.response.model_name`` (newer), else ``llm.model_name``, else
  ``llm.request.model_name``. Tokens: ``llm.token_count.prompt`` /
  ``llm.token_count.completion``; when only the total is reported the completion
  count is ``llm.token_count.total - llm.token_count.prompt``.
* Streaming: the instrumentations set no streaming attribute. The request's
  parameters (minus messages/tools) are in ``llm.invocation_parameters`` as a JSON
  string, which holds ``"stream": true`` when the caller streamed; a
  ``First Token Stream Event`` also proves streaming.
* Cached prompt tokens: ``llm.token_count.prompt_details.cache_read`` (dropped when above the prompt count).
* Time to first token: the span event ``First Token Stream Event`` (no attributes,
  stamped when the first chunk arrived) minus the span start.
* No response id attribute exists. ``request_id`` is the ``id`` of the response JSON the instrumentor records
  as ``output.value`` (``output.mime_type`` ``application/json``; for a stream, the accumulated response),
  read only when that value is at most ``MAX_OUTPUT_SCAN`` characters; else None. It is what joins the
  client's span to the engine's when no traceparent was passed on (traces/joins.py).
"""
from __future__ import annotations

import json

from collectors import litellm, vllm
from collectors.attrs import (
    as_count,
    as_flag,
    cached_count,
    first_event_offset_ms,
    first_text,
    hop_call,
)
from collectors.base import LLMCall, Role, SpanView

CONVENTION = "openinference"
SPAN_KIND_KEY = "openinference.span.kind"
FIRST_TOKEN_EVENTS = frozenset({"First Token Stream Event"})

_MODEL_KEYS = ("llm.response.model_name", "llm.model_name", "llm.request.model_name")
CACHED_KEYS = ("llm.token_count.prompt_details.cache_read",)
MAX_OUTPUT_SCAN = 256 * 1024


def owns(span: SpanView) -> bool:
    return SPAN_KIND_KEY in span.attributes


def normalise(span: SpanView) -> LLMCall | None:
    if not owns(span) or vllm.owns(span) or litellm.owns(span):
        return None
    return normalise_owned(span)


def normalise_owned(span: SpanView) -> LLMCall | None:
    """The CLIENT call of an OpenInference span, or None unless its span kind is LLM."""
    attrs = span.attributes
    kind = attrs.get(SPAN_KIND_KEY)
    if not isinstance(kind, str) or kind.upper() != "LLM":
        return None

    prompt_tokens = as_count(attrs.get("llm.token_count.prompt"))
    completion_tokens = as_count(attrs.get("llm.token_count.completion"))
    if completion_tokens is None and prompt_tokens is not None:
        total_tokens = as_count(attrs.get("llm.token_count.total"))
        if total_tokens is not None and total_tokens >= prompt_tokens:
            completion_tokens = total_tokens - prompt_tokens

    ttft_ms = first_event_offset_ms(span, FIRST_TOKEN_EVENTS)
    streaming = True if ttft_ms is not None else _stream_parameter(attrs.get("llm.invocation_parameters"))

    return hop_call(
        span, Role.CLIENT, CONVENTION, model=first_text(attrs, _MODEL_KEYS), request_id=_response_id(attrs),
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        streaming=streaming, ttft_ms=ttft_ms, cached_prompt_tokens=cached_count(attrs, CACHED_KEYS, prompt_tokens),
    )


def _response_id(attrs: dict) -> str | None:
    """The ``id`` of the JSON response in ``output.value``, when it is one and not too large to read."""
    value = attrs.get("output.value")
    if not isinstance(value, str) or attrs.get("output.mime_type") != "application/json":
        return None
    if len(value) > MAX_OUTPUT_SCAN or not value.startswith("{"):
        return None
    try:
        document = json.loads(value)
    except ValueError:
        return None
    found = document.get("id") if isinstance(document, dict) else None
    return found if isinstance(found, str) and 0 < len(found) <= 256 else None


def _stream_parameter(invocation_parameters: object) -> bool | None:
    """The ``stream`` flag of the JSON invocation parameters, None when absent or unreadable."""
    if not isinstance(invocation_parameters, str) or '"stream"' not in invocation_parameters:
        return None
    try:
        parameters = json.loads(invocation_parameters)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parameters, dict):
        return None
    return as_flag(parameters.get("stream"))
