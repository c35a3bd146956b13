"""What the tests of the C fast path of OTLP/protobuf decoding share: the comparison of a fast result with the
Python decoder's (exact types, key order, every double's bits, no shared containers, byte-identical spool
records), and spans and requests encoded by hand on the protobuf wire."""
from __future__ import annotations

import dataclasses
import os
import struct

import pytest
from ingest.limits import MalformedPayload
from ingest.otlp import Decoded, Limits, decode_protobuf, decode_protobuf_fast
from ingest.service import build_record
from otlp_payloads import fixed64, ld, tag, varint
from tenancy.keys import IngestIdentity

from collectors.base import SpanEvent, SpanView

NOW = 1_750_000_000_123_456_789  # every decode here is at this instant
SECOND = 1_000_000_000
IDENTITY = IngestIdentity(project_id=123_456, retention_days=45)
OTHER_IDENTITY = IngestIdentity(project_id=7, retention_days=3650)

DEFAULT = Limits()
SMALL = Limits(max_attributes=4, max_events=2, max_value_bytes=64)
TINY = Limits(max_attributes=1, max_events=1, max_value_bytes=1, max_age_s=60, max_future_s=0, max_duration_s=1)
LIMITS = [DEFAULT, SMALL, TINY]


def skip_module_when_turned_off() -> None:
    """Skip the calling test module where INGEST_FAST_DECODER=false (the platform setting that turns the fast path
    off, e.g. on a machine with no C compiler); otherwise a missing or broken extension fails it."""
    if os.environ.get("INGEST_FAST_DECODER", "").strip().lower() in {"0", "false", "no", "off"}:
        pytest.skip("the C fast decoder is turned off (INGEST_FAST_DECODER)", allow_module_level=True)


# -- comparing a fast result with the Python decoder's ------------------------------------------------

SPAN_FIELDS = tuple(f.name for f in dataclasses.fields(SpanView))
EVENT_FIELDS = tuple(f.name for f in dataclasses.fields(SpanEvent))


def canon(value):
    """A comparable form of a decoded value that keeps exact types, dict key order and every double's
    bits (repr tells -0.0 from 0.0 and every double from its neighbours)."""
    kind = type(value)
    if kind is dict:
        return ("dict", tuple((canon(k), canon(v)) for k, v in value.items()))
    if kind is list or kind is tuple:
        return (kind.__name__, tuple(canon(v) for v in value))
    if kind is float:
        return ("float", repr(value))
    if kind is SpanEvent:
        return ("SpanEvent", tuple(canon(getattr(value, f)) for f in EVENT_FIELDS))
    if value is None or kind in (str, int, bool, bytes):
        return (kind.__name__, value)
    raise AssertionError(f"unexpected type {kind.__name__} in a decoded span: {value!r}")


def differences(fast: Decoded, py: Decoded) -> str | None:
    """The first difference between the two decodes, described, or None."""
    if type(fast.spans) is not list or len(fast.spans) != len(py.spans):
        return f"{len(fast.spans)} spans from the fast path, {len(py.spans)} from the Python decoder"
    for i, (f, p) in enumerate(zip(fast.spans, py.spans)):
        if type(f) is not SpanView:
            return f"span {i} is a {type(f).__name__}, not a SpanView"
        for name in SPAN_FIELDS:
            a, b = getattr(f, name), getattr(p, name)
            if canon(a) != canon(b):
                return f"span {i} ({p.span_id}) {name}: fast {a!r}\n    != python {b!r}"
    if canon(fast.dropped) != canon(py.dropped):
        return f"dropped: fast {fast.dropped!r} != python {py.dropped!r}"
    if dict(fast.rejected) != dict(py.rejected):
        return f"rejected: fast {dict(fast.rejected)!r} != python {dict(py.rejected)!r}"
    if canon(fast.truncated) != canon(py.truncated):
        return f"truncated: fast {fast.truncated!r} != python {py.truncated!r}"
    return None


def resource_sharing(decoded: Decoded) -> list[int]:
    """For each span, the index of the first span holding the very same resource dict."""
    first: dict[int, int] = {}
    return [first.setdefault(id(span.resource), i) for i, span in enumerate(decoded.spans)]


def containers(decoded: Decoded) -> list:
    """Every dict and list of the spans' attributes, events' attributes and array values (resources apart)."""
    found = []

    def walk(value):
        if isinstance(value, (dict, list)):
            found.append(value)
            for item in value.values() if isinstance(value, dict) else value:
                walk(item)

    for span in decoded.spans:
        walk(span.attributes)
        for event in span.events:
            walk(event.attributes)
    return found


def assert_no_aliasing(decoded: Decoded, *others: Decoded) -> None:
    """The Python decoder gives every span (and every decode) dicts and lists of its own, the resource
    dict apart: a cached or shared mutable object would let one consumer's change reach other spans."""
    mine = containers(decoded)
    assert len({id(c) for c in mine}) == len(mine), "an attribute dict or array is shared between spans"
    resources = {id(span.resource) for span in decoded.spans}
    assert not resources & {id(c) for c in mine}, "a resource dict is also an attribute dict"
    for other in others:
        theirs = {id(c) for c in containers(other)} | {id(span.resource) for span in other.spans}
        assert not theirs & ({id(c) for c in mine} | resources), "two decodes share a dict or an array"


