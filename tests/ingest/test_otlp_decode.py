"""ingest.otlp.decode_protobuf reads attributes from their serialized form (ingest.otlp_raw) and a cache.

The generated OTLP classes are the reference: for every value type and size, unusual but valid
encodings, duplicate keys, limits and repeated decoding (cache hits), the decoded spans must be
exactly what reading the same payload through the generated classes gives; and a value those
classes refuse to parse (bad UTF-8, malformed) rejects the span or resource with the reasons the
tolerant re-parse always gave. No platform process: these are pure functions.
"""
from __future__ import annotations

import math
import os
import random
import struct
import time

import pytest
from benchkit.payloads import chain_batch
from ingest.limits import MalformedPayload
from ingest.otlp import Limits, decode_protobuf
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from otlp_payloads import fixed64, ld, varint

NOW = time.time_ns()


# -- reference: the generated classes ---------------------------------------------------------------

MAX_VALUE_BYTES = Limits().max_value_bytes


def ref_text(text: str) -> str:
    data = text.encode()
    return data[:MAX_VALUE_BYTES].decode("utf-8", "ignore") if len(data) > MAX_VALUE_BYTES else text


def ref_value(value: AnyValue, depth: int = 0):
    kind = value.WhichOneof("value")
    if kind == "double_value":
        number = value.double_value
        return number if number - number == 0.0 else repr(number)
    if kind == "bytes_value":
        return ref_text(value.bytes_value.hex())
    if kind == "string_value":
        return ref_text(value.string_value)
    if kind in ("int_value", "bool_value"):
        return getattr(value, kind)
    if depth >= 8:
        return None
    if kind == "array_value":
        return [ref_value(v, depth + 1) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: ref_value(kv.value, depth + 1) for kv in value.kvlist_value.values}
    return None


def ref_attributes(attributes) -> dict:
    out = {}
    for kv in attributes:
        out[kv.key] = ref_value(kv.value)
        if not kv.key or len(kv.key) > 256:
            del out[kv.key]
    return out


def same(a, b) -> bool:
    """Equal, including NaN == NaN, value types and dict key order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_matches_reference(data: bytes) -> None:
    """Every span of `data` (valid for the generated classes, all spans acceptable) decodes like them."""
    reference = ExportTraceServiceRequest.FromString(data)
    expected = []
    for rs in reference.resource_spans:
        resource = ref_attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for span in ss.spans:
                events = [(e.name, ref_attributes(e.attributes)) for e in span.events]
                expected.append((span.span_id.hex(), resource, ref_attributes(span.attributes), events))
    for _ in range(2):  # the second time every cacheable attribute comes from the cache
        decoded = decode_protobuf(data, Limits(), NOW)
        assert not decoded.rejected
        got = [(s.span_id, s.resource, s.attributes, [(e.name, e.attributes) for e in s.events]) for s in decoded.spans]
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert same(list(g), list(e)), (g, e)


def request_with(resource_attrs=(), spans=()) -> ExportTraceServiceRequest:
    """spans: lists of (key, setter) attributes; a setter fills an AnyValue."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    for key, setter in resource_attrs:
        kv = rs.resource.attributes.add(key=key)
        setter(kv.value)
    ss = rs.scope_spans.add()
    ss.scope.name = "test"
    for attributes in spans:
        span = ss.spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="op",
                            start_time_unix_nano=NOW - 2_000_000_000, end_time_unix_nano=NOW - 1_000_000_000)
        for key, setter in attributes:
            kv = span.attributes.add(key=key)
            setter(kv.value)
        event = span.events.add(name="ev", time_unix_nano=NOW - 1_500_000_000)
        for key, setter in attributes[:3]:
            setter(event.attributes.add(key=key).value)
    return request


def setter(field: str, value):
    return lambda v: setattr(v, field, value)


SCALARS = [
    *(setter("string_value", s) for s in ("", "a", "é" * 60, "x" * 126, "x" * 127, "x" * 128, "x" * 1024,
                                          "y" * 1025, "€" * 3000, "z" * 16383, "z" * 20000)),
    *(setter("int_value", i) for i in (0, 1, 127, 128, 300, 2**31, 2**63 - 1, -1, -300, -(2**63))),
    *(setter("double_value", d) for d in (0.0, -0.0, 0.7, 1e300, 5e-324, math.nan, math.inf, -math.inf)),
    setter("bool_value", True),
    setter("bool_value", False),
    setter("bytes_value", b"\x00\xff" * 4),
    lambda v: None,  # an empty AnyValue
]


def nested(v):
    v.array_value.values.add(string_value="in an array")
    kv = v.array_value.values.add().kvlist_value.values.add(key="inner")
    kv.value.double_value = 1.5


def deep(v):
    for _ in range(12):
        v = v.array_value.values.add()
    v.int_value = 5


def test_every_value_type_and_size_decodes_like_the_generated_classes():
    attributes = [(f"k{i}", s) for i, s in enumerate(SCALARS)] + [("nested", nested), ("deep", deep)]
    request = request_with(resource_attrs=attributes[:5], spans=[attributes, attributes[::-1]])
    assert_matches_reference(request.SerializeToString())


