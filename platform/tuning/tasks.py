"""Celery tasks of tuning studies (queue `tuning`; the sweep is on the beat schedule). Studies and their trial
workers are enqueued by the tasks' names (jobs.dispatch), so the service never imports this module."""
from celery import shared_task

from . import calibration, execution, service
from . import trials as study_trials


@shared_task(name="tuning.execute", ignore_result=True)
def execute(study_id: int) -> str | None:
    """Run (or resume) one study to its end; does nothing when another worker holds it."""
    return execution.execute(study_id)


@shared_task(name="tuning.trials", ignore_result=True)
def trials(study_id: int) -> int:
    """Run trials of a searching study beside its own execution (ask-and-tell on the shared Optuna storage)."""
    return study_trials.run_trials(study_id)


@shared_task(name="tuning.sweep", ignore_result=True)
def sweep() -> int:
    """Start queued studies and calibrations nobody took; resume those whose worker stopped beating (crash,
    restart)."""
    return service.sweep() + calibration.sweep()


@shared_task(name="tuning.calibrate", ignore_result=True)
def calibrate(model_id: int) -> str | None:
    """Fit one queued engine model (tuning.calibration)."""
    return calibration.execute(model_id)


@shared_task(name="tuning.calibrate_groups", ignore_result=True)
def calibrate_groups() -> int:
    """Measure every newest engine model's error on its group's latest traffic; queue a calibration for every
    group with enough traffic and no recent model (when periodic calibration is on)."""
    calibration.refresh_live_errors()
    return calibration.calibrate_groups()
