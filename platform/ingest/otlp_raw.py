"""OTLP trace messages in which span, event and resource attributes stay serialized.

Why: reading an attribute through the generated classes costs a KeyValue wrapper
object, `.key`, `.value` (a second wrapper), `WhichOneof` and the field, ~0.6 µs per
attribute; spans carry 10-20 attributes, so this was the largest Python cost of
ingest. This module builds, at import time, a copy of the installed OTLP schema
(same wire format, another package name, its own descriptor pool) in which
`Span.attributes`, `Span.Event.attributes` and `Resource.attributes` are
`repeated bytes`: a length-delimited field either way, so upb parses the same
payloads, and each attribute arrives as the raw bytes of its `KeyValue`, which
ingest.otlp decodes itself (usually from a cache keyed by those bytes, as most
attributes repeat from span to span: service names, models, operation names...).
`decode_scalar` reads the common value shapes (a single string, bool, int or double
field); anything else goes through the real `KeyValue`/`AnyValue` classes
(`parse_key_value`, `parse_any_value`). Attribute order, duplicate keys (last wins)
and every value stay exactly what the generated classes give
(tests/ingest/test_otlp_decode.py).

What upb no longer checks while parsing is checked by the decoder instead: invalid
UTF-8 in a key or string value, or a malformed KeyValue/AnyValue, raises `BadValue`
and the span (or the resource's spans) is rejected with the reason the tolerant
re-parse gave before. Attributes of links and of the instrumentation scope are
never read; they keep the real `KeyValue` type, so upb still validates them.
"""
from __future__ import annotations

import struct

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

_PREFIX = "llm_observatory.raw."
_OTLP = ".opentelemetry.proto."
_KEY_VALUE = ".opentelemetry.proto.common.v1.KeyValue"
# (message full name in the original schema, field name): attributes whose values we read.
_RAW_FIELDS = {
    ("opentelemetry.proto.trace.v1.Span", "attributes"),
    ("opentelemetry.proto.trace.v1.Span.Event", "attributes"),
    ("opentelemetry.proto.resource.v1.Resource", "attributes"),
}


class BadValue(ValueError):
    """An attribute that the generated classes would have refused to parse (bad UTF-8, malformed)."""


def _files(file_descriptor, out: list) -> list:
    for dependency in file_descriptor.dependencies:
        _files(dependency, out)
    if all(f.name != file_descriptor.name for f in out):
        out.append(file_descriptor)
    return out


def _rewrite(message: descriptor_pb2.DescriptorProto, full_name: str) -> None:
    for field in message.field:
        if field.type_name.startswith(_OTLP):
            if (full_name, field.name) in _RAW_FIELDS and field.type_name == _KEY_VALUE:
                field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                field.ClearField("type_name")
            else:
                field.type_name = "." + _PREFIX + field.type_name[1:]
    for nested in message.nested_type:
        _rewrite(nested, f"{full_name}.{nested.name}")


def _build_pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for file_descriptor in _files(trace_service_pb2.DESCRIPTOR, []):
        proto = descriptor_pb2.FileDescriptorProto()
        file_descriptor.CopyToProto(proto)
        package = proto.package
        proto.name = _PREFIX + proto.name
        proto.dependency[:] = [_PREFIX + name for name in proto.dependency]
        proto.package = _PREFIX + package
        del proto.service[:]  # only messages are needed
        for message in proto.message_type:
            _rewrite(message, f"{package}.{message.name}")
        pool.Add(proto)
    return pool


_pool = _build_pool()


def _message(name: str):
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(_PREFIX + name))


ExportTraceServiceRequest = _message("opentelemetry.proto.collector.trace.v1.ExportTraceServiceRequest")
Resource = _message("opentelemetry.proto.resource.v1.Resource")
InstrumentationScope = _message("opentelemetry.proto.common.v1.InstrumentationScope")
Span = _message("opentelemetry.proto.trace.v1.Span")

unpack_double = struct.Struct("<d").unpack_from
_UINT64 = (1 << 64) - 1
# AnyValue tags: field number << 3 | wire type.
_STRING, _BOOL, _INT, _DOUBLE = 0x0A, 0x10, 0x18, 0x21


def parse_key_value(raw: bytes) -> tuple[str, AnyValue]:
    """(key, value) of a serialized KeyValue through the generated class (repeated fields merge
    the way protobuf says)."""
    try:
        kv = KeyValue.FromString(raw)
    except DecodeError:
        raise BadValue("malformed attribute") from None
    return kv.key, kv.value


def parse_any_value(raw: bytes) -> AnyValue:
    """The AnyValue message for raw bytes, as the generated classes would have parsed it."""
    try:
        return AnyValue.FromString(raw)
    except DecodeError:
        raise BadValue("malformed attribute value") from None


def decode_scalar(raw: bytes):
    """(kind, value) for an AnyValue holding exactly one string, bool, int or double field encoded
    the usual way; (None, None) for anything else (the caller parses those with `parse_any_value`).

    Raises BadValue for a string that is not valid UTF-8 (upb refuses those too)."""
    n = len(raw)
    if n < 2:
        return None, None
    tag = raw[0]
    if tag == _STRING:
        length = raw[1]
        if length < 0x80:
            start = 2
        elif n > 2 and raw[2] < 0x80:
            length = (length & 0x7F) | (raw[2] << 7)
            start = 3
        else:
            return None, None
        if start + length != n:
            return None, None
        try:
            return "string_value", raw[start:].decode("utf-8")
        except UnicodeDecodeError:
            raise BadValue("invalid UTF-8 in a string value") from None
    if tag == _DOUBLE:
        if n != 9:
            return None, None
        return "double_value", unpack_double(raw, 1)[0]
    if tag == _INT:
        if n == 2:
            value = raw[1]
            if value >= 0x80:
                return None, None
            return "int_value", value
        if n > 11 or raw[-1] >= 0x80:
            return None, None
        value = 0
        shift = 0
        for i in range(1, n - 1):
            byte = raw[i]
            if byte < 0x80:  # the varint ends before the value does: another field follows
                return None, None
            value |= (byte & 0x7F) << shift
            shift += 7
        value = (value | (raw[-1] << shift)) & _UINT64
        return "int_value", value - (1 << 64) if value >> 63 else value
    if tag == _BOOL:
        if n != 2 or raw[1] >= 0x80:
            return None, None
        return "bool_value", raw[1] != 0
    return None, None
