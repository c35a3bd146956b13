"""JSON API routes of the slo app (included under /api/v1/ by observatory/urls.py)."""
urlpatterns: list = []
