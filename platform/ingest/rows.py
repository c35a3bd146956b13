"""Turn validated spans and their LLM calls into ClickHouse rows (the column lists match ch_migrations/0001)."""
from __future__ import annotations

import json
from typing import Any

from collectors.base import LLMCall, SpanView

SPAN_COLUMNS = (
    "project_id", "trace_id", "span_id", "parent_span_id", "start_time", "end_time", "name", "kind",
    "status_code", "status_message", "service_name", "scope_name", "scope_version", "resource_attributes",
    "attributes", "events_time", "events_name", "events_attributes", "links_trace_id", "links_span_id",
    "dropped_attributes", "llm_convention", "retention_days",
)

CALL_COLUMNS = (
    "project_id", "trace_id", "span_id", "parent_span_id", "role", "convention", "service", "name", "start_ns",
    "end_ns", "model", "request_id", "prompt_tokens", "completion_tokens", "streaming", "is_error", "ttft_ms",
    "engine_e2e_ms", "queue_ms", "prefill_ms", "decode_ms", "inference_ms", "engine_config", "retention_days",
)
# ingested_at is left to ClickHouse (DEFAULT now64(3)): the time the row reached the store.

_MAX_NS = (1 << 63) - 1
_UINT32 = (1 << 32) - 1


def text(value: Any) -> str:
    kind = type(value)
    if kind is str:
        return value
    if kind is bool:
        return "true" if value else "false"
    if kind is int or kind is float:
        return repr(value)
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False, default=str)


def string_map(attributes: dict[str, Any]) -> dict[str, str]:
    return {k: v if type(v) is str else text(v) for k, v in attributes.items()}


def span_row(project_id: int, retention_days: int, span: SpanView, dropped: int, convention: str,
             resource_map: dict[str, str]) -> tuple:
    events = span.events
    return (
        project_id,
        span.trace_id,
        span.span_id,
        span.parent_span_id,
        span.start_ns,
        span.end_ns,
        span.name,
        span.kind,
        span.status_code,
        span.status_message,
        span.service,
        span.scope_name,
        span.scope_version,
        resource_map,
        string_map(span.attributes),
        [e.time_ns if 0 <= e.time_ns <= _MAX_NS else 0 for e in events],
        [e.name for e in events],
        [string_map(e.attributes) for e in events],
        [t for t, _ in span.links],
        [s for _, s in span.links],
        min(dropped, _UINT32),
        convention,
        retention_days,
    )


def _uint32(value: int | None) -> int | None:
    if value is None:
        return None
    return value if 0 <= value <= _UINT32 else None


def call_row(project_id: int, retention_days: int, call: LLMCall) -> tuple:
    return (
        project_id,
        call.trace_id,
        call.span_id,
        call.parent_span_id,
        call.role.value,
        call.convention,
        call.service,
        call.name,
        call.start_ns,
        call.end_ns,
        call.model,
        call.request_id,
        _uint32(call.prompt_tokens),
        _uint32(call.completion_tokens),
        None if call.streaming is None else int(call.streaming),
        int(call.is_error),
        call.ttft_ms,
        call.engine_e2e_ms,
        call.queue_ms,
        call.prefill_ms,
        call.decode_ms,
        call.inference_ms,
        call.engine_config,
        retention_days,
    )
