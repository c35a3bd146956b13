"""The C fast path of OTLP/protobuf decoding (ingest._otlp_fast) against the Python decoder.

`decode_protobuf_fast` returns None for a payload outside its subset (the Python decoder then
handles it) and otherwise exactly what `decode_protobuf` returns for the same bytes: the same
SpanViews (attribute dicts in the same key order, one resource dict shared by the spans of one
ResourceSpans), the same dropped counts, nothing rejected or truncated, and a spool record from
`build_record` byte-identical to the one built from the Python decoder's output. No mocks: the real
extension against the real decoder, on the benchmark payloads, on generated requests (hypothesis),
on hand-encoded wire variants, on payloads outside the subset and on corrupted payloads.

INGEST_FAST_DECODER=false (the platform setting that turns the fast path off, e.g. on a machine with
no C compiler) skips this module; otherwise a missing or broken extension fails it.
"""
from __future__ import annotations

import dataclasses
import os
import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ingest.limits import MalformedPayload
from ingest.otlp import FAST_DECODER_AVAILABLE, Decoded, Limits, decode_protobuf, decode_protobuf_fast
from ingest.service import build_record
from observatory.bench.payloads import chain_batch
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from otlp_payloads import fixed64, ld, tag, varint
from tenancy.keys import IngestIdentity

from collectors.base import SpanEvent, SpanView

if os.environ.get("INGEST_FAST_DECODER", "").strip().lower() in {"0", "false", "no", "off"}:
    pytest.skip("the C fast decoder is turned off (INGEST_FAST_DECODER)", allow_module_level=True)

NOW = 1_750_000_000_123_456_789  # every decode here is at this instant
SECOND = 1_000_000_000
IDENTITY = IngestIdentity(project_id=123_456, retention_days=45)
OTHER_IDENTITY = IngestIdentity(project_id=7, retention_days=3650)

DEFAULT = Limits()
SMALL = Limits(max_attributes=4, max_events=2, max_value_bytes=64)
TINY = Limits(max_attributes=1, max_events=1, max_value_bytes=1, max_age_s=60, max_future_s=0, max_duration_s=1)
LIMITS = [DEFAULT, SMALL, TINY]


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


# -- 1. the extension is built -------------------------------------------------------------------------


def test_the_fast_decoder_is_built_and_imported():
    # A missing or broken extension must fail the suite, not quietly leave ingest on the slow path.
    assert FAST_DECODER_AVAILABLE is True
    import ingest._otlp_fast  # noqa: F401


# -- 2. the benchmark payloads -------------------------------------------------------------------------


@pytest.mark.parametrize("traces,seed", [(1, 1), (7, 2), (40, 3)])
def test_benchmark_payloads_decode_exactly_like_python(traces, seed):
    data, trace_ids = chain_batch(traces, random.Random(seed), base_ns=NOW - 60 * SECOND)
    py = decode_protobuf(data, DEFAULT, NOW)
    assert len(py.spans) == 3 * traces and not py.rejected and not py.truncated
    first = decode_protobuf_fast(data, DEFAULT, NOW)
    assert first is not None, "a benchmark payload is inside the fast subset"
    assert_fast_matches(first, py)
    assert_same_records(first, py, OTHER_IDENTITY)
    # Three ResourceSpans (client, gateway, engine): the spans of each share its resource dict.
    assert len({id(span.resource) for span in first.spans}) == 3
    assert sorted({span.trace_id for span in first.spans}) == sorted(trace_ids)
    # Decoding the same bytes again (warm caches, if any) gives the same, in objects of its own.
    again = decode_protobuf_fast(data, DEFAULT, NOW)
    assert_fast_matches(again, decode_protobuf(data, DEFAULT, NOW))
    assert_no_aliasing(again, first)


def test_benchmark_payload_without_an_explicit_now():
    data, _ = chain_batch(5, random.Random(9))  # spans of a minute ago; both decoders read the clock
    fast = decode_protobuf_fast(data, DEFAULT)
    assert fast is not None
    assert_fast_matches(fast, decode_protobuf(data, DEFAULT))


# -- 3. generated requests (hypothesis) ------------------------------------------------------------

# Characters JSON and UTF-8 encoders get wrong: controls, quotes, backslashes, the JavaScript line
# separators, BOM, noncharacters, the last code points of each UTF-8 length, astral planes.
SPECIAL_CHARS = ("\x00\x01\x07\x08\t\n\x0b\x0c\r\x1b\x1f\x20\"'/\\<>&\x7f\x80\x9f\xa0\xff\u0100\u07ff\u0800"
                 "\u2028\u2029\ufeff\ufffd\ufffe\uffff\U00010000\U0001f600\U0010fffd\U0010ffff")
CHARS = st.one_of(st.characters(codec="utf-8"), st.sampled_from(SPECIAL_CHARS))
SHORT_TEXT = st.text(CHARS, max_size=12)
UNITS = ("x", "\\", '"', "\x01", "é", "€", "\u2028", "\U0001f600")
KEYS = st.one_of(
    st.text(CHARS, min_size=1, max_size=12),
    st.sampled_from(["service.name", "gen_ai.operation.name", "gen_ai.request.model", "gen_ai.usage.input_tokens",
                     "gen_ai.usage.output_tokens", "gen_ai.latency.e2e", "gen_ai.latency.time_in_queue",
                     "http.response.status_code", "k" * 256, "é" * 128, "\U0001f600" * 64, "€" * 85 + "x"]),
)
INTS = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, -1, 127, 128, 2**31 - 1, -(2**31), 2**53 + 1, 2**63 - 1, -(2**63)]),
)


def double_from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


