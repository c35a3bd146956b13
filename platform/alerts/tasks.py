"""Celery tasks of the alerts app: thin wrappers over alerts.regression and alerts.lifecycle (scheduled by
observatory/celery_app.py every evaluation interval)."""
import logging

from celery import shared_task
from django.db import close_old_connections
from slo.tasks import may_touch_clickhouse

from . import lifecycle, regression

log = logging.getLogger(__name__)


@shared_task(name="alerts.detect_regressions", ignore_result=True)
def detect_regressions_task() -> int:
    """Flag p50 e2e/TTFT regressions per (service, model); safe to run on several workers at once."""
    if not may_touch_clickhouse():
        log.warning("alerts.detect_regressions skipped: ClickHouse is chdb and this process does not own it")
        return 0
    close_old_connections()  # a long-lived worker thread: drop connections past their age or broken
    return regression.detect_regressions()


@shared_task(name="alerts.check_repeats", ignore_result=True)
def check_repeats_task() -> int:
    """Repeat notifications of firing alerts, first notifications of unmuted ones, orphans of deleted SLOs.
    Where ClickHouse may not be opened (chdb owned by the platform process) the stored diagnosis is resent."""
    close_old_connections()
    return lifecycle.check_repeats(refresh_diagnosis=may_touch_clickhouse())
