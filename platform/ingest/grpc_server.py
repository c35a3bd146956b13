"""OTLP/gRPC receiver: opentelemetry.proto.collector.trace.v1.TraceService/Export on port 4317.

The request arrives as raw bytes (no deserializer) and goes through the same
IngestService as OTLP/HTTP, so limits, validation and durability are identical.
"""
from __future__ import annotations

import logging
from concurrent import futures

import grpc
from django.db import close_old_connections
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from tenancy.keys import bearer_token, resolve_ingest_key

from .service import IngestService

log = logging.getLogger(__name__)

SERVICE_NAME = "opentelemetry.proto.collector.trace.v1.TraceService"
_RETRYABLE = {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}


def _export_handler(service: IngestService):
    def export(request_bytes: bytes, context: grpc.ServicerContext) -> bytes:
        close_old_connections()
        metadata = dict(context.invocation_metadata())
        identity = resolve_ingest_key(bearer_token(metadata.get("authorization")))
        outcome = service.export(identity, request_bytes, content_type="application/x-protobuf", protocol="grpc")
        if outcome.ok:
            return outcome.response_body(as_json=False)
        code_name = outcome.grpc_code_name()
        code = getattr(grpc.StatusCode, code_name)
        if outcome.retry_after is not None and code_name in _RETRYABLE:
            detail = any_pb2.Any()
            detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=outcome.retry_after)))
            status = status_pb2.Status(code=code.value[0], message=outcome.message, details=[detail])
            context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
        context.abort(code, outcome.message)

    return export


def build_server(service: IngestService, bind: str, *, max_workers: int = 8) -> grpc.Server:
    limit = max(service.max_decompressed_bytes, service.max_body_bytes)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="otlp-grpc"),
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", 4 * 1024 * 1024),
        ],
        maximum_concurrent_rpcs=max_workers * 8,
    )
    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {"Export": grpc.unary_unary_rpc_method_handler(_export_handler(service))},
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"cannot listen for OTLP/gRPC on {bind}: address already in use or not permitted")
    server.bound_port = port
    return server
