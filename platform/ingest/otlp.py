"""Decode OTLP trace payloads (protobuf or OTLP-JSON) into validated `SpanView`s, rejecting or trimming span by span.

A payload whose envelope cannot be parsed is malformed (HTTP 400). Inside a valid
envelope each span stands alone: a bad id, an end before its start, an absurd
timestamp or bad UTF-8 rejects that span only (counted, with a reason), and an
oversized attribute is truncated and counted in `dropped_attributes`.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import orjson
from google.protobuf.message import DecodeError

from collectors.base import SpanEvent, SpanView

from .limits import MalformedPayload
from .otlp_raw import (
    BadValue,
    ExportTraceServiceRequest,
    InstrumentationScope,
    Resource,
    Span,
    decode_scalar,
    parse_any_value,
    parse_key_value,
    unpack_double,
)

try:
    from . import _otlp_fast
except ImportError:  # built without a C compiler: every payload takes the Python decoder
    _otlp_fast = None
else:
    _otlp_fast.configure(SpanView, SpanEvent, orjson.dumps)

FAST_DECODER_AVAILABLE = _otlp_fast is not None

_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_MAX_KEY_BYTES = 256


@dataclasses.dataclass(frozen=True)
class Limits:
    max_attributes: int = 256
    max_value_bytes: int = 16 * 1024
    max_events: int = 128
    max_age_s: int = 7 * 24 * 3600
    max_future_s: int = 3600
    max_duration_s: int = 24 * 3600

    @classmethod
    def from_settings(cls, ingest: dict) -> "Limits":
        return cls(
            max_attributes=ingest["MAX_ATTRIBUTES_PER_SPAN"],
            max_value_bytes=ingest["MAX_ATTRIBUTE_VALUE_BYTES"],
            max_events=ingest["MAX_EVENTS_PER_SPAN"],
            max_age_s=ingest["MAX_SPAN_AGE_SECONDS"],
            max_future_s=ingest["MAX_SPAN_FUTURE_SECONDS"],
            max_duration_s=ingest["MAX_SPAN_DURATION_SECONDS"],
        )


@dataclasses.dataclass
class Decoded:
    spans: list[SpanView]
    # dropped attributes per accepted span (by the sender or by our limits), parallel to `spans`
    dropped: list[int]
    rejected: Counter  # reason -> count
    truncated: int = 0  # attributes truncated or dropped by our limits
    # Set by decode_protobuf_fast: the C batch (its span_rows() writes the spans' rows) and the
    # resource dicts the spans share, in the payload's order.
    fast: Any = None
    resources: list | None = None

    @property
    def rejected_count(self) -> int:
        return sum(self.rejected.values())

    def message(self) -> str:
        return "; ".join(f"{count} span(s) rejected: {reason}" for reason, count in sorted(self.rejected.items()))


class _Trimmer:
    """Applies attribute limits and counts what it drops (one per request)."""

    __slots__ = ("limits", "dropped", "max_value")

    def __init__(self, limits: Limits):
        self.limits = limits
        self.dropped = 0
        self.max_value = limits.max_value_bytes

    def text(self, value: str) -> str:
        limit = self.max_value
        if len(value) > limit // 4 and len(value.encode("utf-8")) > limit:
            self.dropped += 1
            return value.encode("utf-8")[:limit].decode("utf-8", "ignore")
        return value


def _finite_or_text(value: float):
    # NaN and ±Infinity are legal OTLP doubles but not JSON numbers: keep them as text.
    return value if value - value == 0.0 else repr(value)


# -- protobuf ------------------------------------------------------------------------------------


def _pb_value(value, trimmer: _Trimmer, depth: int = 0) -> Any:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        text = value.string_value
        return trimmer.text(text) if len(text) > 1024 else text
    if kind == "int_value" or kind == "bool_value":
        return getattr(value, kind)
    if kind == "double_value":
        return _finite_or_text(value.double_value)
    if kind == "bytes_value":
        return trimmer.text(value.bytes_value.hex())
    if depth >= 8:
        trimmer.dropped += 1
        return None
    if kind == "array_value":
        return [_pb_value(v, trimmer, depth + 1) for v in value.array_value.values[: trimmer.limits.max_attributes]]
    if kind == "kvlist_value":
        return {kv.key: _pb_value(kv.value, trimmer, depth + 1) for kv in value.kvlist_value.values[: trimmer.limits.max_attributes]}
    return None


# Decoded attributes by their serialized KeyValue. Most attributes repeat from span to span
# (service, model, operation, server address, settings, token counts), and a dict lookup on the
# bytes is several times cheaper than decoding them. Only entries whose decoding had no side
# effect are kept (an immutable scalar, a valid key, nothing truncated), so a hit is exactly a
# decode. Long attributes (prompts, payloads) rarely repeat and are not kept; the cache is
# cleared when full, as unique values (ids) would otherwise grow it without bound: at most
# 50,000 entries of at most 256 bytes, a few MiB.
_KV_CACHE: dict[bytes, tuple[str, Any]] = {}
_KV_CACHE_MAX = 50_000
_KV_CACHE_ENTRY_MAX = 256


def _pb_attributes(attributes, trimmer: _Trimmer) -> dict[str, Any]:
    """Attributes given as serialized KeyValues (see otlp_raw), decoded in wire order.

    Raises BadValue for an attribute the generated classes would have refused to parse."""
    limit = trimmer.limits.max_attributes
    if len(attributes) > limit:
        trimmer.dropped += len(attributes) - limit
        attributes = attributes[:limit]
    out = {}
    cached = _KV_CACHE.get
    for kv in attributes:
        hit = cached(kv)
        if hit is not None:
            out[hit[0]] = hit[1]
            continue
        # KeyValue = 0x0A len key 0x12 len AnyValue; lengths under 128 (one byte) or under 16384
        # (two bytes) are read here, anything else by the real message class.
        n = len(kv)
        # The commonest miss first: a double (latencies, scores; unique, so never cached), laid out
        # 0x0A len key | 0x12 0x09 | 0x21 + 8 bytes. The key's length byte fixes every position, so
        # three byte tests identify it and the value is read in place (no slices but the key's).
        if 13 < n < 141 and kv[n - 9] == 0x21 and kv[n - 10] == 0x09 and kv[n - 11] == 0x12 and kv[1] == n - 13 \
                and kv[0] == 0x0A:
            try:
                key = kv[2 : n - 11].decode("utf-8")
            except UnicodeDecodeError:
                raise BadValue("invalid UTF-8 in an attribute key") from None
            value = unpack_double(kv, n - 8)[0]
            out[key] = value if value - value == 0.0 else repr(value)
            if not key:  # (a key of at most 127 bytes is never too long)
                del out[key]
                trimmer.dropped += 1
            continue
        raw = None
        if n > 3 and kv[0] == 0x0A and kv[1] < 0x80:
            p = 2 + kv[1]
            if p + 1 < n and kv[p] == 0x12:
                length = kv[p + 1]
                q = p + 2
                if length >= 0x80 and q < n and kv[q] < 0x80:
                    length = (length & 0x7F) | (kv[q] << 7)
                    q += 1
                if length < 0x4000 and q + length == n:
                    try:
                        key = kv[2:p].decode("utf-8")
                    except UnicodeDecodeError:
                        raise BadValue("invalid UTF-8 in an attribute key") from None
                    raw = kv[q:]
        cacheable = True
        if raw is None:
            # Not the usual layout (fields out of order or repeated, unknown fields, long lengths):
            # the generated class decides, repeated values merging as protobuf says.
            key, message = parse_key_value(kv)
            value = _pb_value(message, trimmer)
            cacheable = False
        else:
            n = len(raw)
            # The two commonest value shapes inline: a string under 128 bytes (tag, one length
            # byte, text) and a double (tag, 8 bytes). The rest through decode_scalar / AnyValue.
            if n < 130 and n > 1 and raw[0] == 0x0A and raw[1] == n - 2:
                try:
                    value = raw[2:].decode("utf-8")
                except UnicodeDecodeError:
                    raise BadValue("invalid UTF-8 in a string value") from None
            elif n == 9 and raw[0] == 0x21:
                value = unpack_double(raw, 1)[0]
                if value - value != 0.0:
                    value = repr(value)
                # Doubles are mostly measurements (latencies, scores), rarely seen twice, and
                # cheap to decode: caching them would only churn the cache.
                cacheable = False
            else:
                kind, value = decode_scalar(raw)
                if kind is None:
                    value = _pb_value(parse_any_value(raw), trimmer)
                    cacheable = False  # lists and dicts are mutable; bytes and nested values may be trimmed
                elif kind == "string_value":
                    if len(value) > 1024:
                        value = trimmer.text(value)
                        cacheable = False
                elif kind == "double_value":
                    value = _finite_or_text(value)
        out[key] = value
        if len(key) > _MAX_KEY_BYTES or not key:
            del out[key]
            trimmer.dropped += 1
        elif cacheable and len(kv) <= _KV_CACHE_ENTRY_MAX:
            if len(_KV_CACHE) >= _KV_CACHE_MAX:
                _KV_CACHE.clear()
            _KV_CACHE[kv] = (key, value)
    return out


def _check_times(start: int, end: int, limits: Limits, now_ns: int) -> str | None:
    if start <= 0 or end <= 0:
        return "missing start or end time"
    if end < start:
        return "end time before start time"
    if start < now_ns - limits.max_age_s * 1_000_000_000 or start > now_ns + limits.max_future_s * 1_000_000_000:
        return "start time outside the accepted window"
    if end - start > limits.max_duration_s * 1_000_000_000:
        return "duration exceeds the limit"
    return None


class _SpanContext:
    """What every span of one request is checked against, computed once per request."""

    __slots__ = ("limits", "now_ns", "earliest", "latest", "max_duration", "out", "trimmer")

    def __init__(self, limits: Limits, now_ns: int, out: Decoded, trimmer: _Trimmer):
        self.limits = limits
        self.now_ns = now_ns
        self.earliest = max(now_ns - limits.max_age_s * 1_000_000_000, 1)
        self.latest = now_ns + limits.max_future_s * 1_000_000_000
        self.max_duration = limits.max_duration_s * 1_000_000_000
        self.out = out
        self.trimmer = trimmer


def _pb_spans(spans, resource: dict, scope_name: str, scope_version: str, ctx: _SpanContext) -> None:
    """Validate and convert the spans of one scope, appending to ctx.out."""
    out = ctx.out
    trimmer = ctx.trimmer
    limits = ctx.limits
    earliest, latest, max_duration = ctx.earliest, ctx.latest, ctx.max_duration
    rejected = out.rejected
    append_span = out.spans.append
    append_dropped = out.dropped.append
    for span in spans:
        before = trimmer.dropped
        # Attribute values first: a bad one used to fail the parse of the span before any other
        # check could run, so "malformed" wins over every other reason, as it did.
        try:
            attributes = _pb_attributes(span.attributes, trimmer)
            events = []
            if span.events:
                raw_events = span.events
                if len(raw_events) > limits.max_events:
                    trimmer.dropped += len(raw_events) - limits.max_events
                    raw_events = raw_events[: limits.max_events]
                events = [SpanEvent(e.time_unix_nano, trimmer.text(e.name), _pb_attributes(e.attributes, trimmer))
                          for e in raw_events]
        except BadValue:
            trimmer.dropped = before
            rejected["invalid UTF-8 or malformed span"] += 1
            continue
        trace_id = span.trace_id
        span_id = span.span_id
        parent = span.parent_span_id
        if len(trace_id) != 16 or len(span_id) != 8 or (parent and len(parent) != 8):
            trimmer.dropped = before
            rejected["invalid trace or span id"] += 1
            continue
        trace_hex = trace_id.hex()
        span_hex = span_id.hex()
        if trace_hex == _ZERO_TRACE or span_hex == _ZERO_SPAN:
            trimmer.dropped = before
            rejected["invalid trace or span id"] += 1
            continue
        start = span.start_time_unix_nano
        end = span.end_time_unix_nano
        # One chained comparison for the usual case; _check_times names the problem otherwise.
        if not (earliest <= start <= latest and start <= end and end - start <= max_duration):
            problem = _check_times(start, end, limits, ctx.now_ns)
            if problem:
                trimmer.dropped = before
                rejected[problem] += 1
                continue
        status = span.status
        name = span.name
        if len(name) > 1024:
            name = trimmer.text(name)[:1024]
        kind = span.kind
        code = status.code
        message = status.message
        append_span(
            SpanView(
                trace_hex,
                span_hex,
                parent.hex() if parent else "",
                name,
                kind if 0 <= kind <= 5 else 0,
                start,
                end,
                code if 0 <= code <= 2 else 0,
                trimmer.text(message) if message else "",
                attributes,
                events,
                resource,
                scope_name,
                scope_version,
                [(link.trace_id.hex(), link.span_id.hex()) for link in span.links[: limits.max_events]] if span.links else [],
            )
        )
        append_dropped(trimmer.dropped - before + span.dropped_attributes_count)


def _resource_attributes(resource, trimmer: _Trimmer) -> dict | None:
    """The resource's attributes, or None when one of them is bad (its spans are then rejected)."""
    before = trimmer.dropped
    try:
        return _pb_attributes(resource.attributes, trimmer)
    except BadValue:
        trimmer.dropped = before
        return None


