"""Process-level endpoints: health, readiness, Prometheus metrics and the OpenAPI document."""
from django.http import HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from ingest import metrics
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from traces.store import StoreUnavailable, get_store

from .engine_link import fleet_state
from .jsonapi import ApiError, json_view
from .openapi import OPENAPI
from .runtime import get_runtime


@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


@require_GET
def readyz(request):
    runtime = get_runtime()
    store_ok = get_store().ping()
    backlog = runtime.backpressure.publish() if runtime else {}
    body = {
        "ingest": runtime is not None,
        "clickhouse": store_ok,
        "spool_pending_bytes": runtime.spool.pending_bytes if runtime else None,
        # Traces stored and waiting for decomposition (or in the chunk being decomposed), and the spool
        # bytes of those batches: traces/backlog.py.
        "decomposition_pending": runtime.builder.pending_traces() if runtime else None,
        "decomposition_pending_bytes": backlog.get("decomposition_pending_bytes"),
        # Accepted and not yet queryable: bytes (spool + decomposition) and the oldest one's age; ingest
        # refuses exports beyond INGEST_BACKLOG_MAX_BYTES / _SECONDS (ingest/backpressure.py), and says so.
        "backlog_bytes": backlog.get("backlog_bytes"),
        "backlog_oldest_seconds": backlog.get("backlog_oldest_seconds"),
        "backpressure": runtime.backpressure.refusal() if runtime else None,
        # "off" (every trace looked up), "loading" (traces written before the start being read back:
        # looked up meanwhile) or "ready" (traces new to the store need no lookup): traces/trace_filter.py
        "trace_filter": runtime.builder.filter_state() if runtime else None,
        # "c": protobuf payloads take the C fast path when they can (ingest/_otlp_fast.c); "python": it is
        # not built (no C compiler at install) or INGEST_FAST_DECODER turned it off.
        "protobuf_decoder": runtime.service.protobuf_decoder if runtime else None,
    }
    return JsonResponse(body, status=200 if runtime is not None else 503)


@require_GET
def prometheus_metrics(request):
    runtime = get_runtime()
    if runtime is not None:
        runtime.backpressure.publish()
        metrics.SPOOL_CACHE_BYTES.set(runtime.spool.cache_bytes)
        metrics.DECOMPOSE_MEMORY_TRACES.set(len(runtime.builder.memory))
        if runtime.store.embedded:
            try:
                tracked = runtime.store.system_query("SELECT value FROM system.metrics WHERE metric = 'MemoryTracking'")
                metrics.CLICKHOUSE_MEMORY_BYTES.set(tracked[0][0] if tracked else 0)
            except StoreUnavailable:
                pass
    return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)


@require_GET
def openapi(request):
    return JsonResponse(OPENAPI)


@json_view("GET")
def engine_view(request, identity):
    """``GET /api/v1/engine``: the managed engine fleet (groups, weights, config versions, replica states)."""
    if not identity.projects:
        raise ApiError(403, "this token has no role in any project")
    return fleet_state()
