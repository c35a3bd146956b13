"""Celery tasks of regression runs (queue `regressions`; the sweep is on the beat schedule). Runs are enqueued by
the task's name (jobs.dispatch), so the service never imports this module."""
from celery import shared_task, signals
from jobs.leases import SHUTTING_DOWN

from . import execution, service


@signals.worker_shutting_down.connect(weak=False)
def _stopping(**kwargs) -> None:
    SHUTTING_DOWN.set()


@shared_task(name="regressions.execute", ignore_result=True)
def execute(run_id: int) -> str | None:
    """Run (or resume) one regression run to its end; does nothing when another worker holds it."""
    return execution.execute(run_id)


@shared_task(name="regressions.sweep", ignore_result=True)
def sweep() -> int:
    """Start queued runs that no worker took, resume runs whose worker stopped (platform restart)."""
    return service.sweep()
