"""Normalises LiteLLM proxy spans into exactly one GATEWAY call per proxied LLM request.

Sources: BerriAI/litellm ``litellm/integrations/opentelemetry.py`` (the callback
behind ``callbacks: ["otel"]``, 2024–2026 versions), ``litellm/proxy/_types.py``
(``SpanAttributes``) and, for the opt-in rewrite enabled by ``LITELLM_OTEL_V2``,
``litellm/integrations/otel/`` (``model/semconv.py``, ``README.md``).

What LiteLLM emits (tracer/scope name ``litellm`` unless ``OTEL_TRACER_NAME`` says otherwise):

* ``Received Proxy Server Request`` — opened by ``create_litellm_proxy_request_started_span``
  when the request reaches the proxy's auth step, parented on the caller's
  ``traceparent``, ended when the LLM call ends. Kind SERVER (INTERNAL in releases
  before LiteLLM issue #7298 was fixed). Created once per proxied HTTP request.
* ``litellm_request`` (renamed to the ``generation_name`` metadata when given) — the
  LiteLLM SDK call, INTERNAL, child of the proxy span.
* ``raw_gen_ai_request`` — provider payload as ``llm.<provider>.<field>``; no timing value.
* ``Failed Proxy Server Request``, ``guardrail``, and service/management spans.

Which span carries the per-call attributes (``gen_ai.request.model``,
``llm.request.type`` = call type, ``gen_ai.system``, ``llm.is_streaming`` as the
*string* ``"True"``/``"False"``, ``gen_ai.usage.input_tokens``/``output_tokens`` —
``prompt_tokens``/``completion_tokens`` in older releases — ``gen_ai.response.id``,
``gen_ai.request.id``, ``metadata.*``, ``hidden_params``) has changed between releases:
only ``litellm_request`` (2024 releases, and again since the May-2026 proxy tracing
fix), only the proxy span (the "shallow hierarchy" releases, default settings), or
both (``USE_OTEL_LITELLM_REQUEST_SPAN=true`` on some releases, and the Arize/Phoenix
logger, which writes OpenInference names). No release puts a time to first token on
a span (LiteLLM records it only as a metric).

Decision. The gateway hop is the ``Received Proxy Server Request`` span, always:
it is the one span every release creates exactly once per proxied request, and it
covers what a gateway hop should (auth, routing, pre-call hooks, the upstream
call), while ``litellm_request`` starts only when the SDK call starts. Its model,
tokens, streaming flag and ids are read from its own attributes when the release
wrote them there, and are None otherwise — in those releases the engine and client
hops of the same trace still carry them. ``litellm_request``, ``raw_gen_ai_request``
and every other LiteLLM span give None, so neither a release that annotates both
spans nor one that annotates only the child can produce a second gateway call.
A bare proxy span cannot be told apart from one of a non-LLM route, but in the
releases read LiteLLM ends (and so exports) it only from its LLM-call success/failure
hooks and its post-call failure hook; a request rejected before the LLM call is a
failed gateway call (``is_error``), which is what it was.
Consequence: LiteLLM used as an in-process SDK without the proxy yields no call from
LiteLLM's spans (instrument the application with a client convention instead).
Proxy spans whose ``llm.request.type`` names a non-generation call (embeddings,
images, audio, batches, files, …) give None; ``pass_through_endpoint`` counts as a
generation call (the usual pass-through target is a chat/completions route).

With ``LITELLM_OTEL_V2`` the proxy span is no longer created (the FastAPI server span
takes its place and carries nothing LLM-specific); the gateway hop is then the
LLM-call span (kind CLIENT, name ``"{operation} {model}"``) identified by
``litellm.call_id``, with ``gen_ai.response.time_to_first_chunk`` (seconds) as its
time to first token and ``litellm.request.streaming`` as its streaming flag.

Cached prompt tokens: the v1 callback writes none (only total, input and output tokens); v2 writes the GenAI
convention's ``gen_ai.usage.cache_read.input_tokens`` (``model/semconv.py``), its legacy mapper OpenLLMetry's
``gen_ai.usage.cache_read_input_tokens`` and the Arize logger OpenInference's
``llm.token_count.prompt_details.cache_read``. The first usable of the three is read; a count above the prompt
count is dropped. Calls
LiteLLM makes for its own purposes (``litellm.request.purpose`` set, e.g. the
auto-router's classifier) give None.
"""
from __future__ import annotations