def test_duplicate_keys_keep_the_first_position_and_the_last_value():
    attributes = [("dup", setter("int_value", 1)), ("other", setter("string_value", "x")),
                  ("dup", setter("string_value", "last")), ("", setter("string_value", "no key")),
                  ("k" * 257, setter("int_value", 2)), ("k" * 256, setter("int_value", 3))]
    request = request_with(spans=[attributes])
    assert_matches_reference(request.SerializeToString())
    assert list(decode_protobuf(request.SerializeToString(), Limits(), NOW).spans[0].attributes) == ["dup", "other", "k" * 256]


def test_the_benchmark_payloads_decode_like_the_generated_classes():
    data, _ = chain_batch(20, random.Random(3))
    assert_matches_reference(data)


# -- hand-encoded KeyValue/AnyValue shapes that are valid protobuf but not the usual layout ----------


def span_bytes(key_values=(), event_key_values=()) -> bytes:
    body = (ld(1, os.urandom(16)) + ld(2, os.urandom(8)) + ld(5, b"op")
            + fixed64(7, NOW - 2_000_000_000) + fixed64(8, NOW - 1_000_000_000))
    body += b"".join(ld(9, kv) for kv in key_values)
    if event_key_values:
        body += ld(11, fixed64(1, NOW - 1_500_000_000) + ld(2, b"ev") + b"".join(ld(3, kv) for kv in event_key_values))
    return body


def request_bytes(spans, resource_key_values=()) -> bytes:
    resource = b"".join(ld(1, kv) for kv in resource_key_values)
    scope_spans = ld(1, ld(1, b"scope")) + b"".join(ld(2, s) for s in spans)
    return ld(1, ld(1, resource) + ld(2, scope_spans))


def kv(key: bytes, value: bytes) -> bytes:
    return ld(1, key) + ld(2, value)


STRING_V = ld(1, b"v")
UNUSUAL_KEY_VALUES = [
    ld(2, STRING_V) + ld(1, b"k"),                    # value before key
    ld(1, b"k") + ld(1, b"k2") + ld(2, STRING_V),     # two keys: the last wins
    ld(1, b"k") + ld(2, STRING_V) + ld(2, b"\x18\x05"),  # two values: merged, the int wins
    kv(b"k", ld(5, ld(1, STRING_V))) + ld(2, ld(5, ld(1, ld(1, b"w")))),  # two arrays: merged into one
    ld(1, b"k") + ld(2, STRING_V) + varint(3 << 3) + b"\x05",   # an unknown field
    ld(2, STRING_V),                                  # no key
    ld(1, b"k"),                                      # no value
    kv(b"k", b""),                                    # an empty value
    kv(b"k" * 300, STRING_V),                         # a two-byte key length
    kv(b"k", ld(1, b"x" * 200)),                      # two-byte value lengths
    kv(b"k", ld(1, b"x" * 16379)),
    kv(b"k", ld(1, b"x" * 20000)),                    # three-byte value lengths
    ld(1, b"k") + b"\x12\x85\x00" + ld(1, b"abc"),    # a non-minimal length varint
    kv(b"k", b"\x0a\x01a\x18\x05"),                   # string then int: the last field wins
    kv(b"k", b"\x18\x05\x0a\x01a"),
    kv(b"k", b"\x0a\x01a\x0a\x01b"),                  # two strings
    kv(b"k", b"\x18\x80\x01"),                        # multi-byte ints
    kv(b"k", b"\x18" + b"\xff" * 9 + b"\x01"),
    kv(b"k", b"\x18" + b"\xff" * 9 + b"\x7f"),        # beyond 64 bits: truncated like upb does
    kv(b"k", b"\x10\x02"),                            # bool from 2
    kv(b"k", b"\x10\x80\x01"),
    kv(b"k", b"\x29" + b"\x00" * 8),                  # a fixed64 in another field number
    kv(b"k", b"\x21" + struct.pack("<d", 2.5) + b"\x10\x01"),
    kv(b"k", ld(7, b"\x00\xff")),                     # bytes
    kv(b"k", ld(5, b"")),                             # an empty array / kvlist
    kv(b"k", ld(6, b"")),
]


@pytest.mark.parametrize("index", range(len(UNUSUAL_KEY_VALUES)))
def test_unusual_but_valid_encodings_decode_like_the_generated_classes(index):
    unusual = UNUSUAL_KEY_VALUES[index]
    KeyValue.FromString(unusual)  # valid protobuf
    data = request_bytes([span_bytes([kv(b"a", STRING_V), unusual, unusual], [unusual])],
                         resource_key_values=[unusual])
    assert_matches_reference(data)


# -- what the generated classes refuse --------------------------------------------------------------

