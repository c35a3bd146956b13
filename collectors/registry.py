"""Picks the one convention that owns a span and lets it say whether the span is an LLM call.

``normalise_span`` runs on every ingested span, so it first decides *ownership*
with a handful of dict/set lookups on names the conventions write (no loops over
attributes, no regexes, no parsing) and only then calls the owning normaliser.
Non-LLM spans (HTTP, DB, framework spans) own no marker and cost one string
comparison, one set lookup and about ten dict lookups.

Priority, most specific first; a span owned by an earlier convention is never
offered to a later one, so no span is claimed twice:

1. vLLM — span name ``llm_request`` plus a vLLM/simulator marker
   (``gen_ai.latency.e2e``, resource ``vllm.instrumenting_module_name`` or
   ``llm_observatory.simulated``). It also carries ``gen_ai.usage.*`` and
   ``gen_ai.request.*``, so the generic GenAI reader must never see it.
2. LiteLLM — its span names (``Received Proxy Server Request``, ``litellm_request``,
   ``raw_gen_ai_request``, …), scope ``litellm``, ``litellm.call_id`` or
   ``hidden_params``. LiteLLM's v1 callback writes OpenLLMetry's ``llm.request.type``
   and ``llm.is_streaming`` plus ``gen_ai.*``, and its Arize logger writes OpenInference
   attributes, so it must come before all three; it alone decides which of its spans
   is the gateway hop (see ``collectors.litellm``).
3. OpenInference — ``openinference.span.kind`` is unique to it; it goes before
   OpenLLMetry and GenAI because some OpenInference instrumentations also copy
   ``gen_ai.*`` attributes.
4. OpenLLMetry — ``llm.request.type``, ``llm.is_streaming``, ``gen_ai.is_streaming``,
   ``llm.usage.total_tokens`` or ``traceloop.span.kind``; its LLM spans also carry the
   standard ``gen_ai.*`` attributes, so it goes before plain GenAI.
5. Plain OTel GenAI — ``gen_ai.operation.name``, ``gen_ai.provider.name`` or
   ``gen_ai.system``: the catch-all for any instrumentation that follows the spec.

An owned span that is not an LLM call (a workflow, tool, embedding, retrieval or
raw-payload span) yields None; it is not offered to the next convention.
Each module's own ``normalise`` applies the same ownership rule, so calling any of
them directly agrees with this function.
"""
from __future__ import annotations

from collectors import genai, litellm, openinference, openllmetry, vllm
from collectors.base import LLMCall, SpanView

CONVENTIONS = (vllm, litellm, openinference, openllmetry, genai)

_VLLM_SPAN_NAME = vllm.SPAN_NAME
_LITELLM_SPAN_NAMES = litellm.SPAN_NAMES
_LITELLM_SCOPE_NAME = litellm.SCOPE_NAME
_vllm_owns = vllm.owns
_vllm_normalise = vllm.normalise_owned
_litellm_normalise = litellm.normalise_owned
_openinference_normalise = openinference.normalise_owned
_openllmetry_normalise = openllmetry.normalise_owned
_genai_normalise = genai.normalise_owned


def normalise_span(span: SpanView) -> LLMCall | None:
    """The canonical LLM call a span describes, or None when it describes none."""
    name = span.name
    attrs = span.attributes
    # The checks below inline each module's ``owns`` in priority order (kept in step by
    # tests/collectors/test_collectors_registry.py) to save five function calls per span.
    if name == _VLLM_SPAN_NAME and _vllm_owns(span):
        return _vllm_normalise(span)
    if (
        name in _LITELLM_SPAN_NAMES
        or span.scope_name == _LITELLM_SCOPE_NAME
        or "litellm.call_id" in attrs
        or "hidden_params" in attrs
    ):
        return _litellm_normalise(span)
    if "openinference.span.kind" in attrs:
        return _openinference_normalise(span)
    if (
        "llm.request.type" in attrs
        or "llm.is_streaming" in attrs
        or "gen_ai.is_streaming" in attrs
        or "llm.usage.total_tokens" in attrs
        or "traceloop.span.kind" in attrs
    ):
        return _openllmetry_normalise(span)
    if (
        "gen_ai.operation.name" in attrs or "gen_ai.provider.name" in attrs or "gen_ai.system" in attrs
    ) and name != _VLLM_SPAN_NAME:
        return _genai_normalise(span)
    return None