from collectors import vllm
from collectors.attrs import (
    as_text,
    cached_count,
    first_count,
    first_flag,
    first_text,
    hop_call,
    seconds_as_ms,
)
from collectors.base import LLMCall, Role, SpanView

CONVENTION = "litellm"

PROXY_SPAN_NAME = "Received Proxy Server Request"
SPAN_NAMES = frozenset({
    PROXY_SPAN_NAME,
    "litellm_request",
    "raw_gen_ai_request",
    "Failed Proxy Server Request",
})
SCOPE_NAME = "litellm"
# v2 LLM-call spans carry this; v1 spans renamed via generation_name still carry hidden_params.
V2_CALL_ID = "litellm.call_id"
V1_HIDDEN_PARAMS = "hidden_params"

# LiteLLM CallTypes values that generate text (sync and async spellings).
_GENERATION_CALL_TYPES = frozenset({
    "completion", "acompletion",
    "text_completion", "atext_completion",
    "responses", "aresponses",
    "anthropic_messages",
    "generate_content", "agenerate_content",
    "generate_content_stream", "agenerate_content_stream",
    "pass_through_endpoint",
})
_GENERATION_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})
_NON_TEXT_OUTPUTS = frozenset({"image", "speech"})

_MODEL_KEYS = ("gen_ai.response.model", "gen_ai.request.model", "llm.model_name")
_PROMPT_KEYS = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens", "llm.token_count.prompt")
_COMPLETION_KEYS = (
    "gen_ai.usage.output_tokens",
    "gen_ai.usage.completion_tokens",
    "llm.token_count.completion",
)
CACHED_KEYS = (
    "gen_ai.usage.cache_read.input_tokens",
    "gen_ai.usage.cache_read_input_tokens",
    "llm.token_count.prompt_details.cache_read",
)


def owns(span: SpanView) -> bool:
    """Any span LiteLLM's tracer made (by span name, scope name or a LiteLLM-only attribute)."""
    attrs = span.attributes
    return (
        span.name in SPAN_NAMES
        or span.scope_name == SCOPE_NAME
        or V2_CALL_ID in attrs
        or V1_HIDDEN_PARAMS in attrs
    )


def normalise(span: SpanView) -> LLMCall | None:
    if not owns(span) or vllm.owns(span):
        return None
    return normalise_owned(span)


def normalise_owned(span: SpanView) -> LLMCall | None:
    """The GATEWAY call of a LiteLLM span, or None for every LiteLLM span that is not the gateway hop."""
    if span.name == PROXY_SPAN_NAME:
        return _from_proxy_span(span)
    if V2_CALL_ID in span.attributes:
        return _from_v2_llm_call_span(span)
    return None


def _from_proxy_span(span: SpanView) -> LLMCall | None:
    attrs = span.attributes
    call_type = as_text(attrs.get("llm.request.type"))
    if call_type is not None and call_type not in _GENERATION_CALL_TYPES:
        return None
    return _call(span, streaming=("llm.is_streaming", "gen_ai.request.stream"),
                 request_id=("gen_ai.response.id", "gen_ai.request.id"))


def _from_v2_llm_call_span(span: SpanView) -> LLMCall | None:
    attrs = span.attributes
    if "litellm.request.purpose" in attrs:
        return None
    if as_text(attrs.get("gen_ai.operation.name")) not in _GENERATION_OPERATIONS:
        return None
    if as_text(attrs.get("gen_ai.output.type")) in _NON_TEXT_OUTPUTS:
        return None
    return _call(span, streaming=("litellm.request.streaming", "gen_ai.request.stream"),
                 request_id=("gen_ai.response.id", V2_CALL_ID))


def _call(span: SpanView, *, streaming: tuple[str, ...], request_id: tuple[str, ...]) -> LLMCall:
    """The gateway hop of a LiteLLM span, its flag of streaming and its request id read from the first usable of
    these keys."""
    attrs = span.attributes
    prompt_tokens = first_count(attrs, _PROMPT_KEYS)
    return hop_call(
        span, Role.GATEWAY, CONVENTION, model=first_text(attrs, _MODEL_KEYS), request_id=first_text(attrs, request_id),
        prompt_tokens=prompt_tokens, completion_tokens=first_count(attrs, _COMPLETION_KEYS),
        streaming=first_flag(attrs, streaming), ttft_ms=seconds_as_ms(attrs.get("gen_ai.response.time_to_first_chunk")),
        cached_prompt_tokens=cached_count(attrs, CACHED_KEYS, prompt_tokens),
    )
