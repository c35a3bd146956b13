from django.contrib import admin
from django.urls import include, path, re_path
from ingest.views import otlp_traces
from traces.api import latency_summary_view, not_found_view, requests_view

from . import views

urlpatterns = [
    path("v1/traces", otlp_traces, name="otlp-traces"),
    path("api/v1/requests", requests_view, name="api-requests"),
    path("api/v1/latency/summary", latency_summary_view, name="api-latency-summary"),
    path("api/v1/engine", views.engine_view, name="api-engine"),
    path("api/v1/openapi.json", views.openapi, name="api-openapi"),
    path("api/v1/", include("slo.urls")),
    path("api/v1/", include("alerts.urls")),
    path("api/v1/", include("notify.urls")),
    re_path(r"^api/", not_found_view),  # after every API route: unknown API paths answer in JSON too
    path("metrics", views.prometheus_metrics, name="metrics"),
    path("healthz", views.healthz),
    path("readyz", views.readyz),
    path("admin/", admin.site.urls),
]
