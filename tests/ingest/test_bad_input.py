"""Every kind of bad OTLP input gets the status the OTLP spec and docs/ingest.md ("Responses") promise
(401/413/415/400, or 200 with partial_success when only some spans are bad), over OTLP/HTTP and OTLP/gRPC, and the
platform keeps serving: the good spans of a partly bad export are stored and queryable, and a good export after all
of it still works."""
from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import time
import zlib
from functools import lru_cache

import grpc
import pytest
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from otlp_payloads import (
    MS,
    engine_span,
    export_json,
    export_protobuf,
    good_request,
    grpc_auth,
    grpc_export_raw,
    json_request,
    json_span,
    metric_total,
    new_span_id,
    new_trace_id,
    pb_request,
    pb_span,
    post_traces,
    requests_of,
    vllm_resource,
)

# Hostile OTLP input over HTTP and gRPC: the ingest path, the same in both modes (the database only looks the key up,
# as in the mode-independent ingest tests). Run once.
pytestmark = pytest.mark.one_suite(suite="embedded")

DAY_NS = 86_400 * 1_000_000_000


def assert_stored(platform, trace_ids, token=None, project_token="alice") -> None:
    platform.process.wait_idle()
    for trace_id in trace_ids:
        rows = requests_of(platform, trace_id, token or platform.tokens[project_token])
        assert len(rows) == 1, (trace_id, rows)
        assert rows[0]["e2e_ms"] is not None


def assert_absent(platform, trace_ids) -> None:
    platform.process.wait_idle()
    for trace_id in trace_ids:
        assert requests_of(platform, trace_id, platform.tokens["alice"]) == [], trace_id


