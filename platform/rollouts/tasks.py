"""Celery tasks of rollouts (queue `rollouts`; the sweep is on the beat schedule)."""
from celery import shared_task

from . import machine


@shared_task(name="rollouts.advance", ignore_result=True)
def advance(rollout_id: int) -> str | None:
    """One tick of one rollout (nothing when another worker is advancing it)."""
    return machine.advance(rollout_id)


@shared_task(name="rollouts.sweep", ignore_result=True)
def sweep() -> int:
    """Advance every active rollout: the beat's clock for canary steps, and what resumes them after a restart."""
    return machine.sweep()
