"""ClickHouse rows for spans, their resources and LLM calls, encoded once as JSONCompactEachRow at accept time.

The encoded bytes are what the spool keeps and what ClickHouse parses (in C++, off the
GIL), so the writer does no per-row work. Attribute maps stay typed: ClickHouse renders
numbers, booleans, arrays and objects as strings into Map(String, String) itself
(the input_format_json_read_*_as_strings settings in JSON_INSERT_SETTINGS).

A span row names its resource by `resource_id` and leaves `resource_attributes` empty;
the attributes go once per (resource, day) to `span_resources` (migration 0005).
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Any

import orjson

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
    "replica_group",
)
# LLM call rows spooled before migration 0006 (no replica_group).
CALL_COLUMNS_BEFORE_REPLICA_GROUP = CALL_COLUMNS[:-1]

# The spool keeps records of earlier versions until they are written (an upgrade with data in the spool);
# a record's length says which columns its blobs hold (see ingest/service.py for the record's items).
RECORD_FORMAT = 4  # the 8th item of a current record (4: a 9th item, the export's arrival time)


def arrival_of(record: tuple) -> float | None:
    """When the export of this record arrived (seconds since the epoch); None for records spooled before
    format 4."""
    return record[8] if len(record) > 8 else None


def span_columns_of(record: tuple) -> tuple[str, ...]:
    return SPAN_COLUMNS if len(record) > 6 else SPAN_COLUMNS_INLINE_RESOURCE


def call_columns_of(record: tuple) -> tuple[str, ...]:
    return CALL_COLUMNS if len(record) > 7 else CALL_COLUMNS_BEFORE_REPLICA_GROUP
# ingested_at is left to ClickHouse (DEFAULT now64(3)): the time the row reached the store.

JSON_INSERT_SETTINGS = {
    "input_format_json_read_numbers_as_strings": 1,
    "input_format_json_read_bools_as_strings": 1,
    "input_format_json_read_arrays_as_strings": 1,
    "input_format_json_read_objects_as_strings": 1,
    "input_format_skip_unknown_fields": 0,
}


def bulk_insert_settings(embedded: bool) -> dict:
    """Settings for the span writer's and the decomposition's inserts (JSON_INSERT_SETTINGS plus two).

    - optimize_on_insert = 0: our tables are ReplacingMergeTrees, and by default ClickHouse runs
      the replacing merge on every inserted block, copying each row once more (Map columns
      row by row); that was ~25% of the CPU of a spans insert. Rows repeated within one block
      then stay until a merge, exactly like rows repeated across blocks (spool replays) always
      could: every read of these tables already uses FINAL or counts distinct span ids.
    - input_format_parallel_parsing = 0 with chdb: the parser's extra threads share the two
      cores with ingest's Python thread, and parallel parsing costs ~10% more CPU in all (a
      server on its own machine keeps it, for latency).
    """
    settings = {**JSON_INSERT_SETTINGS, "optimize_on_insert": 0}
    if embedded:
        settings["input_format_parallel_parsing"] = 0
    return settings

_UINT32 = (1 << 32) - 1
_MAX_NS = (1 << 63) - 1
_encode = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode


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
    digest = hashlib.blake2b(_encode_value(resource), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def resource_row(project_id: int, rid: int, day: int, resource: dict, retention_days: int) -> bytes:
    """One `span_resources` row (JSONCompactEachRow); `day` counts days since the epoch, as the
    spans' toDate(start_time) does."""
    return _encode_value([project_id, rid, day, resource, retention_days])


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
    ]


def _finite(value: Any) -> Any:
    """Replace NaN/±Infinity (not valid JSON) with their names as text, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _encode_value(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer beyond 64 bits (OTLP-JSON allows any): the stdlib writes it as text
        return _encode(_finite(value)).encode()


def encode_rows(rows: list[list]) -> bytes:
    """JSONCompactEachRow bytes for these rows (orjson: ~10x the stdlib encoder on these rows).

    Rows are separated by commas (`[...],[...]`), which JSONCompactEachRow reads like newlines:
    the whole batch is then one orjson call with the brackets cut off, ~25% cheaper than one call
    per row. Batches are joined with newlines by their consumers."""
    if not rows:
        return b""
    try:
        # orjson writes NaN/Infinity as null; doubles from OTLP were already made text by the decoder.
        return orjson.dumps(rows)[1:-1]
    except TypeError:  # an integer beyond 64 bits (OTLP-JSON allows any): the stdlib writes it as text
        return "\n".join(_encode(_finite(row)) for row in rows).encode()
