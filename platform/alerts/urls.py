"""JSON API routes of the alerts app (included under /api/v1/ by observatory/urls.py)."""
from django.urls import path

from . import views

urlpatterns = [
    path("alerts", views.alerts_view, name="api-alerts"),
    path("alerts/<str:fingerprint>", views.alert_view, name="api-alert"),
    path("silences", views.silences_view, name="api-silences"),
    path("silences/<int:silence_id>", views.silence_view, name="api-silence"),
]