DOUBLES = st.one_of(
    st.floats(),  # NaN, ±inf, subnormals, -0.0 included
    st.sampled_from([0.0, -0.0, 0.1, 0.7, 1 / 3, 1.0, -1.0, 100.0, 123456789.125, 1e-7, 1e-6, 1e-5, 1e-4, 1e15,
                     1e16, 1e17, 1e21, 1e22, 1e23, 2.0**53, 2.0**63, -(2.0**63), 2.0**64, 5e-324,
                     2.225073858507201e-308, 2.2250738585072014e-308, 1.7976931348623157e308,
                     float("nan"), float("inf"), float("-inf"), double_from_bits(0xFFF8000000000000),
                     double_from_bits(0x7FF0000000000001)]),
    st.floats(1e-7, 1e-5), st.floats(-1e-5, -1e-7),
    st.floats(1e16, 1e22), st.floats(-1e22, -1e16),
    st.integers(0, 2**64 - 1).map(double_from_bits),
)


def sized_text(nbytes: int, unit: str) -> str:
    """Text of exactly `nbytes` UTF-8 bytes made of `unit` (padded with 'x')."""
    width = len(unit.encode())
    return unit * (nbytes // width) + "x" * (nbytes % width)


def fits(text: str, nbytes: int) -> str:
    return text.encode()[:nbytes].decode("utf-8", "ignore")


def string_values(limits: Limits, outside: bool = False):
    """Attribute strings the fast path must take (at most max(1024, max_value_bytes) bytes), or, with
    `outside`, longer ones (the Python decoder truncates those)."""
    top = max(1024, limits.max_value_bytes)
    if outside:
        return st.builds(sized_text, st.sampled_from([top + 1, top + 5, 2 * top]), st.sampled_from(UNITS))
    mvb = limits.max_value_bytes
    sizes = sorted({n for n in (0, 1, 63, 64, 65, 127, 128, 129, 1023, 1024, 16383, 16384, mvb - 1, mvb, mvb + 1)
                    if 0 <= n <= top})
    return st.one_of(SHORT_TEXT, SHORT_TEXT, st.builds(sized_text, st.sampled_from(sizes), st.sampled_from(UNITS)))


def fill(value, spec) -> None:
    """Set an AnyValue from a spec: (field, python value), ('empty', None), ('array', [specs]),
    ('kvlist', [(key, spec)]), ('strindex', n)."""
    kind, payload = spec
    if kind == "empty":
        value.SetInParent()
    elif kind == "array":
        value.array_value.SetInParent()
        for item in payload:
            fill(value.array_value.values.add(), item)
    elif kind == "kvlist":
        value.kvlist_value.SetInParent()
        for key, item in payload:
            fill(value.kvlist_value.values.add(key=key).value, item)
    elif kind == "strindex":
        value.string_value_strindex = payload
    else:
        setattr(value, kind, payload)


class Gen:
    """Draws one ExportTraceServiceRequest. `strict` requests hold only what the fast path must take;
    otherwise each choice may, now and then, step outside that subset (or onto ground the spec leaves
    open), and `inside` records whether the request is still certainly inside."""

    def __init__(self, draw, limits: Limits, strict: bool):
        self.draw = draw
        self.limits = limits
        self.strict = strict
        self.inside = True
        self.earliest = max(NOW - limits.max_age_s * SECOND, 1)
        self.latest = NOW + limits.max_future_s * SECOND
        self.max_duration = limits.max_duration_s * SECOND
        self.scalars = st.one_of(
            string_values(limits).map(lambda s: ("string_value", s)),
            INTS.map(lambda i: ("int_value", i)),
            DOUBLES.map(lambda d: ("double_value", d)),
            st.booleans().map(lambda b: ("bool_value", b)),
        )
        longest_array = min(limits.max_attributes + 3, 8)  # longer than max_attributes with small limits
        self.values = st.one_of(
            self.scalars, self.scalars, self.scalars,
            st.lists(self.scalars, max_size=longest_array).map(lambda items: ("array", items)),
            st.sampled_from([("empty", None), ("absent", None)]),
        )

    def outside(self) -> bool:
        """Whether to step outside the subset here (never in a strict request; then about 1 in 10)."""
        if self.strict or self.draw(st.integers(0, 9)) != 0:
            return False
        self.inside = False
        return True

    def text(self, max_bytes: int, chars: int = 12) -> str:
        return fits(self.draw(st.text(CHARS, max_size=chars)), max_bytes)

    def value(self):
        if not self.outside():
            return self.draw(self.values)
        limits = self.limits
        return self.draw(st.one_of(
            st.binary(max_size=8).map(lambda b: ("bytes_value", b)),
            st.lists(st.tuples(KEYS, self.scalars), max_size=3).map(lambda items: ("kvlist", items)),
            st.lists(st.one_of(self.scalars, st.just(("empty", None)), st.just(("array", [("int_value", 1)])),
                               st.just(("kvlist", [("k", ("bool_value", True))])),
                               st.just(("bytes_value", b"\x00"))), min_size=1, max_size=4)
            .map(lambda items: ("array", items)),
            st.just(("array", [("array", [])])),
            st.integers(0, 5).map(lambda n: ("strindex", n)),
            string_values(limits, outside=True).map(lambda s: ("string_value", s)),
        ))

    def attributes(self, repeated, taken: tuple = ()) -> None:
        """Attributes appended to `repeated`, which already holds the keys `taken`."""
        limits = self.limits
        count = self.draw(st.integers(0, min(limits.max_attributes - len(taken), 5)))
        keys = [key for key in self.draw(st.lists(KEYS, min_size=count, max_size=count, unique=True))
                if key not in taken]
        entries = [(key, self.value()) for key in keys]
        if self.outside():
            problem = self.draw(st.sampled_from(["duplicate", "empty key", "long key", "too many", "strindex key"]))
            if problem == "duplicate" and entries:
                at = self.draw(st.integers(0, len(entries)))
                entries.insert(at, (self.draw(st.sampled_from(keys)), self.value()))
            elif problem == "empty key":
                entries.append(("", self.draw(self.values)))
            elif problem == "long key":
                key = self.draw(st.sampled_from(["k" * 257, "é" * 129, "\U0001f600" * 65]))
                entries.append((key, ("int_value", 1)))
            elif problem == "too many":
                entries += [(f"extra.{i}", ("int_value", i)) for i in range(limits.max_attributes + 1 - len(entries))]
            else:
                repeated.add().key_strindex = 3
        for key, spec in entries:
            kv = repeated.add(key=key)
            if spec[0] != "absent":
                fill(kv.value, spec)

    def id_bytes(self, size: int) -> bytes:
        raw = self.draw(st.binary(min_size=size, max_size=size))
        return raw if any(raw) else b"\x01" + raw[1:]

    def span(self, spans) -> None:
        draw, limits = self.draw, self.limits
        span = spans.add()
        span.trace_id = self.id_bytes(16)
        span.span_id = self.id_bytes(8)
        span.parent_span_id = draw(st.sampled_from([b"", b"\x00" * 8, None])) or (
            self.id_bytes(8) if draw(st.booleans()) else b"")
        span.name = self.text(1024) if draw(st.integers(0, 5)) else sized_text(draw(st.sampled_from([1023, 1024])),
                                                                              draw(st.sampled_from(UNITS)))
        span.kind = draw(st.integers(0, 5))
        start = draw(st.one_of(st.integers(self.earliest, self.latest),
                               st.sampled_from([self.earliest, self.latest, NOW])))
        span.start_time_unix_nano = start
        span.end_time_unix_nano = start + draw(st.one_of(st.integers(0, self.max_duration),
                                                         st.sampled_from([0, 1, self.max_duration])))
        self.attributes(span.attributes)
        span.dropped_attributes_count = draw(st.sampled_from([0, 0, 1, 2**32 - 1]))
        for _ in range(draw(st.integers(0, min(limits.max_events, 3)))):
            event = span.events.add(name=self.text(limits.max_value_bytes))
            event.time_unix_nano = draw(st.one_of(st.sampled_from([0, 1, start, 2**63 - 1, 2**63, 2**64 - 1]),
                                                  st.integers(0, 2**64 - 1)))
            self.attributes(event.attributes)
            event.dropped_attributes_count = draw(st.sampled_from([0, 3]))
        for _ in range(draw(st.integers(0, min(limits.max_events, 3)))):
            link = span.links.add(trace_id=self.id_bytes(16), span_id=self.id_bytes(8))
            link.trace_state = self.text(40)
            self.attributes(link.attributes)
            link.dropped_attributes_count = draw(st.sampled_from([0, 5]))
            link.flags = draw(st.sampled_from([0, 1, 0x301, 2**32 - 1]))
        if draw(st.booleans()):
            span.status.code = draw(st.integers(0, 2))
            span.status.message = self.text(limits.max_value_bytes)
        span.trace_state = self.text(40)
        span.flags = draw(st.sampled_from([0, 1, 0x100, 0x301, 2**32 - 1]))
        span.dropped_events_count = draw(st.sampled_from([0, 7]))
        span.dropped_links_count = draw(st.sampled_from([0, 9]))
        if self.outside():
            self.spoil(span)

    def spoil(self, span) -> None:
        """Something the spec leaves open or puts outside the subset: a span the Python decoder rejects
        or trims, an enum out of range, more events or links than max_events, odd link ids..."""
        draw, limits = self.draw, self.limits
        problem = draw(st.sampled_from([
            "zero trace", "zero span", "short trace", "long span", "short parent", "no start", "backwards",
            "too old", "too new", "too long", "long name", "long event name", "long status", "kind", "code",
            "events", "links", "link ids", "long trace_state",
        ]))
        if problem == "zero trace":
            span.trace_id = b"\x00" * 16
        elif problem == "zero span":
            span.span_id = b"\x00" * 8
        elif problem == "short trace":
            span.trace_id = span.trace_id[:15]
        elif problem == "long span":
            span.span_id += b"\x01"
        elif problem == "short parent":
            span.parent_span_id = b"\x01\x02\x03\x04"
        elif problem == "no start":
            span.start_time_unix_nano = 0
        elif problem == "backwards":
            span.end_time_unix_nano = span.start_time_unix_nano - 1
        elif problem == "too old":
            span.start_time_unix_nano = self.earliest - 1
        elif problem == "too new":
            span.start_time_unix_nano = span.end_time_unix_nano = self.latest + 1
        elif problem == "too long":
            span.end_time_unix_nano = span.start_time_unix_nano + self.max_duration + 1
        elif problem == "long name":
            span.name = sized_text(draw(st.sampled_from([1025, 1100, 5000])), draw(st.sampled_from(UNITS)))
        elif problem == "long event name":
            span.events.add(name=sized_text(limits.max_value_bytes + 1, draw(st.sampled_from(UNITS))))
        elif problem == "long status":
            span.status.message = sized_text(limits.max_value_bytes + draw(st.integers(1, 3)), "é")
        elif problem == "kind":
            span.kind = draw(st.sampled_from([-1, 6, 7, 2**31 - 1, -(2**31)]))
        elif problem == "code":
            span.status.code = draw(st.sampled_from([-1, 3, 2**31 - 1]))
        elif problem == "events":
            for _ in range(limits.max_events + 1 - len(span.events)):
                span.events.add(name="e", time_unix_nano=NOW)
        elif problem == "links":
            for _ in range(limits.max_events + 1 - len(span.links)):
                span.links.add(trace_id=self.id_bytes(16), span_id=self.id_bytes(8))
        elif problem == "link ids":
            span.links.add(trace_id=draw(st.binary(max_size=20)), span_id=draw(st.binary(max_size=10)))
        else:
            span.trace_state = sized_text(draw(st.sampled_from([1025, 20000])), "x")

    def request(self) -> ExportTraceServiceRequest:
        draw = self.draw
        request = ExportTraceServiceRequest()
        for _ in range(draw(st.integers(0, 3))):
            rs = request.resource_spans.add()
            shape = draw(st.sampled_from(["absent", "empty", "attributes", "attributes"]))
            if shape == "empty":
                rs.resource.SetInParent()
            elif shape == "attributes":
                taken = ()
                if draw(st.booleans()):
                    rs.resource.attributes.add(key="service.name").value.string_value = self.text(30, 30)
                    taken = ("service.name",)
                self.attributes(rs.resource.attributes, taken)
                rs.resource.dropped_attributes_count = draw(st.sampled_from([0, 4]))
            if self.outside():
                rs.resource.entity_refs.add(type="service", id_keys=["service.name"])
            rs.schema_url = self.text(40)
            for _ in range(draw(st.integers(0, 2))):
                ss = rs.scope_spans.add()
                if draw(st.booleans()):
                    ss.scope.name = self.text(80, 30)
                    ss.scope.version = self.text(40)
                    self.attributes(ss.scope.attributes)
                    ss.scope.dropped_attributes_count = draw(st.sampled_from([0, 2]))
                ss.schema_url = self.text(40)
                for _ in range(draw(st.integers(0, 3))):
                    self.span(ss.spans)
        return request


# The wire layout of the OTLP trace messages: field number -> (kind, repeated). Used to re-encode a
# serialized request the unusual ways protobuf allows.
MESSAGES = {
    "Request": {1: ("ResourceSpans", True)},
    "ResourceSpans": {1: ("Resource", False), 2: ("ScopeSpans", True), 3: ("string", False)},
    "Resource": {1: ("KeyValue", True), 2: ("varint", False), 3: ("bytes", True)},
    "ScopeSpans": {1: ("Scope", False), 2: ("Span", True), 3: ("string", False)},
    "Scope": {1: ("string", False), 2: ("string", False), 3: ("KeyValue", True), 4: ("varint", False)},
    "Span": {1: ("id", False), 2: ("id", False), 3: ("string", False), 4: ("id", False), 5: ("string", False),
             6: ("varint", False), 7: ("fixed64", False), 8: ("fixed64", False), 9: ("KeyValue", True),
             10: ("varint", False), 11: ("Event", True), 12: ("varint", False), 13: ("Link", True),
             14: ("varint", False), 15: ("Status", False), 16: ("fixed32", False)},
    "Event": {1: ("fixed64", False), 2: ("string", False), 3: ("KeyValue", True), 4: ("varint", False)},
    "Link": {1: ("id", False), 2: ("id", False), 3: ("string", False), 4: ("KeyValue", True), 5: ("varint", False),
             6: ("fixed32", False)},
    "Status": {2: ("string", False), 3: ("varint", False)},
    "KeyValue": {1: ("string", False), 2: ("AnyValue", False), 3: ("varint", False)},
    "AnyValue": {1: ("string", False), 2: ("varint", False), 3: ("varint", False), 4: ("fixed64", False),
                 5: ("ArrayValue", False), 6: ("KeyValueList", False), 7: ("bytes", False), 8: ("varint", False)},
    "ArrayValue": {1: ("AnyValue", True)},
    "KeyValueList": {1: ("KeyValue", True)},
}
WIRE = {"varint": 0, "fixed64": 1, "fixed32": 5}


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def read_fields(data: bytes) -> list[tuple[int, int, bytes]]:
    """(field number, wire type, payload) of a well-formed message; varints stay encoded."""
    fields = []
    pos = 0
    while pos < len(data):
        key, pos = read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            start = pos
            _, pos = read_varint(data, pos)
            fields.append((number, wire, data[start:pos]))
            continue
        if wire == 2:
            size, pos = read_varint(data, pos)
        else:
            size = 8 if wire == 1 else 4
        fields.append((number, wire, data[pos:pos + size]))
        pos += size
    return fields


@dataclasses.dataclass
class Rewrite:
    """How to re-encode: `shuffle` interleaves different fields at random (a repeated field keeps its
    order), `decoys` precedes singular scalar fields with another occurrence (the last one wins). Both
    stay inside the fast subset. Outside it: decoys in AnyValue (another oneof member first), a
    singular sub-message sent twice (merged), padded length varints, unknown fields."""

    rng: random.Random
    shuffle: bool = False
    decoys: bool = False
    value_decoys: bool = False
    split_messages: bool = False
    padded_lengths: bool = False
    unknown_fields: bool = False

    def decoy(self, message: str, kind: str, payload: bytes) -> bytes | None:
        rng = self.rng
        if kind == "string":
            return rng.choice([b"", b"decoy", "é€".encode()])
        if kind == "id":
            return rng.randbytes(len(payload))
        if kind == "varint":
            return varint(rng.randrange(6) if message in ("Span", "Status") else rng.randrange(1 << 32))
        if kind == "fixed64":
            return rng.randbytes(8)
        if kind == "fixed32":
            return rng.randbytes(4)
        return None

    def encode(self, number: int, wire: int, payload: bytes) -> bytes:
        if wire != 2:
            return tag(number, wire) + payload
        length = varint(len(payload))
        if self.padded_lengths and self.rng.random() < 0.3:
            length = length[:-1] + bytes([length[-1] | 0x80, 0])
        return tag(number, 2) + length + payload

    def message(self, name: str, data: bytes) -> bytes:
        rng = self.rng
        schema = MESSAGES[name]
        fields = []
        for number, wire, payload in read_fields(data):
            kind, repeated = schema.get(number, ("unknown", False))
            if kind in MESSAGES:
                payload = self.message(kind, payload)
                if self.split_messages and not repeated and rng.random() < 0.2:
                    fields.append((number, 2, b""))  # an empty first occurrence: merged into the second
            elif not repeated and rng.random() < 0.3:
                decoy = None
                if name == "AnyValue":
                    if self.value_decoys:
                        decoy_number = rng.choice([1, 2, 3, 4])
                        fields.append((decoy_number, [2, 0, 0, 1][decoy_number - 1],
                                       [b"decoy", b"\x01", varint(-5), struct.pack("<d", -2.5)][decoy_number - 1]))
                elif self.decoys:
                    decoy = self.decoy(name, kind, payload)
                if decoy is not None:
                    fields.append((number, wire, decoy))
            fields.append((number, wire, payload))
        if self.unknown_fields and rng.random() < 0.2:
            fields.append((rng.choice([17, 50, 1000]), 0, varint(rng.randrange(300))))
        if self.shuffle:
            groups: dict[int, list] = {}
            for field in fields:
                groups.setdefault(field[0], []).append(field)
            fields = []
            while groups:
                number = rng.choice(list(groups))
                fields.append(groups[number].pop(0))
                if not groups[number]:
                    del groups[number]
        return b"".join(self.encode(*field) for field in fields)


@st.composite
def generated_requests(draw):
    """(payload bytes, limits, certainly inside the fast subset)."""
    limits = draw(st.sampled_from(LIMITS))
    strict = draw(st.sampled_from([True, True, False]))
    gen = Gen(draw, limits, strict)
    data = gen.request().SerializeToString()
    rewrite = Rewrite(random.Random(draw(st.integers(0, 2**32))), shuffle=draw(st.booleans()),
                      decoys=draw(st.booleans()))
    if not strict and draw(st.integers(0, 2)) == 0:
        rewrite.value_decoys, rewrite.split_messages, rewrite.padded_lengths, rewrite.unknown_fields = (
            draw(st.booleans()) for _ in range(4))
        gen.inside = False
    if rewrite.shuffle or rewrite.decoys or not gen.inside:
        data = rewrite.message("Request", data)
    return data, limits, gen.inside


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(generated_requests())
def test_generated_requests_decode_exactly_like_python(case):
    data, limits, inside = case
    fast = decode_protobuf_fast(data, limits, NOW)
    if inside:
        # The generator's own check: the Python decoder takes the whole request without trimming.
        py = decode_protobuf(data, limits, NOW)
        assert not py.rejected and not py.truncated, (dict(py.rejected), py.truncated)
        assert fast is not None, "a request inside the fast subset was declined"
    if fast is not None:
        try:
            py = decode_protobuf(data, limits, NOW)
        except MalformedPayload as exc:
            pytest.fail(f"the fast path decoded a payload the Python decoder calls malformed ({exc})")
        assert_fast_matches(fast, py)


# -- 4. unusual but valid encodings, by hand --------------------------------------------------------


def shuffled(fields: list[bytes]) -> bytes:
    return b"".join(reversed(fields))


def _out_of_order() -> bytes:
    # Every message with its fields reversed: request, resource spans, scope spans, span, event, status,
    # key/value, value (an array's items keep their order).
    kvs = [ld(2, d_value(1.5)) + ld(1, b"d"), ld(2, s_value(b"v")) + ld(1, b"s"),
           ld(2, ld(5, ld(1, vfield(3, 1)) + ld(1, vfield(3, 2)))) + ld(1, b"arr")]
    event = ld(3, kvs[0]) + ld(2, b"ev") + fixed64(1, NOW - 1_500_000_000)
    fields = span_fields(attributes=kvs, events=[event])
    fields[-2] = ld(15, vfield(3, 2) + ld(2, b"boom"))
    span = shuffled(fields)
    scope_spans = ld(2, span) + ld(1, ld(2, b"1.0") + ld(1, b"scope"))
    resource = ld(1, ld(2, s_value(b"svc")) + ld(1, b"service.name"))
    return ld(1, ld(2, scope_spans) + ld(1, resource))


def _without_name() -> list[bytes]:
    fields = span_fields()
    del fields[3]
    return fields


def _repeated(field: bytes, *before: bytes) -> bytes:
    """A good span with earlier occurrences of one singular field: the last one wins."""
    return request_bytes([b"".join(before) + good_span() + field])


MUST_DECODE = {
    "fields out of order": _out_of_order(),
    "a repeated name (the last wins)": request_bytes([ld(5, b"first") + good_span(name=b"second")]),
    "the name after the other fields, repeated": request_bytes([_without_name() + [ld(5, b"first"), ld(5, b"last")]]),
    "repeated ids and times (the last wins)": _repeated(ld(1, bytes(range(101, 117))) + ld(2, b"\x33" * 8),
                                                        fixed64(7, NOW), fixed64(8, NOW)),
    "a repeated kind": _repeated(vfield(6, 4), vfield(6, 1)),
    "a repeated key (the last wins)": with_attributes(ld(1, b"first") + kv(b"k", s_value(b"v"))),
    "a repeated event time and name": request_bytes([span_fields(events=[
        fixed64(1, 5) + ld(2, b"x") + event_bytes() + fixed64(1, NOW)])]),
    "a key/value with the value first": request_bytes([span_fields(attributes=[
        ld(2, s_value(b"v")) + ld(1, b"k"), ld(2, vfield(3, 7)) + ld(1, b"n")])]),
    "a negative int as a 10-byte varint": request_bytes([span_fields(attributes=[
        kv(b"neg", vfield(3, -5)), kv(b"min", vfield(3, -(2**63))), kv(b"minus one", vfield(3, -1))])]),
    "a bool from varint 2": request_bytes([span_fields(attributes=[kv(b"b", vfield(2, 2)), kv(b"f", vfield(2, 0))])]),
    "an int of 2**64 - 1 as a 10-byte varint": request_bytes([span_fields(attributes=[
        kv(b"n", tag(3, 0) + b"\xff" * 9 + b"\x01")])]),
    "a repeated string value (the last wins)": request_bytes([span_fields(attributes=[
        kv(b"s", s_value(b"first") + s_value(b"last"))])]),
    "empty values: absent, empty, empty array": request_bytes([span_fields(attributes=[
        ld(1, b"absent"), kv(b"empty", b""), kv(b"empty array", ld(5, b"")), kv(b"empty string", s_value(b"")),
        kv(b"zero", vfield(3, 0)), kv(b"false", vfield(2, 0)), kv(b"0.0", d_value(0.0))])]),
    "doubles that are not JSON numbers": request_bytes([span_fields(attributes=[
        kv(b"nan", d_value(float("nan"))), kv(b"inf", d_value(float("inf"))), kv(b"-inf", d_value(float("-inf"))),
        kv(b"-nan", tag(4, 1) + struct.pack("<Q", 0xFFF8000000000001)), kv(b"-0", d_value(-0.0)),
        kv(b"arr", ld(5, ld(1, d_value(float("nan"))) + ld(1, d_value(-0.0)) + ld(1, d_value(1e22))))])]),
    "a zero parent, a root span and kinds 0..5": request_bytes([
        span_fields(span_id=bytes([i + 1]) * 8)[:2] + [ld(4, b"\x00" * 8) if i % 2 else b"", ld(5, b"op"),
                                                       vfield(6, i)] + span_fields()[5:] for i in range(6)]),
    "several resources and scopes": request_bytes([good_span()]) + request_bytes(
        [good_span(), good_span()], resource_attributes=()) + ld(1, b"") + request_bytes([good_span()], scope=b""),
}

MAY_DECODE = {  # valid protobuf the fast path may decline; when it decodes, it decodes like Python
    "an empty request": b"",
    "a resource spans without spans": ld(1, ld(1, ld(1, kv(b"k", s_value(b"v"))))),
    "a non-minimal varint length": with_attributes(ld(1, b"k") + b"\x12\x83\x00" + s_value(b"v")),
    "a bool from a 3-byte varint": request_bytes([span_fields(attributes=[kv(b"b", tag(2, 0) + b"\x80\x80\x01")])]),
    "an empty value inside an array": request_bytes([span_fields(attributes=[
        kv(b"k", ld(5, ld(1, vfield(3, 1)) + ld(1, b"") + ld(1, s_value(b"x"))))])]),
    "a non-minimal int": request_bytes([span_fields(attributes=[kv(b"n", tag(3, 0) + b"\x81\x80\x00")])]),
    "an int beyond 64 bits (truncated like upb)": request_bytes([span_fields(attributes=[
        kv(b"n", tag(3, 0) + b"\xff" * 9 + b"\x7f")])]),
    "two oneof members (the last wins)": request_bytes([span_fields(attributes=[
        kv(b"a", s_value(b"x") + vfield(3, 5)), kv(b"b", vfield(3, 5) + s_value(b"x")),
        kv(b"c", d_value(2.5) + vfield(2, 1))])]),
    "two arrays in one value (merged)": request_bytes([span_fields(attributes=[
        kv(b"k", ld(5, ld(1, s_value(b"a")))) + ld(2, ld(5, ld(1, s_value(b"b"))))])]),
    "a status sent twice (merged)": request_bytes([good_span() + ld(15, vfield(3, 2))]),
    "a resource sent twice (merged)": ld(1, ld(1, ld(1, kv(b"a", vfield(3, 1)))) + ld(1, ld(1, kv(b"b", vfield(3, 2))))
                                        + ld(2, ld(2, good_span()))),
    "kind and status code out of range": request_bytes([span_fields()[:5] + [vfield(6, 9)] + span_fields()[5:-2]
                                                        + [ld(15, vfield(3, -1))]]),
    "odd link ids": request_bytes([good_span() + ld(13, ld(1, b"\x01\x02") + ld(2, b""))]),
    "more links than max_events (cut)": request_bytes([good_span() + b"".join(
        ld(13, ld(1, TRACE) + ld(2, bytes([i]) * 8)) for i in range(1, 200))]),
    "an array longer than max_attributes (cut)": request_bytes([span_fields(attributes=[
        kv(b"long", ld(5, b"".join(ld(1, vfield(3, i)) for i in range(300))))])]),
    "a wrong wire type for a known field": request_bytes([good_span() + vfield(5, 3)]),
}


@pytest.mark.parametrize("name", MUST_DECODE)
def test_unusual_but_valid_encodings_are_decoded_like_python(name):
    data = MUST_DECODE[name]
    py = decode_protobuf(data, DEFAULT, NOW)
    assert py.spans and not py.rejected and not py.truncated  # (the case is what it claims to be)
    fast = check(data)
    assert fast is not None, f"{name}: inside the fast subset, yet declined"


@pytest.mark.parametrize("name", MAY_DECODE)
def test_other_valid_encodings_are_declined_or_decoded_like_python(name):
    for limits in LIMITS:
        check(MAY_DECODE[name], limits)


def test_the_hand_made_cases_say_what_they_claim():
    spans = decode_protobuf(MUST_DECODE["a repeated name (the last wins)"], DEFAULT, NOW).spans
    assert spans[0].name == "second"
    attributes = decode_protobuf(MUST_DECODE["a negative int as a 10-byte varint"], DEFAULT, NOW).spans[0].attributes
    assert attributes == {"neg": -5, "min": -(2**63), "minus one": -1}
    attributes = decode_protobuf(MUST_DECODE["a bool from varint 2"], DEFAULT, NOW).spans[0].attributes
    assert attributes == {"b": True, "f": False}
    span = decode_protobuf(MUST_DECODE["repeated ids and times (the last wins)"], DEFAULT, NOW).spans[0]
    assert (span.trace_id, span.span_id, span.start_ns) == (bytes(range(101, 117)).hex(), "33" * 8, START)
    span = decode_protobuf(MUST_DECODE["fields out of order"], DEFAULT, NOW).spans[0]
    # (the span's fields reversed: its attributes, a repeated field, come in reverse order too)
    assert list(span.attributes) == ["arr", "s", "d"] and span.status_code == 2 and span.scope_version == "1.0"


# -- 5. payloads outside the subset: declined, and the Python decoder unaffected -----------------------


def _bad_link_attribute() -> bytes:
    span = Span.FromString(good_span())
    link = span.links.add(trace_id=os.urandom(16), span_id=os.urandom(8))
    link.attributes.add(key="note").value.string_value = "PLACEHOLDER"
    return request_bytes([span.SerializeToString().replace(b"PLACEHOLDER", b"\xff" * 11), good_span()])


GOOD_DATA, _ = chain_batch(2, random.Random(5), base_ns=NOW - 60 * SECOND)
REJECTED_SPAN = {"invalid UTF-8 or malformed span": 1}


def rejected(expected: dict):
    return lambda py: dict(py.rejected) == expected


def truncated(py) -> bool:
    return py.truncated > 0 and not py.rejected


def accepted(py) -> bool:
    return bool(py.spans) and not py.rejected and not py.truncated


OUTSIDE = {  # name: (payload, limits, what the Python decoder says of it)
    "bad UTF-8 in an attribute value": (
        request_bytes([good_span(), span_fields(attributes=[kv(b"k", s_value(b"\xff"))])]), DEFAULT,
        rejected(REJECTED_SPAN)),
    "bad UTF-8 in an attribute key": (
        request_bytes([good_span(), span_fields(attributes=[kv(b"\xc3\x28", vfield(3, 1))])]), DEFAULT,
        rejected(REJECTED_SPAN)),
    "bad UTF-8 in an array item": (with_attributes(kv(b"k", ld(5, ld(1, s_value(b"\xed\xa0\x80"))))), DEFAULT,
                                   rejected(REJECTED_SPAN)),
    "bad UTF-8 in an event attribute": (
        request_bytes([span_fields(events=[event_bytes([kv(b"k", s_value(b"\xf4\x90\x80\x80"))])])]), DEFAULT,
        rejected(REJECTED_SPAN)),
    "bad UTF-8 in a resource attribute": (
        request_bytes([good_span()], resource_attributes=[kv(b"k", s_value(b"\xff"))]), DEFAULT,
        rejected({"invalid UTF-8 or malformed resource/scope": 1})),
    "bad UTF-8 in a scope name": (request_bytes([good_span()], scope=ld(1, b"sc\xffope")),
                                  DEFAULT, rejected({"invalid UTF-8 or malformed resource/scope": 1})),
    "bad UTF-8 in a scope attribute": (
        request_bytes([good_span()], scope=ld(1, b"s") + ld(3, kv(b"k", s_value(b"\xff")))), DEFAULT,
        rejected({"invalid UTF-8 or malformed resource/scope": 1})),
    "bad UTF-8 in a link attribute": (_bad_link_attribute(), DEFAULT, rejected(REJECTED_SPAN)),
    "bad UTF-8 in a span name": (request_bytes([good_span(name=b"\xff"), good_span()]), DEFAULT,
                                 rejected(REJECTED_SPAN)),
    "bad UTF-8 in a status message": (request_bytes([good_span() + ld(15, ld(2, b"\xc0\xaf"))]), DEFAULT,
                                      rejected(REJECTED_SPAN)),
    "bad UTF-8 in trace_state": (request_bytes([good_span() + ld(3, b"\xff")]), DEFAULT, rejected(REJECTED_SPAN)),
    "a bytes value": (request_bytes([span_fields(attributes=[kv(b"k", ld(7, b"\x00\xff"))])]), DEFAULT, accepted),
    "a kvlist value": (request_bytes([span_fields(attributes=[kv(b"k", ld(6, ld(1, kv(b"inner", vfield(3, 1)))))])]),
                       DEFAULT, accepted),
    "a nested array": (request_bytes([span_fields(attributes=[kv(b"k", ld(5, ld(1, ld(5, ld(1, vfield(3, 1))))))])]),
                       DEFAULT, accepted),
    "a duplicate key": (request_bytes([span_fields(attributes=[kv(b"k", vfield(3, 1)), kv(b"j", vfield(3, 2)),
                                                               kv(b"k", s_value(b"last"))])]), DEFAULT, accepted),
    "a duplicate resource key": (request_bytes([good_span()], resource_attributes=[kv(b"k", vfield(3, 1)),
                                                                                   kv(b"k", vfield(3, 2))]),
                                 DEFAULT, accepted),
    "an empty key": (request_bytes([span_fields(attributes=[kv(b"", vfield(3, 1)), kv(b"k", vfield(3, 2))])]),
                     DEFAULT, truncated),
    "a key of 257 bytes": (request_bytes([span_fields(attributes=[kv(b"k" * 257, vfield(3, 1))])]), DEFAULT, truncated),
    "an unknown field in a span": (request_bytes([good_span(extra=vfield(50, 1))]), DEFAULT, accepted),
    "an unknown field in a key/value": (with_attributes(kv(b"k", vfield(3, 1)) + vfield(9, 1)), DEFAULT, accepted),
    "an all-zero trace id": (request_bytes([good_span(), ld(1, b"\x00" * 16) + good_span()[18:]]), DEFAULT,
                             rejected({"invalid trace or span id": 1})),
    "an all-zero span id": (request_bytes([good_span(), good_span() + ld(2, b"\x00" * 8)]), DEFAULT,
                            rejected({"invalid trace or span id": 1})),
    "a 15-byte trace id": (request_bytes([good_span() + ld(1, b"\x01" * 15)]), DEFAULT,
                           rejected({"invalid trace or span id": 1})),
    "a 4-byte parent": (request_bytes([good_span() + ld(4, b"\x01" * 4)]), DEFAULT,
                        rejected({"invalid trace or span id": 1})),
    "a span ending before it starts": (request_bytes([good_span(), good_span() + fixed64(8, START - 1)]), DEFAULT,
                                       rejected({"end time before start time": 1})),
    "a span without a start": (request_bytes([good_span() + fixed64(7, 0)]), DEFAULT,
                               rejected({"missing start or end time": 1})),
    "a span too old": (request_bytes([good_span() + fixed64(7, NOW - 8 * 86400 * SECOND)]), DEFAULT,
                       rejected({"start time outside the accepted window": 1})),
    "a span too long": (request_bytes([good_span() + fixed64(8, START + 86400 * SECOND + 1)]), DEFAULT,
                        rejected({"duration exceeds the limit": 1})),
    "too many attributes for the limits": (request_bytes([good_span()]), SMALL, truncated),
    "too many resource attributes": (request_bytes([span_fields()], resource_attributes=[
        kv(b"r%d" % i, vfield(3, i)) for i in range(5)]), SMALL, truncated),
    "too many events": (request_bytes([span_fields(events=[event_bytes()] * 3)]), SMALL, truncated),
    "a string longer than max_value_bytes": (request_bytes([span_fields(attributes=[kv(b"k", s_value(b"x" * 2000))])]),
                                             SMALL, truncated),
    "a string longer than the default limit": (request_bytes([span_fields(attributes=[
        kv(b"k", s_value("€".encode() * 6000))])]), DEFAULT, truncated),
    "a long string in an array": (with_attributes(kv(b"k", ld(5, ld(1, s_value(b"y" * 1100))))), SMALL, truncated),
    "a long event name": (request_bytes([span_fields(events=[event_bytes(name=b"e" * 65)])]), SMALL, truncated),
    # (cut to 1024 characters, not counted as truncated: see _pb_spans)
    "a span name over 1024 bytes": (request_bytes([good_span(name=b"n" * 1500)]), DEFAULT,
                                    lambda py: py.spans[0].name == "n" * 1024 and not py.truncated),
    "a truncated payload": (GOOD_DATA[:-7], DEFAULT, lambda py: True),
    "a truncated span": (request_bytes([good_span()])[:-3], DEFAULT, lambda py: True),
    "a length past the end": (GOOD_DATA[:3] + b"\xff\xff\x03" + GOOD_DATA[6:], DEFAULT, lambda py: True),
    "a bad wire type": (request_bytes([good_span() + b"\x0f"]), DEFAULT, lambda py: True),
}


@pytest.mark.parametrize("name", OUTSIDE)
def test_payloads_outside_the_subset_are_declined_and_left_to_python(name):
    data, limits, says = OUTSIDE[name]
    before, py = python_outcome(data, limits)
    if py is not None:
        assert says(py), f"{name}: the case does not test what it claims: {before}"
    assert decode_protobuf_fast(data, limits, NOW) is None
    after, _ = python_outcome(data, limits)
    assert after == before, "decoding with the fast path changed what the Python decoder makes of the payload"


def test_declining_leaves_the_python_decoder_unchanged_for_good_payloads_too():
    # Whatever the fast path caches, the Python decoder's result on the next payload is its own.
    good = request_bytes([good_span()])
    before, _ = python_outcome(good, DEFAULT)
    for data, limits, _ in OUTSIDE.values():
        decode_protobuf_fast(data, limits, NOW)
        check(good)
    assert python_outcome(good, DEFAULT)[0] == before


# -- 6. corrupted payloads -------------------------------------------------------------------------


def _rich_payload() -> bytes:
    spans = [
        good_span(),
        b"".join(span_fields(span_id=b"\x44" * 8, attributes=[
            kv(b"nan", d_value(float("nan"))), kv(b"big", vfield(3, -(2**63))),
            kv(b"text", s_value("é\u2028\"\\".encode())),
            kv(b"arr", ld(5, ld(1, d_value(1e22)) + ld(1, vfield(2, 1)))), ld(1, b"none"),
        ], events=[event_bytes(GOOD_ATTRIBUTES), event_bytes()])) + ld(13, ld(1, TRACE) + ld(2, b"\x55" * 8)
                                                                      + ld(4, kv(b"l", vfield(3, 1)))),
    ]
    return request_bytes(spans) + request_bytes([good_span(span_id=b"\x66" * 8)], scope=ld(1, b"s") + ld(2, b"v"))


def corrupt(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    operation = rng.randrange(5)
    if operation == 0:  # flip bits
        for _ in range(rng.randint(1, 3)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    elif operation == 1:  # overwrite bytes
        for _ in range(rng.randint(1, 3)):
            out[rng.randrange(len(out))] = rng.randrange(256)
    elif operation == 2:  # truncate
        del out[rng.randrange(len(out)):]
    elif operation == 3:  # drop a byte
        del out[rng.randrange(len(out))]
    else:  # insert a byte
        out.insert(rng.randrange(len(out) + 1), rng.randrange(256))
    return bytes(out)


@pytest.mark.parametrize("seed", range(3))
def test_corrupted_payloads_never_raise_and_decode_like_python_when_decoded(seed):
    rng = random.Random(seed)
    sources = [chain_batch(3, rng, base_ns=NOW - 60 * SECOND)[0], _rich_payload()]
    for source in sources:
        assert check(source) is not None  # the uncorrupted payloads are inside the subset
    for i in range(100):
        check(corrupt(sources[i % 2], rng), SMALL if i % 7 == 0 else DEFAULT)
