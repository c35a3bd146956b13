"""Celery tasks of tuning studies (queue `tuning`; the sweep is on the beat schedule)."""
from celery import shared_task

from . import service


@shared_task(name="tuning.execute", ignore_result=True)
def execute(study_id: int) -> str | None:
    """Run (or resume) one study to its end; does nothing when another worker holds it."""
    return service.execute(study_id)


@shared_task(name="tuning.trials", ignore_result=True)
def trials(study_id: int) -> int:
    """Run trials of a searching study beside its own execution (ask-and-tell on the shared Optuna storage)."""
    return service.run_trials(study_id)


@shared_task(name="tuning.sweep", ignore_result=True)
def sweep() -> int:
    """Start queued studies nobody took; resume studies whose worker stopped beating (crash, restart)."""
    return service.sweep()
