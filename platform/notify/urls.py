"""JSON API routes of the notify app (included under /api/v1/ by observatory/urls.py)."""
from django.urls import path

from . import views

urlpatterns = [
    path("channels", views.channels_view, name="api-channels"),
    path("channels/<int:channel_id>", views.channel_view, name="api-channel"),
    path("channels/<int:channel_id>/test", views.channel_test_view, name="api-channel-test"),
    path("channels/<int:channel_id>/deliveries", views.channel_deliveries_view, name="api-channel-deliveries"),
]
