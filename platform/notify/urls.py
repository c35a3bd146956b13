"""JSON API routes of the notify app (included under /api/v1/ by observatory/urls.py)."""
urlpatterns: list = []
