"""One OTLP export, whatever the transport: limits, decode, normalise, make durable, answer per the OTLP spec.

A spool record is `(project_id, trace_ids, spans_json, calls_json, span_count, call_count, resources, format,
arrival)`,
the two blobs being JSONCompactEachRow rows ready for ClickHouse (see rows.py), `resources` a tuple of
`span_resources` rows, one JSON row per (resource, day), `format` rows.RECORD_FORMAT and `arrival` the time
the export arrived (seconds since the epoch, for the backlog's age and the delay to queryable rows). Records
spooled by earlier versions have six items (no resources: span rows carry theirs inline), seven (call rows
without replica_group) or eight (no arrival); the writer still takes them (rows.span_columns_of /
call_columns_of / arrival_of).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from tenancy.keys import IngestIdentity
from traces.row_encoding import encode_rows

from collectors.base import CALL_SPAN_NAMES, SPAN_KIND_CLIENT
from collectors.registry import normalise_span

from . import metrics
from .limits import MalformedPayload, PayloadTooLarge, UnsupportedEncoding, decompress
from .otlp import (
    FAST_DECODER_AVAILABLE,
    Decoded,
    Limits,
    decode_json,
    decode_protobuf,
    fast_decoded,
    parse_protobuf_fast,
)
from .rows import NS_PER_DAY, RECORD_FORMAT, call_row, resource_id, resource_row, span_row
from .spool import Spool, SpoolFull

log = logging.getLogger(__name__)

PROTOBUF_TYPES = {"application/x-protobuf", "application/protobuf"}
JSON_TYPES = {"application/json"}

# google.rpc.Code values used in Status bodies
_CODE_INVALID_ARGUMENT = 3
_CODE_RESOURCE_EXHAUSTED = 8
_CODE_UNAUTHENTICATED = 16
_CODE_UNAVAILABLE = 14


@dataclasses.dataclass
class ExportOutcome:
    http_status: int
    accepted: int = 0
    rejected: int = 0
    message: str = ""
    retry_after: int | None = None

    @property
    def ok(self) -> bool:
        return self.http_status == 200

    def grpc_code_name(self) -> str:
        return {
            200: "OK",
            400: "INVALID_ARGUMENT",
            401: "UNAUTHENTICATED",
            413: "RESOURCE_EXHAUSTED",
            415: "INVALID_ARGUMENT",
            429: "RESOURCE_EXHAUSTED",
            503: "UNAVAILABLE",
        }.get(self.http_status, "INTERNAL")

    def response_body(self, as_json: bool) -> bytes:
        """The OTLP response: ExportTraceServiceResponse on success, google.rpc.Status otherwise."""
        if self.ok:
            if as_json:
                body = {}
                if self.rejected:
                    body["partialSuccess"] = {"rejectedSpans": str(self.rejected), "errorMessage": self.message}
                return json.dumps(body).encode()
            response = ExportTraceServiceResponse()
            if self.rejected:
                response.partial_success.rejected_spans = self.rejected
                response.partial_success.error_message = self.message
            return response.SerializeToString()
        code = {400: _CODE_INVALID_ARGUMENT, 401: _CODE_UNAUTHENTICATED, 413: _CODE_RESOURCE_EXHAUSTED,
                415: _CODE_INVALID_ARGUMENT, 429: _CODE_RESOURCE_EXHAUSTED, 503: _CODE_UNAVAILABLE}.get(self.http_status, 13)
        if as_json:
            return json.dumps({"code": code, "message": self.message}).encode()
        return status_pb2.Status(code=code, message=self.message).SerializeToString()


class IngestService:
    def __init__(self, spool: Spool, *, limits: Limits, max_body_bytes: int, max_decompressed_bytes: int,
                 retry_after: int, fast_decoder: bool = True, backpressure=None):
        """`backpressure`: an ingest.backpressure.Backpressure saying when to refuse exports (without one,
        only a full spool refuses them)."""
        self.spool = spool
        self.backpressure = backpressure
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self.max_decompressed_bytes = max_decompressed_bytes
        self.retry_after = retry_after
        # The C fast path for protobuf payloads (ingest/_otlp_fast.c); off: every payload is decoded in Python.
        self.fast_decoder = fast_decoder and FAST_DECODER_AVAILABLE
        if fast_decoder and not FAST_DECODER_AVAILABLE:
            log.warning("the C fast path of protobuf decoding is not built (no C compiler at install?): "
                        "ingest decodes in Python, at about 70% of the throughput")
        # Decoding and encoding are mostly CPU work holding the GIL: run one export at a time through them.
        # Threads waiting on this lock sleep; threads contending for the GIL instead force a switch
        # every 5 ms and lose ~30% of the throughput to the hand-offs between cores.
        self._cpu = threading.Lock()
        self._refused: dict[str, int] = {}  # refusals since the last warning, by reason
        self._refusal_logged = float("-inf")

    def _refusal(self) -> ExportOutcome | None:
        if self.backpressure is not None:
            reason = self.backpressure.refusal()
        else:
            reason = "spool_full" if self.spool.pending_bytes >= self.spool.max_bytes else None
        if reason is None:
            return None
        metrics.BACKPRESSURE_REFUSALS.labels(reason).inc()
        self._note_refusal(reason)
        return ExportOutcome(503, message=_REFUSALS[reason], retry_after=self.retry_after)

    def _note_refusal(self, reason: str) -> None:
        """One warning every 30 s while exports are refused, with how many and why."""
        now = time.monotonic()
        self._refused[reason] = self._refused.get(reason, 0) + 1
        if now - self._refusal_logged < 30:
            return
        self._refusal_logged = now
        counts, self._refused = self._refused, {}
        state = ""
        if self.backpressure is not None:
            state = (f" (backlog {self.backpressure.pending_bytes() / 1e6:.0f} MB, oldest "
                     f"{self.backpressure.oldest_age():.0f} s)")
        log.warning("ingest is refusing exports with 503 / UNAVAILABLE: %s%s", ", ".join(
            f"{count} for {why}" for why, count in sorted(counts.items())), state)

    @property
    def protobuf_decoder(self) -> str:
        return "c" if self.fast_decoder else "python"

    def export(self, identity: IngestIdentity | None, body: bytes, *, content_type: str, content_encoding: str = "",
               protocol: str = "http") -> ExportOutcome:
        outcome = self._export(identity, body, content_type, content_encoding, protocol)
        metrics.EXPORT_REQUESTS.labels(protocol, str(outcome.http_status)).inc()
        return outcome

    def _export(self, identity, body, content_type, content_encoding, protocol) -> ExportOutcome:
        if identity is None:
            return ExportOutcome(401, message="missing or invalid ingest key (Authorization: Bearer <key>)")
        if len(body) > self.max_body_bytes:
            return ExportOutcome(413, message=f"request body exceeds {self.max_body_bytes} bytes")
        refusal = self._refusal()
        if refusal is not None:
            return refusal
        media_type = (content_type or "").split(";", 1)[0].strip().lower()
        if media_type not in PROTOBUF_TYPES and media_type not in JSON_TYPES:
            return ExportOutcome(415, message="Content-Type must be application/x-protobuf or application/json")
        try:
            payload = decompress(body, content_encoding, self.max_decompressed_bytes)
            protobuf = media_type not in JSON_TYPES
            # The C parse holds no GIL and makes no Python object: outside the lock, it overlaps another
            # export's Python work.
            fast = parse_protobuf_fast(payload, self.limits) if protobuf and self.fast_decoder else None
            with self._cpu:
                if not protobuf:
                    decoded = decode_json(payload, self.limits)
                else:
                    metrics.DECODED_PAYLOADS.labels("python" if fast is None else "c").inc()
                    decoded = decode_protobuf(payload, self.limits) if fast is None else fast_decoded(fast)
                record, memo = build_record(identity, decoded) if decoded.spans else (None, None)
        except PayloadTooLarge as exc:
            return ExportOutcome(413, message=str(exc))
        except UnsupportedEncoding as exc:
            return ExportOutcome(415, message=str(exc))
        except MalformedPayload as exc:
            return ExportOutcome(400, message=str(exc))
        received = len(decoded.spans) + decoded.rejected_count
        metrics.SPANS_RECEIVED.labels(protocol).inc(received)
        for reason, count in decoded.rejected.items():
            metrics.SPANS_REJECTED.labels(protocol, reason).inc(count)
        if record is not None:
            try:
                self.spool.append(record, memo, arrival=record[8])
            except SpoolFull:
                metrics.BACKPRESSURE_REFUSALS.labels("spool_full").inc()
                return ExportOutcome(503, message=_REFUSALS["spool_full"], retry_after=self.retry_after)
            metrics.SPANS_ACCEPTED.labels(protocol).inc(len(decoded.spans))
            metrics.SPOOL_PENDING_BYTES.set(self.spool.pending_bytes)
        return ExportOutcome(200, accepted=len(decoded.spans), rejected=decoded.rejected_count, message=decoded.message())


_REFUSALS = {
    "spool_full": "ingest spool is full; retry later",
    "backlog_bytes": "ingest is behind (too much accepted data not yet queryable); retry later",
    "backlog_age": "ingest is behind (accepted data waits too long to become queryable); retry later",
}


def build_record(identity: IngestIdentity, decoded: Decoded, arrival: float | None = None) -> tuple[tuple, tuple]:
    """The spool record, and an in-memory memo `(calls, edges, retention_days, call span times by trace)` the
    request builder can
    use instead of reading these spans back from ClickHouse."""
    project_id = identity.project_id
    retention = identity.retention_days
    span_rows = []
    call_rows = []
    calls = []
    # (trace ids, span ids, parent span ids), one item per span: three lists rather than a tuple per span,
    # which the cyclic GC would examine while the memo waits in the spool and the decomposition's queue.
    edge_traces: list[str] = []
    edge_spans: list[str] = []
    edge_parents: list[str] = []
    # Call spans (collectors.base.CALL_SPAN_NAMES) that are not LLM calls: span id -> (start, end), per trace.
    call_times: dict[str, dict[str, tuple[int, int]]] = {}
    add_span_row = span_rows.append
    add_trace = edge_traces.append
    add_span = edge_spans.append
    add_parent = edge_parents.append
    resource = service = rid = days = None
    resources: dict[int, tuple[dict, int, set]] = {}  # id(resource dict) -> (resource, resource_id, days)
    # The C fast path (ingest/_otlp_fast.c) writes the span rows itself from the conventions found here.
    fast = decoded.fast
    conventions: list[str] = []
    add_convention = conventions.append
    for span, dropped in zip(decoded.spans, decoded.dropped):
        if span.resource is not resource:  # spans of one resource share its dict: resolve it once
            resource = span.resource
            service = span.service
            entry = resources.get(id(resource))
            if entry is None:
                entry = resources[id(resource)] = (resource, resource_id(resource), set())
            rid = entry[1]
            days = entry[2]
        days.add(span.start_ns // NS_PER_DAY)
        call = normalise_span(span)
        convention = "" if call is None else call.convention
        if fast is None:
            add_span_row(span_row(project_id, retention, span, dropped, convention, service, rid))
        else:
            add_convention(convention)
        if call is not None:
            call_rows.append(call_row(project_id, retention, call))
            calls.append(call)
        elif span.kind == SPAN_KIND_CLIENT or span.name in CALL_SPAN_NAMES:
            times = call_times.get(span.trace_id)
            if times is None:
                times = call_times[span.trace_id] = {}
            times[span.span_id] = (span.start_ns, span.end_ns)
        add_trace(span.trace_id)
        add_span(span.span_id)
        add_parent(span.parent_span_id)
    if decoded.truncated:
        metrics.ATTRIBUTES_TRUNCATED.inc(decoded.truncated)
    trace_ids = sorted(set(edge_traces))
    resource_rows = tuple(
        resource_row(project_id, rid, day, attributes, retention)
        for attributes, rid, days in resources.values() if rid
        for day in sorted(days)
    )
    if fast is None:
        spans_json = encode_rows(span_rows)
    else:
        rids = [resources.get(id(r), (None, 0))[1] for r in decoded.resources]  # 0: a resource without spans
        spans_json = fast.span_rows(project_id, retention, conventions, rids)
    record = (project_id, trace_ids, spans_json, encode_rows(call_rows), len(decoded.spans), len(call_rows),
              resource_rows, RECORD_FORMAT, time.time() if arrival is None else arrival)
    return record, (calls, (edge_traces, edge_spans, edge_parents), retention, call_times)


# The service this process runs (set by the process runner when its pipeline starts, None elsewhere): what the
# OTLP/HTTP view hands exports to.
_running: IngestService | None = None


def set_running(service: IngestService | None) -> None:
    global _running
    _running = service


def running() -> IngestService | None:
    return _running