def rpc_status(body: bytes) -> status_pb2.Status:
    return status_pb2.Status.FromString(body)


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@lru_cache(maxsize=None)
def gzip_bomb(megabytes: int = 200) -> bytes:
    """`megabytes` MB of zeros, gzip-compressed (about 1000:1), built without holding the plain bytes."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1024 * 1024)
    parts = [compressor.compress(zeros) for _ in range(megabytes)]
    parts.append(compressor.flush())
    return b"".join(parts)


# -- authentication -------------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["application/x-protobuf", "application/json"])
def test_missing_authorization_is_401(live_platform, content_type):
    body, _ = good_request()
    if content_type == "application/json":
        body = b'{"resourceSpans": []}'
    status, headers, data = post_traces(live_platform, body, key=None, content_type=content_type)
    assert status == 401
    if content_type == "application/json":
        assert headers["content-type"] == "application/json"
        assert json.loads(data)["code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
    else:
        assert headers["content-type"] == "application/x-protobuf"
        assert rpc_status(data).code == grpc.StatusCode.UNAUTHENTICATED.value[0]


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer lok_" + "x" * 43,               # well-formed but unknown
        "Bearer ",                              # empty
        "Basic dXNlcjpwYXNz",                   # wrong scheme
        "lok_notbearer",                        # no scheme
        "Bearer " + "k" * 300,                  # absurdly long
    ],
)
def test_wrong_key_is_401(live_platform, authorization):
    body, trace_id = good_request()
    status, _, data = post_traces(live_platform, body, key=None, headers={"Authorization": authorization})
    assert status == 401
    assert rpc_status(data).message
    assert_absent(live_platform, [trace_id])


def test_key_of_one_project_with_scheme_in_any_case_is_accepted(live_platform):
    body, trace_id = good_request()
    status, _, _ = post_traces(live_platform, body, key=None,
                               headers={"Authorization": f"bearer {live_platform.keys['alpha']}"})
    assert status == 200
    assert_stored(live_platform, [trace_id])


def test_revoked_key_is_refused_over_http_and_grpc(fresh_platform_factory):
    platform = fresh_platform_factory(extra_env={"INGEST_KEY_CACHE_SECONDS": "0"})
    alpha, beta = platform.keys["alpha"], platform.keys["beta"]
    body, trace_id = good_request()
    assert post_traces(platform, body, key=alpha)[0] == 200

    out = platform.process.manage("revoke_ingest_key", alpha[:12])  # by display prefix
    assert alpha[:12] in out and "alpha" in out and "revoked" in out

    body, revoked_trace = good_request()
    assert post_traces(platform, body, key=alpha)[0] == 401
    with pytest.raises(grpc.RpcError) as refused:
        grpc_export_raw(platform.grpc_target, body, metadata=grpc_auth(alpha))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the other project's key is untouched; revoking it by its full value works too
    body, beta_trace = good_request()
    assert post_traces(platform, body, key=beta)[0] == 200
    assert "revoked" in platform.process.manage("revoke_ingest_key", beta)
    assert post_traces(platform, good_request()[0], key=beta)[0] == 401
    # idempotent, and an unknown key is an error (non-zero exit), not a silent success
    assert "already revoked" in platform.process.manage("revoke_ingest_key", alpha)
    with pytest.raises(subprocess.CalledProcessError) as unknown:
        platform.process.manage("revoke_ingest_key", "lok_doesnotex")
    assert "no ingest key" in unknown.value.stderr

    # what was accepted before the revocation stays
    assert_stored(platform, [trace_id])
    assert_stored(platform, [beta_trace], project_token="bob")
    assert_absent(platform, [revoked_trace])


# -- content type and encoding --------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/xml", "application/grpc", "multipart/form-data",
                                          "application/x-www-form-urlencoded", None])
def test_wrong_content_type_is_415(live_platform, content_type):
    body, trace_id = good_request()
    status, _, data = post_traces(live_platform, body, key=live_platform.keys["alpha"], content_type=content_type)
    assert status == 415
    assert rpc_status(data).message
    assert_absent(live_platform, [trace_id])


@pytest.mark.parametrize("content_type", ["application/x-protobuf", "application/protobuf",
                                          "Application/X-Protobuf", "application/x-protobuf; charset=binary"])
def test_protobuf_media_type_variants_are_accepted(live_platform, content_type):
    body, trace_id = good_request()
    assert post_traces(live_platform, body, key=live_platform.keys["alpha"], content_type=content_type)[0] == 200
    assert_stored(live_platform, [trace_id])


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, br"])
def test_unsupported_content_encoding_is_415(live_platform, encoding):
    body, trace_id = good_request()
    status, _, _ = post_traces(live_platform, body, key=live_platform.keys["alpha"], encoding=encoding)
    assert status == 415
    assert_absent(live_platform, [trace_id])


@pytest.mark.parametrize("as_json", [False, True])
def test_gzip_bodies_are_accepted(live_platform, as_json):
    span = engine_span()
    request = pb_request((vllm_resource(), [span]))
    if as_json:
        body = json.dumps(json_request((vllm_resource(), [json_span(span)]))).encode()
        content_type = "application/json"
    else:
        body, content_type = request.SerializeToString(), "application/x-protobuf"
    status, _, _ = post_traces(live_platform, gzip.compress(body), key=live_platform.keys["alpha"],
                               content_type=content_type, encoding="gzip")
    assert status == 200
    assert_stored(live_platform, [span.trace_id.hex()])


def test_truncated_or_corrupt_gzip_is_400(live_platform):
    body, trace_id = good_request()
    packed = gzip.compress(body)
    for bad in (packed[:-12], packed[:15], b"\x1f\x8b\x08\x00" + bytes(range(200)), body,
                packed[:30] + bytes(b ^ 0x5A for b in packed[30:60]) + packed[60:]):
        status, _, data = post_traces(live_platform, bad, key=live_platform.keys["alpha"], encoding="gzip")
        assert status == 400, bad[:20]
        assert rpc_status(data).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert_absent(live_platform, [trace_id])


def test_concatenated_gzip_members_are_all_read(live_platform):
    """RFC 1952: a gzip stream may hold several members. Reading only the first would answer 200 ("durable")
    for spans that were silently dropped. Two protobuf messages one after the other are one message whose
    repeated fields are joined, so the body holds both traces: both must be stored."""
    first, first_trace = good_request()
    second, second_trace = good_request()
    body = gzip.compress(first) + gzip.compress(second)
    status, _, data = post_traces(live_platform, body, key=live_platform.keys["alpha"], encoding="gzip")
    assert status == 200, data
    assert_stored(live_platform, [first_trace, second_trace])


def test_gzip_bomb_against_default_limit_is_413_without_memory_blowup(live_platform):
    bomb = gzip_bomb(200)
    assert len(bomb) < 300 * 1024
    pid = live_platform.process.proc.pid
    before = vm_rss_kib(pid)
    started = time.monotonic()
    status, _, data = post_traces(live_platform, bomb, key=live_platform.keys["alpha"], encoding="gzip")
    elapsed = time.monotonic() - started
    assert status == 413, data
    assert rpc_status(data).code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert elapsed < 10
    # the default limit is 64 MiB of output: the process may hold about that, never the whole 200 MB
    assert vm_rss_kib(pid) - before < 180 * 1024


# -- malformed envelopes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        b"this is not a protobuf message",
        b"\xff" * 64,
        b"\x0a\xff\xff\xff\xff\x0f",                   # length prefix beyond the end
        b"\x0a\x05hello",                              # a "ResourceSpans" that is not one
        bytes(range(256)) * 4,
        b"\x00",
    ],
)
def test_garbage_protobuf_is_400(live_platform, garbage):
    status, _, data = post_traces(live_platform, garbage, key=live_platform.keys["alpha"])
    assert status == 400
    assert rpc_status(data).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_truncated_protobuf_is_400(live_platform):
    body, trace_id = good_request()
    for cut in (len(body) // 2, len(body) - 1, 3):
        status, _, _ = post_traces(live_platform, body[:cut], key=live_platform.keys["alpha"])
        assert status == 400, cut
    assert_absent(live_platform, [trace_id])


@pytest.mark.parametrize("garbage", [b"{", b"{'resourceSpans': []}", b"", b"\x00\x01\x02", b"{\"resourceSpans\": [}",
                                     b"\xff\xfe{}", b"[1, 2", b"NaN?"])
def test_invalid_json_is_400(live_platform, garbage):
    status, headers, data = post_traces(live_platform, garbage, key=live_platform.keys["alpha"],
                                        content_type="application/json")
    assert status == 400
    assert headers["content-type"] == "application/json"
    answer = json.loads(data)
    assert answer["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and answer["message"]


@pytest.mark.parametrize("document", ["[]", '"resourceSpans"', "42", "null", "true", '{"resourceSpans": 5}',
                                      '{"resourceSpans": {"scopeSpans": []}}', '{"resourceSpans": [5]}',
                                      '{"resourceSpans": [{"scopeSpans": "x"}]}',
                                      '{"resourceSpans": [{"scopeSpans": [7]}]}',
                                      '{"resourceSpans": [{"scopeSpans": [{"spans": {}}]}]}'])
def test_json_that_is_not_an_otlp_request_is_400(live_platform, document):
    status, _, data = post_traces(live_platform, document.encode(), key=live_platform.keys["alpha"],
                                  content_type="application/json")
    assert status == 400, data
    assert json.loads(data)["message"]


def test_deeply_nested_json_is_refused_cleanly(live_platform):
    """Nesting that json.loads accepts but that is deeper than any OTLP document must not crash the receiver
    (500 with an HTML page): it is malformed (400) or that span is rejected (200 + partialSuccess)."""
    good = engine_span()
    for depth in (300, 600, 900):
        bad = json_span(engine_span())
        bad["attributes"].append({"key": "deep", "value": {"stringValue": "x"}})
        document = json.dumps(json_request((vllm_resource(), [json_span(good), bad])))
        document = document.replace('"stringValue": "x"', '"stringValue": "x", "nested": ' + "[" * depth + "]" * depth)
        status, headers, data = post_traces(live_platform, document.encode(), key=live_platform.keys["alpha"],
                                            content_type="application/json")
        assert status in (200, 400), (depth, status, data[:200])
        assert headers["content-type"] == "application/json"
    assert post_traces(live_platform, good_request()[0], key=live_platform.keys["alpha"])[0] == 200


# -- spans rejected one by one inside a valid envelope ---------------------------------------------------


def bad_spans(now: int) -> dict[str, object]:
    """One span per problem the decoder must reject on its own (name -> protobuf Span)."""
    def span(**kw):
        defaults = dict(trace_id=new_trace_id(), span_id=new_span_id(), start_ns=now - 1_000 * MS, end_ns=now)
        defaults.update(kw)
        return pb_span(defaults.pop("trace_id"), defaults.pop("span_id"), name="llm_request", kind=2, **defaults)

    return {
        "all-zero trace id": span(trace_id=bytes(16)),
        "all-zero span id": span(span_id=bytes(8)),
        "short trace id": span(trace_id=os.urandom(15)),
        "long trace id": span(trace_id=os.urandom(17)),
        "short span id": span(span_id=os.urandom(7)),
        "long span id": span(span_id=os.urandom(9)),
        "bad parent id": span(parent=os.urandom(5)),
        "end before start": span(start_ns=now, end_ns=now - 1),
        "start time 0": span(start_ns=0, end_ns=now),
        "end time 0": span(start_ns=now - MS, end_ns=0),
        "30 days old": span(start_ns=now - 30 * DAY_NS, end_ns=now - 30 * DAY_NS + MS),
        "2 days ahead": span(start_ns=now + 2 * DAY_NS, end_ns=now + 2 * DAY_NS + MS),
        "lasts 2 days": span(start_ns=now - 2 * DAY_NS, end_ns=now),
    }


def test_bad_spans_are_rejected_one_by_one_over_protobuf(live_platform):
    now = time.time_ns()
    bad = bad_spans(now)
    good = [engine_span(), engine_span()]
    rejected_before = metric_total(live_platform, "observatory_spans_rejected_total", protocol="http")
    spans = [good[0], *bad.values(), good[1]]
    response = export_protobuf(live_platform, pb_request((vllm_resource(), spans)), live_platform.keys["alpha"])
    assert response.partial_success.rejected_spans == len(bad)
    assert response.partial_success.error_message
    assert metric_total(live_platform, "observatory_spans_rejected_total", protocol="http") - rejected_before == len(bad)
    assert_stored(live_platform, [s.trace_id.hex() for s in good])
    valid_ids = [s.trace_id.hex() for s in bad.values() if len(s.trace_id) == 16 and any(s.trace_id)]
    assert_absent(live_platform, valid_ids)


def test_span_age_limits_come_from_settings(live_platform):
    """7 days back and 1 hour ahead are accepted by default (INGEST_MAX_SPAN_AGE_SECONDS / _FUTURE_SECONDS)."""
    now = time.time_ns()
    inside = [engine_span(start_ns=now - 6 * DAY_NS), engine_span(start_ns=now + 30 * 60 * 1_000_000_000)]
    outside = [engine_span(start_ns=now - 8 * DAY_NS), engine_span(start_ns=now + 2 * 3600 * 1_000_000_000)]
    response = export_protobuf(live_platform, pb_request((vllm_resource(), inside + outside)),
                               live_platform.keys["alpha"])
    assert response.partial_success.rejected_spans == 2
    assert_stored(live_platform, [s.trace_id.hex() for s in inside])
    assert_absent(live_platform, [s.trace_id.hex() for s in outside])


def test_bad_spans_are_rejected_one_by_one_over_json(live_platform):
    now = time.time_ns()
    good = [json_span(engine_span()), json_span(engine_span())]

    def variant(**changes):
        span = json_span(engine_span())
        span.update(changes)
        return span

    bad = [
        variant(traceId="0" * 32),
        variant(spanId="0" * 16),
        variant(traceId="ab" * 15),
        variant(spanId="zz" * 8),
        variant(traceId=12345),
        variant(parentSpanId="abc"),
        variant(startTimeUnixNano=str(now), endTimeUnixNano=str(now - 1)),
        variant(startTimeUnixNano="0"),
        variant(startTimeUnixNano=str(now - 30 * DAY_NS), endTimeUnixNano=str(now - 30 * DAY_NS + MS)),
        variant(startTimeUnixNano=str(now + 2 * DAY_NS), endTimeUnixNano=str(now + 2 * DAY_NS + MS)),
        variant(startTimeUnixNano="yesterday"),
        variant(kind=9),
        variant(kind=True),
        variant(attributes={"not": "a list"}),
        variant(attributes=[{"key": "x", "value": {"intValue": "twelve"}}]),
        variant(status={"code": 7}),
        variant(events=[{"timeUnixNano": "soon", "name": "e"}]),
        "not a span",
    ]
    document = json_request((vllm_resource(), [good[0], *bad, good[1]]))
    answer = export_json(live_platform, document, live_platform.keys["alpha"])
    assert int(answer["partialSuccess"]["rejectedSpans"]) == len(bad)  # int64 as a JSON string per OTLP/JSON
    assert answer["partialSuccess"]["errorMessage"]
    assert_stored(live_platform, [s["traceId"] for s in good])
    assert_absent(live_platform, [s["traceId"] for s in bad[6:12]])


def test_all_good_export_has_no_partial_success(live_platform):
    answer = export_json(live_platform, json_request((vllm_resource(), [json_span(engine_span())])),
                         live_platform.keys["alpha"])
    assert answer.get("partialSuccess", {}).get("rejectedSpans", "0") in ("0", 0)
    response = export_protobuf(live_platform, pb_request((vllm_resource(), [engine_span()])),
                               live_platform.keys["alpha"])
    assert not response.HasField("partial_success") or response.partial_success.rejected_spans == 0


# -- invalid UTF-8 -----------------------------------------------------------------------------------------

PLACEHOLDER = "UTF8-PLACEHOLDER-20B"
INVALID = b"\xff\xfe" * (len(PLACEHOLDER) // 2)


def corrupt(data: bytes) -> bytes:
    """Swap the placeholder for invalid UTF-8 of the same length, keeping every protobuf length prefix right."""
    raw = PLACEHOLDER.encode()
    assert len(INVALID) == len(raw) and data.count(raw) == 1
    return data.replace(raw, INVALID)


@pytest.mark.parametrize("where", ["attribute", "span name", "event name"])
def test_invalid_utf8_in_one_protobuf_span_rejects_only_that_span(live_platform, where):
    good_same_scope = [engine_span(), engine_span()]
    good_other_resource = engine_span()
    bad = engine_span(extra={"app.note": PLACEHOLDER} if where == "attribute" else {})
    if where == "span name":
        bad.name = PLACEHOLDER
    elif where == "event name":
        bad.events.add(name=PLACEHOLDER, time_unix_nano=bad.start_time_unix_nano + MS)
    request = pb_request((vllm_resource(), [good_same_scope[0], bad, good_same_scope[1]]),
                         (vllm_resource("vllm-other"), [good_other_resource]))
    response = export_protobuf(live_platform, corrupt(request.SerializeToString()), live_platform.keys["alpha"])
    assert response.partial_success.rejected_spans == 1
    assert response.partial_success.error_message
    assert_stored(live_platform, [s.trace_id.hex() for s in (*good_same_scope, good_other_resource)])
    assert_absent(live_platform, [bad.trace_id.hex()])


def test_invalid_utf8_in_a_resource_rejects_its_spans_only(live_platform):
    bad_resource = {**vllm_resource(), "host.name": PLACEHOLDER}
    spoiled = [engine_span(), engine_span()]
    good = engine_span()
    request = pb_request((bad_resource, spoiled), (vllm_resource(), [good]))
    response = export_protobuf(live_platform, corrupt(request.SerializeToString()), live_platform.keys["alpha"])
    assert response.partial_success.rejected_spans == 2
    assert_stored(live_platform, [good.trace_id.hex()])
    assert_absent(live_platform, [s.trace_id.hex() for s in spoiled])


def test_invalid_utf8_over_grpc_rejects_only_that_span(live_platform):
    good = engine_span()
    bad = engine_span(extra={"app.note": PLACEHOLDER})
    body = corrupt(pb_request((vllm_resource(), [good, bad])).SerializeToString())
    answer = grpc_export_raw(live_platform.grpc_target, body, metadata=grpc_auth(live_platform.keys["alpha"]))
    assert ExportTraceServiceResponse.FromString(answer).partial_success.rejected_spans == 1
    assert_stored(live_platform, [good.trace_id.hex()])
    assert_absent(live_platform, [bad.trace_id.hex()])


def test_bad_utf8_in_json_rejects_only_those_spans(live_platform):
    good = [json_span(engine_span()), json_span(engine_span())]
    raw_bytes = json_span(engine_span())
    raw_bytes["attributes"].append({"key": "app.note", "value": {"stringValue": PLACEHOLDER}})
    surrogate = json_span(engine_span())
    surrogate["attributes"].append({"key": "app.note", "value": {"stringValue": "lone \ud800 surrogate"}})
    surrogate_in_name = json_span(engine_span())
    surrogate_in_name["name"] = "llm_request\udfff"
    document = json.dumps(json_request((vllm_resource(), [good[0], raw_bytes, surrogate, surrogate_in_name, good[1]])))
    assert "\\ud800" in document and "\\udfff" in document  # escapes, as a JSON encoder writes them
    body = corrupt(document.encode())
    with pytest.raises(UnicodeDecodeError):
        body.decode("utf-8")
    answer = export_json(live_platform, body, live_platform.keys["alpha"])
    assert int(answer["partialSuccess"]["rejectedSpans"]) == 3
    assert_stored(live_platform, [s["traceId"] for s in good])
    assert_absent(live_platform, [s["traceId"] for s in (raw_bytes, surrogate, surrogate_in_name)])


# -- limits that trim instead of rejecting -----------------------------------------------------------------


def test_oversized_attribute_values_are_truncated_not_rejected(live_platform):
    truncated_before = metric_total(live_platform, "observatory_attributes_truncated_total")
    span = engine_span(extra={
        "gen_ai.prompt": "p" * (20 * 1024),                 # over the 16 KiB default
        "gen_ai.completion": "\u00e9" * (12 * 1024),        # 24 KiB of two-byte characters
        "app.small": "fits",
    })
    response = export_protobuf(live_platform, pb_request((vllm_resource(), [span])), live_platform.keys["alpha"])
    assert response.partial_success.rejected_spans == 0
    assert_stored(live_platform, [span.trace_id.hex()])
    [row] = requests_of(live_platform, span.trace_id.hex(), live_platform.tokens["alice"])
    assert row["decode_ms"] == pytest.approx(400.0, abs=0.001)  # the vLLM figures survived
    assert metric_total(live_platform, "observatory_attributes_truncated_total") - truncated_before == 2


def test_too_many_attributes_and_events_are_trimmed_not_rejected(live_platform):
    truncated_before = metric_total(live_platform, "observatory_attributes_truncated_total")
    span = engine_span(extra={f"app.attr.{i:03d}": i for i in range(300)})
    for i in range(200):
        span.events.add(name=f"tick-{i}", time_unix_nano=span.start_time_unix_nano + i * MS)
    attributes = len(span.attributes)
    response = export_protobuf(live_platform, pb_request((vllm_resource(), [span])), live_platform.keys["alpha"])
    assert response.partial_success.rejected_spans == 0
    assert_stored(live_platform, [span.trace_id.hex()])
    [row] = requests_of(live_platform, span.trace_id.hex(), live_platform.tokens["alice"])
    assert row["queue_ms"] == pytest.approx(10.0, abs=0.001)  # the vLLM attributes come first and are kept
    # defaults: 256 attributes and 128 events per span
    dropped = (attributes - 256) + (200 - 128)
    assert metric_total(live_platform, "observatory_attributes_truncated_total") - truncated_before == dropped


def test_span_with_an_unset_event_time_does_not_lose_the_export(live_platform):
    """An event with time_unix_nano 0 (allowed by the proto, written by hand-rolled exporters) is accepted; the
    export was answered 200, so it and the other spans of the same export must end up stored."""
    neighbour = engine_span()
    odd = engine_span()
    odd.events.add(name="no timestamp", time_unix_nano=0)
    response = export_protobuf(live_platform, pb_request((vllm_resource(), [neighbour, odd])),
                               live_platform.keys["alpha"])
    if response.partial_success.rejected_spans:
        assert response.partial_success.rejected_spans == 1
        assert_stored(live_platform, [neighbour.trace_id.hex()])
    else:
        assert_stored(live_platform, [neighbour.trace_id.hex(), odd.trace_id.hex()])


# -- OTLP/gRPC ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer lok_wrong"),), (("authorization", "Bearer "),),
                                      (("authorization", "Basic dXNlcjpwYXNz"),), (("x-api-key", "whatever"),)])
def test_grpc_without_a_valid_key_is_unauthenticated(live_platform, metadata):
    body, trace_id = good_request()
    with pytest.raises(grpc.RpcError) as failure:
        grpc_export_raw(live_platform.grpc_target, body, metadata=metadata)
    assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert_absent(live_platform, [trace_id])


@pytest.mark.parametrize("garbage", [b"this is not a protobuf message", b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f"])
def test_grpc_garbage_is_invalid_argument(live_platform, garbage):
    with pytest.raises(grpc.RpcError) as failure:
        grpc_export_raw(live_platform.grpc_target, garbage, metadata=grpc_auth(live_platform.keys["alpha"]))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_partial_success(live_platform):
    good = engine_span()
    bad = list(bad_spans(time.time_ns()).values())[:4]
    answer = grpc_export_raw(live_platform.grpc_target, pb_request((vllm_resource(), [good, *bad])).SerializeToString(),
                             metadata=grpc_auth(live_platform.keys["alpha"]))
    response = ExportTraceServiceResponse.FromString(answer)
    assert response.partial_success.rejected_spans == 4 and response.partial_success.error_message
    assert_stored(live_platform, [good.trace_id.hex()])


# -- size limits (a platform of its own with small limits) --------------------------------------------------


def post_chunked(platform, body: bytes, key: str) -> tuple[int, bytes]:
    """POST with Transfer-Encoding: chunked over a raw socket; the server may answer and close before the
    whole body is sent, so a broken pipe is not an error here. Returns (status, response body)."""
    head = (f"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/x-protobuf\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 65536]), body[i:i + 65536])
                      for i in range(0, len(body), 65536)) + b"0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", platform.process.port), timeout=60) as sock:
        try:
            sock.sendall(head.encode() + chunks)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except ConnectionResetError:
            pass
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


def sized_request(size: int) -> bytes:
    """A valid export of exactly `size` bytes (one engine span padded with an attribute)."""
    span = engine_span()
    pad = span.attributes.add(key="pad")
    pad.value.string_value = ""
    while (current := pb_request((vllm_resource(), [span])).ByteSize()) != size:
        pad.value.string_value = "x" * (len(pad.value.string_value) + size - current)
    return pb_request((vllm_resource(), [span])).SerializeToString()


def test_size_limits_over_http_and_grpc(fresh_platform_factory):
    body_limit, decompressed_limit = 256 * 1024, 1024 * 1024
    platform = fresh_platform_factory(extra_env={
        "INGEST_MAX_BODY_BYTES": str(body_limit),
        "INGEST_MAX_DECOMPRESSED_BYTES": str(decompressed_limit),
    })
    key = platform.keys["alpha"]

    def padded_request(size: int) -> tuple[bytes, str]:
        span = engine_span(extra={f"pad.{i}": "x" * 1000 for i in range(size // 1010)})
        return pb_request((vllm_resource(), [span])).SerializeToString(), span.trace_id.hex()

    # OTLP/HTTP: "the response body for all HTTP 4xx and 5xx responses MUST be a Protobuf-encoded Status"
    not_a_status: list[str] = []

    def check_status_body(case: str, data: bytes) -> None:
        try:
            assert rpc_status(data).code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        except Exception:  # noqa: BLE001 - collected, asserted at the end so the other limits are still checked
            not_a_status.append(f"{case}: {data[:80]!r}")

    # HTTP: a Content-Length just over the limit, far over it, and a chunked body that turns out too large
    for excess in (1, 10_000):
        big = sized_request(body_limit + excess)
        status, _, data = post_traces(platform, big, key=key)
        assert status == 413, (excess, status)
        check_status_body(f"{len(big) - body_limit} bytes over, Content-Length", data)
    big, big_trace = padded_request(body_limit + 10_000)
    status, data = post_chunked(platform, big, key)
    assert status == 413
    check_status_body("chunked", data)

    # HTTP: a gzip bomb is cut off at the decompressed limit, fast, without the process swelling
    bomb = gzip_bomb(200)
    assert len(bomb) <= body_limit
    pid = platform.process.proc.pid
    rss_before = vm_rss_kib(pid)
    started = time.monotonic()
    status, _, data = post_traces(platform, bomb, key=key, encoding="gzip")
    assert status == 413, data
    assert time.monotonic() - started < 5
    assert vm_rss_kib(pid) - rss_before < 64 * 1024

    # gRPC: over the receive limit (max of the two limits), and between the body limit and that
    for size in (decompressed_limit + 50_000, body_limit + 50_000):
        body, trace_id = padded_request(size)
        with pytest.raises(grpc.RpcError) as failure:
            grpc_export_raw(platform.grpc_target, body, metadata=grpc_auth(key))
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, size

    # a gzip-compressed gRPC message that inflates past the limit
    with grpc.insecure_channel(platform.grpc_target, compression=grpc.Compression.Gzip) as channel:
        export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        with pytest.raises(grpc.RpcError) as failure:
            export(bytes(16 * 1024 * 1024), metadata=grpc_auth(key), timeout=30)
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert vm_rss_kib(pid) - rss_before < 96 * 1024

    # and a small export still goes through both transports
    body, trace_id = good_request()
    assert post_traces(platform, body, key=key)[0] == 200
    body, grpc_trace = good_request()
    grpc_export_raw(platform.grpc_target, body, metadata=grpc_auth(key))
    assert_stored(platform, [trace_id, grpc_trace])
    assert_absent(platform, [big_trace])
    assert not not_a_status, not_a_status


# -- after all of the above --------------------------------------------------------------------------------


def test_zz_platform_still_serves_after_bad_input(live_platform):
    status, ready = live_platform.process.get("/readyz")
    assert status == 200 and ready["ingest"] and ready["clickhouse"]
    assert ready["protobuf_decoder"] == "c"  # the C fast path is built and on; bad payloads went to Python's
    body, http_trace = good_request()
    assert post_traces(live_platform, body, key=live_platform.keys["alpha"])[0] == 200
    body, grpc_trace = good_request()
    answer = grpc_export_raw(live_platform.grpc_target, body, metadata=grpc_auth(live_platform.keys["alpha"]))
    assert ExportTraceServiceResponse.FromString(answer).partial_success.rejected_spans == 0
    assert_stored(live_platform, [http_trace, grpc_trace])
