"""Process-level endpoints: health, readiness, Prometheus metrics and the OpenAPI document."""
from apikit.api import ApiError, ApiTokenAuth, error_response
from django.http import HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from ingest import metrics
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from rollouts.metrics import RolloutCollector
from slo.metrics import SloCollector
from traces import metrics as decomposition_metrics
from traces.store import StoreUnavailable, get_store
from tuning.metrics import EngineModelCollector

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
    """Prometheus text format. Process, ingest and platform series are open, as Prometheus expects; the per-SLO
    series name projects and SLOs, so they come only with an API token (`authorization` in the scrape config),
    for that token's projects. A token that is wrong gets 401 (and counts against its address, as on the API)."""
    project_ids: list[int] = []
    if request.headers.get("Authorization"):
        try:
            identity = ApiTokenAuth()(request)
        except ApiError as exc:
            return error_response(request, exc)
        project_ids = list(identity.projects)
    runtime = get_runtime()
    if runtime is not None:
        runtime.backpressure.publish()
        metrics.SPOOL_CACHE_BYTES.set(runtime.spool.cache_bytes)
        decomposition_metrics.DECOMPOSE_MEMORY_TRACES.set(len(runtime.builder.memory))
        if runtime.store.embedded:
            try:
                tracked = runtime.store.system_query("SELECT value FROM system.metrics WHERE metric = 'MemoryTracking'")
                metrics.CLICKHOUSE_MEMORY_BYTES.set(tracked[0][0] if tracked else 0)
            except StoreUnavailable:
                pass
    body = generate_latest()
    if project_ids:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SloCollector(project_ids))
        registry.register(RolloutCollector(project_ids))
        registry.register(EngineModelCollector(project_ids))
        body += generate_latest(registry)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
