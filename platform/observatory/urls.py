from django.contrib import admin
from django.urls import include, path, re_path
from ingest.views import otlp_traces
from traces.api import not_found_view

from . import views
from .api import api, paths


def _routers():
    from alerts.api import router as alerts
    from notify.api import router as channels
    from regressions.api import router as regressions
    from rollouts.api import router as rollouts
    from slo.api import router as slos
    from traces.api import router as requests
    from tuning.api import router as tuning

    from .engine_api import router as engine

    return (("", requests), ("", engine), ("", slos), ("", alerts), ("", channels), ("", regressions), ("", tuning),
            ("", rollouts))


paths(_routers())

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
