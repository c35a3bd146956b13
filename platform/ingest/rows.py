"""ClickHouse rows for spans, their resources and LLM calls, encoded once as JSONCompactEachRow at accept time.

The encoded bytes are what the spool keeps and what ClickHouse parses (in C++, off the
GIL), so the writer does no per-row work. Attribute maps stay typed: ClickHouse renders
numbers, booleans, arrays and objects as strings into Map(String, String) itself
(the input_format_json_read_*_as_strings settings in traces.row_encoding).

A span row names its resource by `resource_id` and leaves `resource_attributes` empty;
the attributes go once per (resource, day) to `span_resources` (migration 0005).
"""
from __future__ import annotations

import hashlib
import time

from traces.row_encoding import encode_value

from collectors.base import LLMCall, SpanView

SPAN_COLUMNS = (
    "project_id", "trace_id", "span_id", "parent_span_id", "start_time", "end_time", "name", "kind",
    "status_code", "status_message", "service_name", "scope_name", "scope_version", "resource_attributes",
    "attributes", "events_time", "events_name", "events_attributes", "links_trace_id", "links_span_id",
    "dropped_attributes", "llm_convention", "retention_days", "resource_id",
)
# Span rows spooled before migration 0005 (no resource_id, the resource attributes inline): a spool
# replayed after an upgrade still holds some.
SPAN_COLUMNS_INLINE_RESOURCE = SPAN_COLUMNS[:-1]

RESOURCE_COLUMNS = ("project_id", "resource_id", "day", "attributes", "retention_days")

CALL_COLUMNS = (
    "project_id", "trace_id", "span_id", "parent_span_id", "role", "convention", "service", "name", "start_ns",
    "end_ns", "model", "request_id", "prompt_tokens", "completion_tokens", "streaming", "is_error", "ttft_ms",
    "engine_e2e_ms", "queue_ms", "prefill_ms", "decode_ms", "inference_ms", "engine_config", "retention_days",
    "replica_group", "cached_prompt_tokens", "served_from", "lookup_ms",
)
# LLM call rows spooled before migration 0012 (no cache columns) and before migration 0006 (no replica_group).
CALL_COLUMNS_BEFORE_CACHES = CALL_COLUMNS[:-3]
CALL_COLUMNS_BEFORE_REPLICA_GROUP = CALL_COLUMNS_BEFORE_CACHES[:-1]

# The spool keeps records of earlier versions until they are written (an upgrade with data in the spool);
# a record's length and format say which columns its blobs hold (see ingest/service.py for the record's items).
# The 8th item of a current record: 4 added a 9th item, the export's arrival time; 5 the call rows' cache columns.
RECORD_FORMAT = 5


def arrival_of(record: tuple) -> float | None:
    """When the export of this record arrived (seconds since the epoch); None for records spooled before
    format 4."""
    return record[8] if len(record) > 8 else None


def span_columns_of(record: tuple) -> tuple[str, ...]:
    return SPAN_COLUMNS if len(record) > 6 else SPAN_COLUMNS_INLINE_RESOURCE


def call_columns_of(record: tuple) -> tuple[str, ...]:
    if len(record) <= 7:
        return CALL_COLUMNS_BEFORE_REPLICA_GROUP
    return CALL_COLUMNS if record[7] >= 5 else CALL_COLUMNS_BEFORE_CACHES
# ingested_at is left to ClickHouse (DEFAULT now64(3)): the time the row reached the store.

_UINT32 = (1 << 32) - 1
_MAX_NS = (1 << 63) - 1


_NS_TEXT_MIN = 1_000_000_000_000_000_000


def ns_text(ns: int) -> str:
    """Nanoseconds since the epoch as text ClickHouse reads into DateTime64(9) unambiguously."""
    if ns >= _NS_TEXT_MIN:
        return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"
    # Fewer than 10 digits of seconds (before 2001-09-09, e.g. an unset event time 0) would be read
    # as a date; spell those out.
    seconds, fraction = divmod(max(ns, 0), 1_000_000_000)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + f".{fraction:09d}"


# orjson writes a tuple as a JSON array: spans without events or links share these instead of
# allocating five empty lists each.
_NO_ITEMS = ()
_NO_ATTRIBUTES: dict = {}
NS_PER_DAY = 86_400 * 1_000_000_000


def resource_id(resource: dict) -> int:
    """The id of a resource in `span_resources`: 64 bits of a hash of its attributes as encoded for
    ClickHouse (stable across processes and restarts), never 0. 0 for a resource without attributes,
    which needs no row."""
    if not resource:
        return 0
    digest = hashlib.blake2b(encode_value(resource), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def resource_row(project_id: int, rid: int, day: int, resource: dict, retention_days: int) -> bytes:
    """One `span_resources` row (JSONCompactEachRow); `day` counts days since the epoch, as the
    spans' toDate(start_time) does."""
    return encode_value([project_id, rid, day, resource, retention_days])


def span_row(project_id: int, retention_days: int, span: SpanView, dropped: int, convention: str,
             service: str | None = None, rid: int = 0) -> list:
    """The spans row; `service` may be given when the caller already knows span.service (it is the
    same for every span of a resource). `rid` is resource_id(span.resource): when it is not 0 the
    resource's attributes are in `span_resources`, not on the row."""
    events = span.events
    links = span.links
    start = span.start_ns
    end = span.end_ns
    return [
        project_id,
        span.trace_id,
        span.span_id,
        span.parent_span_id,
        # ns_text inlined for the usual case (every accepted span starts within days of now).
        f"{start // 1_000_000_000}.{start % 1_000_000_000:09d}" if start >= _NS_TEXT_MIN else ns_text(start),
        f"{end // 1_000_000_000}.{end % 1_000_000_000:09d}" if end >= _NS_TEXT_MIN else ns_text(end),
        span.name,
        span.kind,
        span.status_code,
        span.status_message,
        span.service if service is None else service,
        span.scope_name,
        span.scope_version,
        span.resource if rid == 0 else _NO_ATTRIBUTES,
        span.attributes,
        [ns_text(e.time_ns if 0 <= e.time_ns <= _MAX_NS else 0) for e in events] if events else _NO_ITEMS,
        [e.name for e in events] if events else _NO_ITEMS,
        [e.attributes for e in events] if events else _NO_ITEMS,
        [t for t, _ in links] if links else _NO_ITEMS,
        [s for _, s in links] if links else _NO_ITEMS,
        dropped if dropped <= _UINT32 else _UINT32,
        convention,
        retention_days,
        rid,
    ]


def _uint32(value: int | None) -> int | None:
    if value is None:
        return None
    return value if 0 <= value <= _UINT32 else None


def call_row(project_id: int, retention_days: int, call: LLMCall) -> list:
    return [
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
        call.replica_group,
        _uint32(call.cached_prompt_tokens),
        call.served_from,
        call.lookup_ms,
    ]