def first_difference(a: bytes, b: bytes) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"{len(a)} vs {len(b)} bytes, first difference at byte {at}:\n"
            f"    fast   ...{a[max(at - 80, 0):at + 80]!r}\n    python ...{b[max(at - 80, 0):at + 80]!r}")


def assert_same_records(fast: Decoded, py: Decoded, identity: IngestIdentity = IDENTITY) -> None:
    """build_record of the fast result (span rows from the C batch) is what it makes of the Python result."""
    expected, expected_memo = build_record(identity, py, arrival=0.0)
    for attempt in range(2):  # a second build from the same batch gives the same bytes
        record, memo = build_record(identity, fast, arrival=0.0)
        assert len(record) == len(expected)
        for index, (got, want) in enumerate(zip(record, expected)):
            if isinstance(want, bytes) and got != want:
                pytest.fail(f"record item {index} (build {attempt + 1}) differs: {first_difference(got, want)}")
            assert got == want, f"record item {index} (build {attempt + 1})"
        assert repr(memo) == repr(expected_memo)


def assert_fast_matches(fast, py: Decoded, identity: IngestIdentity = IDENTITY) -> None:
    """`fast` (a decode_protobuf_fast result that is not None) is exactly the Python decoder's `py`."""
    assert isinstance(fast, Decoded), f"decode_protobuf_fast returned {type(fast).__name__}"
    assert getattr(fast, "fast", None) is not None, "a fast result carries its C batch as .fast"
    assert getattr(py, "fast", None) is None, "the Python decoder's result has no C batch"
    assert not fast.rejected and fast.truncated == 0, "the fast path only takes payloads it decodes whole"
    problem = differences(fast, py)
    assert problem is None, problem
    assert resource_sharing(fast) == resource_sharing(py), "spans of one ResourceSpans share one resource dict"
    assert_no_aliasing(fast)
    if py.spans:  # (the service builds a record only when some span was accepted)
        assert_same_records(fast, py, identity)


def python_outcome(data: bytes, limits: Limits):
    """decode_protobuf's result, or the MalformedPayload it raised, as a comparable value."""
    try:
        decoded = decode_protobuf(data, limits, NOW)
    except MalformedPayload as exc:
        return ("malformed", str(exc)), None
    return ("decoded", tuple(canon(getattr(s, f)) for s in decoded.spans for f in SPAN_FIELDS),
            tuple(decoded.dropped), tuple(sorted(decoded.rejected.items())), decoded.truncated), decoded


def check(data: bytes, limits: Limits = DEFAULT):
    """decode_protobuf_fast never raises, and what it returns (when not None) is the Python decode.
    Returns the fast result."""
    fast = decode_protobuf_fast(data, limits, NOW)
    if fast is None:
        return None
    try:
        py = decode_protobuf(data, limits, NOW)
    except MalformedPayload as exc:
        pytest.fail(f"the fast path decoded a payload the Python decoder calls malformed ({exc})")
    assert_fast_matches(fast, py)
    return fast


# -- protobuf wire encoding by hand ------------------------------------------------------------------


def fixed32(field: int, value: int) -> bytes:
    return tag(field, 5) + struct.pack("<I", value)


def vfield(field: int, value: int) -> bytes:
    return tag(field, 0) + varint(value)


def kv(key: bytes, value: bytes) -> bytes:
    return ld(1, key) + ld(2, value)


def s_value(text: bytes) -> bytes:
    return ld(1, text)


def d_value(number: float) -> bytes:
    return tag(4, 1) + struct.pack("<d", number)


TRACE = bytes(range(1, 17))
START = NOW - 2 * SECOND
END = NOW - SECOND


def span_fields(name: bytes = b"op", span_id: bytes = b"\x11" * 8, attributes=(), events=(), extra=b"") -> list[bytes]:
    """The fields of a valid span, one encoded field per item (reorder or repeat them at will)."""
    return [ld(1, TRACE), ld(2, span_id), ld(4, b"\x22" * 8), ld(5, name), vfield(6, 2), fixed64(7, START),
            fixed64(8, END), *(ld(9, a) for a in attributes), *(ld(11, e) for e in events),
            ld(15, ld(2, b"fine") + vfield(3, 1)), extra]


def event_bytes(attributes=(), name: bytes = b"ev") -> bytes:
    return fixed64(1, NOW - 1_500_000_000) + ld(2, name) + b"".join(ld(3, a) for a in attributes)


SERVICE = (kv(b"service.name", s_value(b"svc")),)


def request_bytes(spans, resource_attributes=SERVICE, scope: bytes = ld(1, b"scope")) -> bytes:
    resource = b"".join(ld(1, a) for a in resource_attributes)
    scope_spans = ld(1, scope) + b"".join(ld(2, s if isinstance(s, bytes) else b"".join(s)) for s in spans)
    return ld(1, ld(1, resource) + ld(2, scope_spans))


GOOD_ATTRIBUTES = (kv(b"a", s_value(b"text")), kv(b"n", vfield(3, 42)), kv(b"d", d_value(0.25)),
                   kv(b"b", vfield(2, 1)), kv(b"arr", ld(5, ld(1, vfield(3, 1)) + ld(1, s_value(b"x")))))


def good_span(**overrides) -> bytes:
    return b"".join(span_fields(attributes=GOOD_ATTRIBUTES, events=[event_bytes(GOOD_ATTRIBUTES[:2])], **overrides))


def with_attributes(*attributes: bytes) -> bytes:
    """A request of one span with these (encoded KeyValue) attributes."""
    return request_bytes([span_fields(attributes=attributes)])