def decode_protobuf(data: bytes, limits: Limits, now_ns: int | None = None) -> Decoded:
    now_ns = now_ns or time.time_ns()
    out = Decoded([], [], Counter())
    trimmer = _Trimmer(limits)
    ctx = _SpanContext(limits, now_ns, out, trimmer)
    try:
        request = ExportTraceServiceRequest.FromString(data)
    except DecodeError:
        # Usually bad UTF-8 in a name (attribute values are only read below, span by span): re-read
        # span by span so only the bad spans are lost.
        _decode_protobuf_tolerant(data, ctx)
        out.truncated = trimmer.dropped
        return out
    for resource_spans in request.resource_spans:
        resource = _resource_attributes(resource_spans.resource, trimmer)
        for scope_spans in resource_spans.scope_spans:
            if resource is None:
                out.rejected["invalid UTF-8 or malformed resource/scope"] += len(scope_spans.spans)
                continue
            scope = scope_spans.scope
            _pb_spans(scope_spans.spans, resource, scope.name, scope.version, ctx)
    out.truncated = trimmer.dropped
    return out


def parse_protobuf_fast(data: bytes, limits: Limits, now_ns: int | None = None):
    """The C fast path's parse of a request (ingest/_otlp_fast.c), made without the GIL and without
    any Python object, or None when the payload is not one the fast path handles (anything
    malformed, rejected, trimmed or unusual; see the C file) or the extension is not built: the
    caller then uses decode_protobuf. `fast_decoded` turns it into a Decoded."""
    if _otlp_fast is None:
        return None
    now_ns = now_ns or time.time_ns()
    return _otlp_fast.parse(
        data, limits.max_attributes, limits.max_value_bytes, limits.max_events,
        max(now_ns - limits.max_age_s * 1_000_000_000, 1), now_ns + limits.max_future_s * 1_000_000_000,
        limits.max_duration_s * 1_000_000_000,
    )


