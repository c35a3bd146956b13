"""Celery tasks of loops (queue `loops`; the sweep is on the beat schedule)."""
from celery import shared_task

from . import machine


@shared_task(name="loops.advance", ignore_result=True)
def advance(loop_id: int) -> str | None:
    """One tick of one loop."""
    return machine.advance(loop_id)


@shared_task(name="loops.sweep", ignore_result=True)
def sweep() -> int:
    """Tick every active loop: the beat's clock (studies and rollouts end on their own time)."""
    return machine.sweep()
