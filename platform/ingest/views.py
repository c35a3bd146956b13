"""OTLP/HTTP receiver: POST /v1/traces."""
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods
from tenancy.keys import bearer_token, resolve_ingest_key

from . import service as ingest_service
from .service import JSON_TYPES, ExportOutcome


@csrf_exempt
@require_http_methods(["POST"])
def otlp_traces(request: HttpRequest) -> HttpResponse:
    content_type = request.META.get("CONTENT_TYPE", "")
    as_json = content_type.split(";", 1)[0].strip().lower() in JSON_TYPES
    service = ingest_service.running()
    if service is None:
        outcome = ExportOutcome(503, message="ingest is not running in this process", retry_after=5)
    else:
        identity = resolve_ingest_key(bearer_token(request.META.get("HTTP_AUTHORIZATION")))
        length = request.META.get("CONTENT_LENGTH")
        limit = service.max_body_bytes
        if identity is None:
            outcome = ExportOutcome(401, message="missing or invalid ingest key (Authorization: Bearer <key>)")
        elif length and length.isdigit() and int(length) > limit:
            outcome = ExportOutcome(413, message=f"request body exceeds {limit} bytes")
        else:
            body = request.read(limit + 1)
            outcome = service.export(
                identity,
                body,
                content_type=content_type,
                content_encoding=request.META.get("HTTP_CONTENT_ENCODING", ""),
                protocol="http",
            )
    response = HttpResponse(
        outcome.response_body(as_json),
        status=outcome.http_status,
        content_type="application/json" if as_json else "application/x-protobuf",
    )
    if outcome.retry_after is not None:
        response["Retry-After"] = str(outcome.retry_after)
    return response
