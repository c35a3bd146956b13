"""Total, typed reads of OTLP attribute values: a missing or malformed value becomes None, never an exception.

Instrumentations disagree on types (LiteLLM writes ``"True"`` for a bool, OTLP/JSON
carries 64-bit ints as strings, hand-rolled exporters send ``"12.5"``), so every
normaliser reads through these functions instead of trusting ``isinstance``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from collectors.base import SERVED_FROM, STATUS_ERROR, LLMCall, Role, SpanView

_TRUE_WORDS = frozenset({"true", "1", "yes"})
_FALSE_WORDS = frozenset({"false", "0", "no"})
# No LLM call has two billion tokens: a larger count is a corrupt value, not a measurement.
_MAX_COUNT = 2**31 - 1
T = TypeVar("T")


def as_float(value: Any) -> float | None:
    """A finite number from an int, float or numeric string; bools and everything else are None."""
    if value is None:  # the usual case for optional attributes; skip the type tests
        return None
    if value.__class__ is bool:
        return None
    if isinstance(value, float):
        number = value
    elif isinstance(value, (int, str)):
        try:
            number = float(value)  # float() strips surrounding whitespace itself
        except (ValueError, OverflowError):  # not a number / an int beyond float range
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def seconds_as_ms(value: Any) -> float | None:
    """A non-negative duration given in seconds, in milliseconds."""
    if value.__class__ is float:  # the usual case (vLLM's latencies), without as_float's type tests
        # NaN fails the comparison; +inf is not finite. Same answers as the general path below.
        return value * 1000.0 if 0.0 <= value < math.inf else None
    seconds = as_float(value)
    if seconds is None or seconds < 0:
        return None
    return seconds * 1000.0


def as_count(value: Any) -> int | None:
    """A whole number in [0, 2**31) (token counts); fractional, negative or absurd values are None."""
    if value.__class__ is int:  # the usual case first (bool is a subclass, not this class)
        return value if 0 <= value <= _MAX_COUNT else None
    if value is None:
        return None
    if value.__class__ is bool:
        return None
    if isinstance(value, int):
        return value if 0 <= value <= _MAX_COUNT else None
    number = as_float(value)
    if number is None or not 0 <= number <= _MAX_COUNT or not number.is_integer():
        return None
    return int(number)


def as_text(value: Any) -> str | None:
    """A non-blank string; integers (ids sent as numbers) are rendered, anything else is None."""
    if value is None:
        return None
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, int) and value.__class__ is not bool:
        return str(value)
    return None


def as_flag(value: Any) -> bool | None:
    """A bool from a bool, 0/1, or the words true/false/yes/no/1/0 in any case."""
    if value is None:
        return None
    if value.__class__ is bool:
        return value
    if value.__class__ is int:
        return True if value == 1 else False if value == 0 else None
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    return None


def _first(attributes: dict[str, Any], keys: tuple[str, ...], parse: Callable[[Any], T | None]) -> T | None:
    for key in keys:
        value = parse(attributes.get(key))
        if value is not None:
            return value
    return None


def first_text(attributes: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    """The first usable string among ``keys``, in order of preference."""
    return _first(attributes, keys, as_text)


def first_count(attributes: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    """The first usable count among ``keys``, in order of preference."""
    return _first(attributes, keys, as_count)


def first_flag(attributes: dict[str, Any], keys: tuple[str, ...]) -> bool | None:
    """The first usable flag among ``keys``, in order of preference."""
    return _first(attributes, keys, as_flag)


def cached_within(value: Any, prompt_tokens: int | None) -> int | None:
    """A cached-prompt-token count read from ``value``, or None.

    A count above the span's prompt count (when that is known) is DROPPED (None), not clamped: one of the two
    figures is wrong and clamping would invent a 100 % hit. The span row keeps the raw attribute either way."""
    cached = as_count(value)
    return cached if cached is None or prompt_tokens is None or cached <= prompt_tokens else None


def cached_count(attributes: dict[str, Any], keys: tuple[str, ...], prompt_tokens: int | None) -> int | None:
    """The cached prompt tokens a span reports: the first present, usable count among ``keys`` (cached_within).
    The per-span hot paths (vLLM, GenAI) read their keys inline instead."""
    return cached_within(first_count(attributes, keys), prompt_tokens)


# The platform gateway's response cache marks its SERVER span with these (engine/gateway).
CACHE_SERVED_FROM_ATTRIBUTE = "observatory.cache.served_from"
CACHE_LOOKUP_MS_ATTRIBUTE = "observatory.cache.lookup_ms"
SERVED_FROM_VALUES = frozenset(SERVED_FROM)
# A lookup that took longer than an hour is a corrupt figure, not a measurement.
_MAX_LOOKUP_MS = 3_600_000.0


def served_from_of(attributes: dict[str, Any]) -> str | None:
    """``observatory.cache.served_from`` when it names one of SERVED_FROM_VALUES; anything else is None."""
    value = attributes.get(CACHE_SERVED_FROM_ATTRIBUTE)
    if value.__class__ is not str:
        return None
    if value in SERVED_FROM_VALUES:  # the usual case: as the gateway writes it
        return value
    value = value.strip().lower()
    return value if value in SERVED_FROM_VALUES else None


def lookup_ms_of(attributes: dict[str, Any]) -> float | None:
    """``observatory.cache.lookup_ms``: a finite duration in [0, 1 h] in milliseconds, else None."""
    value = attributes.get(CACHE_LOOKUP_MS_ATTRIBUTE)
    if value.__class__ is float:  # the usual case; NaN fails the comparison
        return value if 0.0 <= value <= _MAX_LOOKUP_MS else None
    ms = as_float(value)
    return ms if ms is not None and 0.0 <= ms <= _MAX_LOOKUP_MS else None


def first_event_offset_ms(span: SpanView, event_names: frozenset[str]) -> float | None:
    """Milliseconds from span start to the first event whose name is in ``event_names``.

    SDKs append events in the order they are recorded and OTLP keeps that order,
    so the first matching event is the earliest one.
    """
    for event in span.events:
        if event.name in event_names:
            time_ns = event.time_ns
            start_ns = span.start_ns
            if time_ns.__class__ is not int or start_ns.__class__ is not int:
                return None
            offset_ns = time_ns - start_ns
            return offset_ns / 1e6 if offset_ns >= 0 else None
    return None


ENGINE_CONFIG_ATTRIBUTE = "llm_observatory.engine_config"
REPLICA_GROUP_ATTRIBUTE = "llm_observatory.replica_group"
# The served model, on the resource of an engine replica (vLLM's llm_request span does not name it).
MODEL_ATTRIBUTE = "llm_observatory.model"


def _resource_or_span_text(span: SpanView, key: str) -> str | None:
    # Runs for every LLM span and the attribute is usually absent: skip as_text for a missing value.
    value = span.resource.get(key)
    text = None if value is None else as_text(value)
    if text is None:
        value = span.attributes.get(key)
        text = None if value is None else as_text(value)
    return text


def engine_config_of(span: SpanView) -> str | None:
    """The engine configuration name/hash the platform stamps on resources (or, failing that, on the span)."""
    return _resource_or_span_text(span, ENGINE_CONFIG_ATTRIBUTE)


def replica_group_of(span: SpanView) -> str | None:
    """The replica group that served the call: a resource attribute of the platform's engine replicas, a
    span attribute of its gateway's spans (the group it routed the request to)."""
    return _resource_or_span_text(span, REPLICA_GROUP_ATTRIBUTE)


