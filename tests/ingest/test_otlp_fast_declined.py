"""The C fast path of OTLP/protobuf decoding on payloads it must not take as they are: payloads outside its
subset (bad UTF-8, bytes or key/value-list values, spans to reject or trim, malformed protobuf) are declined
and the Python decoder's result is unchanged; corrupted payloads never make it raise, and what it decodes of
them is the Python decode.

INGEST_FAST_DECODER=false skips this module (see test_otlp_fast).
"""
from __future__ import annotations

import os
import random

import pytest
from benchkit.payloads import chain_batch
from ingest.otlp import decode_protobuf_fast
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from otlp_fast_checks import (
    DEFAULT,
    GOOD_ATTRIBUTES,
    NOW,
    SECOND,
    SMALL,
    START,
    TRACE,
    check,
    d_value,
    event_bytes,
    good_span,
    kv,
    python_outcome,
    request_bytes,
    s_value,
    skip_module_when_turned_off,
    span_fields,
    vfield,
    with_attributes,
)
from otlp_payloads import fixed64, ld

skip_module_when_turned_off()


# -- payloads outside the subset: declined, and the Python decoder unaffected -----------------------


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


# -- corrupted payloads -------------------------------------------------------------------------


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
