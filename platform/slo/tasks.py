"""Celery tasks of the slo app: thin wrappers named explicitly (the schedule is in observatory/celery_app.py)."""
from __future__ import annotations

import logging
import threading

from celery import shared_task
from django.conf import settings
from traces import store

from . import evaluation, metrics

log = logging.getLogger(__name__)
# One cycle at a time per process: a tick that arrives while the previous cycle still runs (a long bucket
# backfill) is dropped, not run beside it; the next tick does the same work.
_cycle = threading.Lock()


def may_touch_clickhouse() -> bool:
    """With chdb only the `runplatform` process may open the store: a worker elsewhere must not take it
    (it would fail, or worse, hold the directory and keep the platform from starting)."""
    if not settings.EMBEDDED_MODE:
        return True
    return store.pipeline_here()


@shared_task(name="slo.evaluate_all", ignore_result=True)
def evaluate_all_task() -> int:
    if not may_touch_clickhouse():
        metrics.evaluation_skipped("not_owner")
        log.warning("slo.evaluate_all skipped: ClickHouse is chdb and this process is not the platform that owns it "
                    "(run evaluation inside `runplatform`, OBSERVATORY_INPROCESS_WORKER=true)")
        return 0
    if not _cycle.acquire(blocking=False):
        metrics.evaluation_skipped("busy")
        log.info("slo.evaluate_all skipped: the previous cycle is still running")
        return 0
    try:
        return evaluation.evaluate_all()
    finally:
        _cycle.release()