def model_resource_of(span: SpanView) -> str | None:
    """The model an engine replica serves, from its resource (set through OTEL_RESOURCE_ATTRIBUTES)."""
    value = span.resource.get(MODEL_ATTRIBUTE)
    return None if value is None else as_text(value)


def is_error(span: SpanView) -> bool:
    """Errored per the span status, or per the semantic-convention ``error.type`` attribute."""
    if span.status_code == STATUS_ERROR:
        return True
    value = span.attributes.get("error.type")
    return value is not None and as_text(value) is not None


def hop_call(span: SpanView, role: Role, convention: str, *, model: str | None, request_id: str | None,
             prompt_tokens: int | None, completion_tokens: int | None, streaming: bool | None,
             ttft_ms: float | None, cached_prompt_tokens: int | None) -> LLMCall:
    """The LLMCall of a client or gateway span: what its convention read, with what every span carries (ids,
    service, times, error, the platform's engine config and replica group). The hot vLLM and GenAI paths build
    theirs positionally instead."""
    return LLMCall(
        trace_id=span.trace_id,
        span_id=span.span_id,
        parent_span_id=span.parent_span_id,
        role=role,
        convention=convention,
        service=span.service,
        name=span.name,
        start_ns=span.start_ns,
        end_ns=span.end_ns,
        model=model,
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        streaming=streaming,
        is_error=is_error(span),
        ttft_ms=ttft_ms,
        engine_config=engine_config_of(span),
        replica_group=replica_group_of(span),
        cached_prompt_tokens=cached_prompt_tokens,
    )
