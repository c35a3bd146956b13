from alerts.api import router as alerts
from apikit.api import api, paths, unavailable
from django.contrib import admin
from django.urls import include, path, re_path
from fleet.api import router as engine
from ingest.views import otlp_traces
from loops.api import router as loops
from notify.api import router as channels
from regressions.api import router as regressions
from rollouts.api import router as rollouts
from slo.api import router as slos
from traces.api import not_found_view
from traces.api import router as requests
from traces.store import StoreUnavailable
from tuning.api import router as tuning

from . import views

# Every app's router under /api/v1 (one OpenAPI document), in the order the document lists them.
paths((("", requests), ("", engine), ("", slos), ("", alerts), ("", channels), ("", regressions), ("", tuning),
       ("", rollouts), ("", loops)))
unavailable(StoreUnavailable, "the trace store is unavailable; retry shortly")

urlpatterns = [
    path("v1/traces", otlp_traces, name="otlp-traces"),
    path("api/v1/", api.urls),
    re_path(r"^api/", not_found_view),  # after every API route: unknown API paths answer in JSON too
    path("metrics", views.prometheus_metrics, name="metrics"),
    path("healthz", views.healthz),
    path("readyz", views.readyz),
    path("admin/", admin.site.urls),
    path("", include("dashboards.urls")),
]
