"""The Celery application; its broker comes from settings (Redis/RabbitMQ, or the local filesystem when embedded)."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "observatory.settings")

app = Celery("observatory")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