BAD_VALUES = [
    b"\x0a\x01\xff",             # invalid UTF-8
    b"\x0a\x02\xc3\x28",
    b"\x0a\x03\xed\xa0\x80",     # an encoded surrogate
    b"\x0a\x04\xf4\x90\x80\x80",  # beyond U+10FFFF
    b"\x0a\x05ab",               # truncated
    b"\x18\x80",
    b"\x21\x00\x00",
    b"\xff\xff",
    b"\x2a\x03\x0a\x01\xff",     # bad UTF-8 inside an array
    b"\x32\x05\x0a\x03\x0a\x01\xff",
]
BAD_KEY_VALUES = [kv(b"\xff", STRING_V), b"\x0a\x05k", kv(b"k", STRING_V) + b"\x12"] + [kv(b"k", v) for v in BAD_VALUES]


@pytest.mark.parametrize("bad", BAD_KEY_VALUES)
def test_a_bad_span_or_event_attribute_rejects_only_that_span(bad):
    good = span_bytes([kv(b"a", STRING_V)])
    for spans in ([good, span_bytes([kv(b"a", STRING_V), bad]), good], [good, span_bytes([], [bad]), good]):
        decoded = decode_protobuf(request_bytes(spans), Limits(), NOW)
        assert dict(decoded.rejected) == {"invalid UTF-8 or malformed span": 1}
        assert len(decoded.spans) == 2 and decoded.truncated == 0


@pytest.mark.parametrize("bad", BAD_KEY_VALUES)
def test_a_bad_resource_attribute_rejects_the_spans_of_that_resource(bad):
    data = (request_bytes([span_bytes(), span_bytes()], resource_key_values=[bad])
            + request_bytes([span_bytes()], resource_key_values=[kv(b"service.name", STRING_V)]))
    decoded = decode_protobuf(data, Limits(), NOW)
    assert dict(decoded.rejected) == {"invalid UTF-8 or malformed resource/scope": 2}
    assert len(decoded.spans) == 1


def test_a_malformed_attribute_wins_over_every_other_reason_as_before():
    bad = kv(b"k", b"\x0a\x01\xff")
    no_ids = ld(5, b"op") + fixed64(7, NOW - 2_000_000_000) + fixed64(8, NOW - 1_000_000_000) + ld(9, bad)
    backwards = span_bytes([bad]).replace(fixed64(8, NOW - 1_000_000_000), fixed64(8, NOW - 3_000_000_000))
    decoded = decode_protobuf(request_bytes([no_ids, backwards, span_bytes()]), Limits(), NOW)
    assert dict(decoded.rejected) == {"invalid UTF-8 or malformed span": 2}


def test_bad_utf8_in_link_and_scope_attributes_is_still_refused():
    span = Span.FromString(span_bytes())
    link = span.links.add(trace_id=os.urandom(16), span_id=os.urandom(8))
    link.attributes.add(key="note").value.string_value = "PLACEHOLDER"
    data = request_bytes([span.SerializeToString().replace(b"PLACEHOLDER", b"\xff" * 11), span_bytes()])
    assert dict(decode_protobuf(data, Limits(), NOW).rejected) == {"invalid UTF-8 or malformed span": 1}
    scope_with_bad_attribute = ld(1, ld(1, b"scope") + ld(3, kv(b"note", ld(1, b"\xff"))))
    data = ld(1, ld(2, scope_with_bad_attribute + ld(2, span_bytes()))) + request_bytes([span_bytes()])
    assert dict(decode_protobuf(data, Limits(), NOW).rejected) == {"invalid UTF-8 or malformed resource/scope": 1}


def test_limits_apply_to_cached_attributes_too():
    attributes = [(f"k{i}", setter("string_value", "v" * 2000 if i == 2 else "v")) for i in range(6)]
    data = request_with(spans=[attributes]).SerializeToString()
    for _ in range(2):
        decoded = decode_protobuf(data, Limits(max_attributes=4, max_value_bytes=100), NOW)
        span = decoded.spans[0]
        assert list(span.attributes) == ["k0", "k1", "k2", "k3"]
        assert span.attributes["k2"] == "v" * 100 and span.events[0].attributes["k2"] == "v" * 100
        # Two attributes over the count limit, k2 truncated on the span and on its event.
        assert decoded.dropped == [4]
        assert decoded.truncated == 4


def test_random_corruption_never_escapes_as_another_error_and_good_spans_match():
    rng = random.Random(11)
    data, _ = chain_batch(4, rng)
    for _ in range(400):
        corrupted = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            corrupted[rng.randrange(len(corrupted))] = rng.randrange(256)
        try:
            decoded = decode_protobuf(bytes(corrupted), Limits(), NOW)
        except MalformedPayload:
            continue
        try:
            reference = ExportTraceServiceRequest.FromString(bytes(corrupted))
        except Exception:
            continue  # the tolerant path: covered by the live bad-input tests
        by_id = {s.span_id: s for s in decoded.spans}
        for rs in reference.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    got = by_id.get(span.span_id.hex())
                    if got is not None:
                        assert same(got.attributes, ref_attributes(span.attributes))
