"""JSON API routes of the alerts app (included under /api/v1/ by observatory/urls.py)."""
urlpatterns: list = []
