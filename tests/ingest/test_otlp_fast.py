"""The C fast path of OTLP/protobuf decoding (ingest._otlp_fast) against the Python decoder.

`decode_protobuf_fast` returns None for a payload outside its subset (the Python decoder then
handles it) and otherwise exactly what `decode_protobuf` returns for the same bytes: the same
SpanViews (attribute dicts in the same key order, one resource dict shared by the spans of one
ResourceSpans), the same dropped counts, nothing rejected or truncated, and a spool record from
`build_record` byte-identical to the one built from the Python decoder's output. No mocks: the real
extension against the real decoder, here on the benchmark payloads and on generated requests
(hypothesis); on hand-encoded wire variants in test_otlp_fast_encodings; on payloads outside the
subset and on corrupted payloads in test_otlp_fast_declined. otlp_fast_checks holds the comparison
and the hand encoding they share.

INGEST_FAST_DECODER=false (the platform setting that turns the fast path off, e.g. on a machine with
no C compiler) skips this module; otherwise a missing or broken extension fails it.
"""
from __future__ import annotations

import dataclasses
import random
import struct

import pytest
from benchkit.payloads import chain_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ingest.limits import MalformedPayload
from ingest.otlp import FAST_DECODER_AVAILABLE, Limits, decode_protobuf, decode_protobuf_fast
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from otlp_fast_checks import (
    DEFAULT,
    LIMITS,
    NOW,
    OTHER_IDENTITY,
    SECOND,
    assert_fast_matches,
    assert_no_aliasing,
    assert_same_records,
    skip_module_when_turned_off,
)
from otlp_payloads import tag, varint

skip_module_when_turned_off()


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
