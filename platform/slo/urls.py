"""JSON API routes of the slo app (included under /api/v1/ by observatory/urls.py)."""
from django.urls import path

from . import api

urlpatterns = [
    path("slos", api.slos_view, name="api-slos"),
    path("slos/<slug:name>", api.slo_view, name="api-slo"),
    path("slos/<slug:name>/history", api.slo_history_view, name="api-slo-history"),
]
