"""The C fast path of OTLP/protobuf decoding on unusual but valid encodings made by hand (fields out of order,
repeated singular fields, 10-byte varints, doubles that are not JSON numbers, ...): those inside its subset are
decoded exactly like the Python decoder, the others declined or decoded alike.

INGEST_FAST_DECODER=false skips this module (see test_otlp_fast).
"""
from __future__ import annotations

import struct

import pytest
from ingest.otlp import decode_protobuf
from otlp_fast_checks import (
    DEFAULT,
    LIMITS,
    NOW,
    START,
    TRACE,
    check,
    d_value,
    event_bytes,
    good_span,
    kv,
    request_bytes,
    s_value,
    skip_module_when_turned_off,
    span_fields,
    vfield,
    with_attributes,
)
from otlp_payloads import fixed64, ld, tag

skip_module_when_turned_off()


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