def fast_decoded(batch) -> Decoded:
    """decode_protobuf's result for a request parse_protobuf_fast took: the same SpanViews, plus the
    batch (whose span_rows() writes the spans' rows) and the resource dicts the spans share."""
    spans, dropped, resources = batch.views()
    return Decoded(spans, dropped, Counter(), fast=batch, resources=resources)


def decode_protobuf_fast(data: bytes, limits: Limits, now_ns: int | None = None) -> Decoded | None:
    """decode_protobuf's result computed by the C fast path, or None (see parse_protobuf_fast)."""
    batch = parse_protobuf_fast(data, limits, now_ns)
    return None if batch is None else fast_decoded(batch)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise MalformedPayload("truncated protobuf varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes):
    """Yield (field number, wire type, value) of one protobuf message; values of wire type 2 are bytes."""
    pos = 0
    end = len(data)
    while pos < end:
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            if pos + length > end:
                raise MalformedPayload("truncated protobuf field")
            value, pos = data[pos : pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise MalformedPayload(f"unsupported protobuf wire type {wire}")
        if pos > end:
            raise MalformedPayload("truncated protobuf field")
        yield number, wire, value


def _head_and_items(message: bytes) -> tuple[bytes, list[bytes]]:
    """Field 1 and every field 2 of a ResourceSpans (its resource, its scope spans) or a ScopeSpans (its scope, its
    spans), undecoded: the last field 1, b"" when there is none."""
    head = b""
    items: list[bytes] = []
    for number, wire, value in _fields(message):
        if number == 1 and wire == 2:
            head = value
        elif number == 2 and wire == 2:
            items.append(value)
    return head, items


def _decode_protobuf_tolerant(data: bytes, ctx: _SpanContext) -> None:
    # ExportTraceServiceRequest.resource_spans = 1; ResourceSpans.resource = 1, scope_spans = 2;
    # ScopeSpans.scope = 1, spans = 2.
    out = ctx.out
    for number, wire, resource_spans in _fields(data):
        if number != 1 or wire != 2:
            continue
        resource_raw, scopes = _head_and_items(resource_spans)
        try:
            resource = _resource_attributes(Resource.FromString(resource_raw), ctx.trimmer)
        except DecodeError:
            resource = None
        for scope_spans in scopes:
            scope_raw, spans = _head_and_items(scope_spans)
            try:
                scope = InstrumentationScope.FromString(scope_raw)
            except DecodeError:
                scope = None
            if resource is None or scope is None:
                out.rejected["invalid UTF-8 or malformed resource/scope"] += len(spans)
                continue
            for raw in spans:
                try:
                    span = Span.FromString(raw)
                except DecodeError:
                    out.rejected["invalid UTF-8 or malformed span"] += 1
                    continue
                _pb_spans((span,), resource, scope.name, scope.version, ctx)


# -- OTLP JSON -----------------------------------------------------------------------------------


def _get(obj: dict, camel: str, snake: str, default=None):
    value = obj.get(camel)
    if value is None:
        value = obj.get(snake, default)
    return default if value is None else value


def _json_int(value) -> int:
    if isinstance(value, bool):
        raise ValueError("boolean where an integer was expected")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"not an integer: {value!r}")


def _json_id(value, size: int) -> str:
    if not isinstance(value, str) or len(value) != size * 2:
        raise ValueError("bad id")
    try:
        return bytes.fromhex(value).hex()
    except ValueError:
        raise ValueError("bad id") from None


def _json_value(value, trimmer: _Trimmer, depth: int = 0):
    if not isinstance(value, dict):
        return None
    if "stringValue" in value or "string_value" in value:
        text = _get(value, "stringValue", "string_value", "")
        if not isinstance(text, str):
            raise ValueError("stringValue is not a string")
        return trimmer.text(text)
    if "intValue" in value or "int_value" in value:
        return _json_int(_get(value, "intValue", "int_value"))
    if "doubleValue" in value or "double_value" in value:
        raw = _get(value, "doubleValue", "double_value")
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise ValueError("doubleValue is not a number")
        return _finite_or_text(float(raw))
    if "boolValue" in value or "bool_value" in value:
        raw = _get(value, "boolValue", "bool_value")
        if not isinstance(raw, bool):
            raise ValueError("boolValue is not a boolean")
        return raw
    if "bytesValue" in value or "bytes_value" in value:
        try:
            return trimmer.text(base64.b64decode(_get(value, "bytesValue", "bytes_value"), validate=True).hex())
        except (binascii.Error, TypeError, ValueError):
            raise ValueError("bytesValue is not base64") from None
    if depth >= 8:
        trimmer.dropped += 1
        return None
    if "arrayValue" in value or "array_value" in value:
        items = _get(_get(value, "arrayValue", "array_value", {}), "values", "values", [])
        if not isinstance(items, list):
            raise ValueError("arrayValue.values is not a list")
        return [_json_value(v, trimmer, depth + 1) for v in items[: trimmer.limits.max_attributes]]
    if "kvlistValue" in value or "kvlist_value" in value:
        items = _get(_get(value, "kvlistValue", "kvlist_value", {}), "values", "values", [])
        return _json_attributes(items, trimmer, depth + 1)
    return None


def _json_attributes(items, trimmer: _Trimmer, depth: int = 0) -> dict[str, Any]:
    if not items:
        return {}
    if not isinstance(items, list):
        raise ValueError("attributes is not a list")
    limit = trimmer.limits.max_attributes
    if len(items) > limit:
        trimmer.dropped += len(items) - limit
        items = items[:limit]
    out = {}
    for kv in items:
        if not isinstance(kv, dict):
            raise ValueError("attribute is not an object")
        key = kv.get("key")
        if not isinstance(key, str) or not key or len(key) > _MAX_KEY_BYTES:
            trimmer.dropped += 1
            continue
        out[key] = _json_value(kv.get("value"), trimmer, depth)
    return out


def _has_bad_text(obj) -> bool:
    """True when a decoded JSON value holds a lone surrogate (bad UTF-8 or a bad \\u escape)."""
    if isinstance(obj, str):
        if obj.isascii():
            return False
        try:
            obj.encode("utf-8")
            return False
        except UnicodeEncodeError:
            return True
    if isinstance(obj, dict):
        return any(_has_bad_text(k) or _has_bad_text(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_bad_text(v) for v in obj)
    return False


def _list_field(obj: dict, camel: str, snake: str) -> list:
    """A list of OTLP JSON (empty when left out); MalformedPayload when it is no list."""
    items = _get(obj, camel, snake, [])
    if not isinstance(items, list):
        raise MalformedPayload(f"{camel} must be a list")
    return items


def _objects(items: list, camel: str) -> Iterator[dict]:
    """The items of a list of OTLP JSON, each found to be an object as it comes (MalformedPayload otherwise)."""
    for item in items:
        if not isinstance(item, dict):
            raise MalformedPayload(f"{camel} items must be objects")
        yield item


def _has_bad_text_within(obj: Any, what: str) -> bool:
    """_has_bad_text of a resource or scope; MalformedPayload when it is nested too deeply to read."""
    try:
        return _has_bad_text(obj)
    except RecursionError:
        raise MalformedPayload(f"{what} nested too deeply") from None


def decode_json(data: bytes, limits: Limits, now_ns: int | None = None) -> Decoded:
    now_ns = now_ns or time.time_ns()
    out = Decoded([], [], Counter())
    trimmer = _Trimmer(limits)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        # Keep going so that only the spans holding the bad bytes are rejected.
        text = data.decode("utf-8", "surrogateescape")
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise MalformedPayload(f"invalid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise MalformedPayload("OTLP JSON must be an object with resourceSpans")
    for resource_spans in _objects(_list_field(document, "resourceSpans", "resource_spans"), "resourceSpans"):
        scope_list = _list_field(resource_spans, "scopeSpans", "scope_spans")
        resource_obj = _get(resource_spans, "resource", "resource", {})
        bad_resource = _has_bad_text_within(resource_obj, "resource")
        try:
            resource = None if bad_resource else _json_attributes(
                resource_obj.get("attributes") if isinstance(resource_obj, dict) else None, trimmer)
        except (ValueError, TypeError, AttributeError):
            resource = None
        for scope_spans in _objects(scope_list, "scopeSpans"):
            spans = _list_field(scope_spans, "spans", "spans")
            scope = _get(scope_spans, "scope", "scope", {})
            scope_name = scope.get("name", "") if isinstance(scope, dict) else ""
            scope_version = scope.get("version", "") if isinstance(scope, dict) else ""
            bad_scope = _has_bad_text_within(scope, "scope")
            if resource is None or not isinstance(scope_name, str) or not isinstance(scope_version, str) or bad_scope:
                out.rejected["invalid UTF-8 or malformed resource/scope"] += len(spans)
                continue
            for span in spans:
                _json_span(span, resource, scope_name, scope_version, limits, now_ns, out, trimmer)
    out.truncated = trimmer.dropped
    return out


def _json_span(span, resource, scope_name, scope_version, limits: Limits, now_ns: int, out: Decoded,
               trimmer: _Trimmer) -> None:
    if not isinstance(span, dict):
        out.rejected["malformed span"] += 1
        return
    try:
        bad_text = _has_bad_text(span)
    except RecursionError:
        out.rejected["malformed span (nested too deeply)"] += 1
        return
    if bad_text:
        out.rejected["invalid UTF-8 or malformed span"] += 1
        return
    try:
        trace_id = _json_id(_get(span, "traceId", "trace_id"), 16)
        span_id = _json_id(_get(span, "spanId", "span_id"), 8)
        parent_raw = _get(span, "parentSpanId", "parent_span_id", "")
        parent = _json_id(parent_raw, 8) if parent_raw else ""
    except ValueError:
        out.rejected["invalid trace or span id"] += 1
        return
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        out.rejected["invalid trace or span id"] += 1
        return
    before = trimmer.dropped
    try:
        start = _json_int(_get(span, "startTimeUnixNano", "start_time_unix_nano", 0))
        end = _json_int(_get(span, "endTimeUnixNano", "end_time_unix_nano", 0))
        problem = _check_times(start, end, limits, now_ns)
        if problem:
            out.rejected[problem] += 1
            return
        name = _get(span, "name", "name", "")
        kind = _json_int(_get(span, "kind", "kind", 0))
        status = _get(span, "status", "status", {})
        if not isinstance(name, str) or not isinstance(status, dict) or not 0 <= kind <= 5:
            raise ValueError("bad name, kind or status")
        status_code = _json_int(status.get("code", 0))
        status_message = status.get("message", "")
        if not isinstance(status_message, str) or not 0 <= status_code <= 2:
            raise ValueError("bad status")
        attributes = _json_attributes(span.get("attributes"), trimmer)
        raw_events = span.get("events") or []
        if not isinstance(raw_events, list):
            raise ValueError("events is not a list")
        if len(raw_events) > limits.max_events:
            trimmer.dropped += len(raw_events) - limits.max_events
            raw_events = raw_events[: limits.max_events]
        events = []
        for event in raw_events:
            if not isinstance(event, dict) or not isinstance(event.get("name", ""), str):
                raise ValueError("bad event")
            events.append(
                SpanEvent(
                    _json_int(_get(event, "timeUnixNano", "time_unix_nano", 0)),
                    trimmer.text(event.get("name", "")),
                    _json_attributes(event.get("attributes"), trimmer),
                )
            )
        dropped = _json_int(_get(span, "droppedAttributesCount", "dropped_attributes_count", 0))
        links = []
        for link in (span.get("links") or [])[: limits.max_events]:
            if not isinstance(link, dict):
                raise ValueError("bad link")
            links.append((_json_id(_get(link, "traceId", "trace_id"), 16), _json_id(_get(link, "spanId", "span_id"), 8)))
    except (ValueError, TypeError, AttributeError, OverflowError, RecursionError):
        trimmer.dropped = before
        out.rejected["malformed span"] += 1
        return
    out.spans.append(
        SpanView(
            trace_id,
            span_id,
            parent,
            trimmer.text(name)[:1024],
            kind,
            start,
            end,
            status_code,
            trimmer.text(status_message),
            attributes,
            events,
            resource,
            scope_name,
            scope_version,
            links,
        )
    )
    out.dropped.append(trimmer.dropped - before + max(dropped, 0))
