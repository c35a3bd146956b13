"""The Django project of the LLM latency observatory: settings, URLs, Celery app and the process runner."""
from .celery_app import app as celery_app

__all__ = ["celery_app"]
