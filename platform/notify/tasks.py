"""Celery tasks of the notify app: thin wrappers over notify.services (scheduled by observatory/celery_app.py)."""
from celery import shared_task

from . import services


@shared_task(name="notify.deliver_due", ignore_result=True)
def deliver_due_task(limit: int = 100) -> int:
    """Claim and send the deliveries that are due; safe to run on several workers at once."""
    return services.deliver_due(limit=limit)


@shared_task(name="notify.prune_deliveries", ignore_result=True)
def prune_deliveries_task() -> int:
    """Delete finished deliveries older than NOTIFY_DELIVERY_RETENTION_DAYS in bounded batches."""
    return services.prune_deliveries()
