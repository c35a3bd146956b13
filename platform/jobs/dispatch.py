"""A kind of job kept in the database (a regression run, a tuning study): how it is enqueued, cancelled, claimed
and swept. Tasks are sent by their explicit names, so a service never imports its own tasks module."""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Callable

from celery import current_app
from django.db import transaction
from django.db.models import Model, Q
from django.utils import timezone

from . import leases

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class JobKind:
    model: type[Model]
    what: str  # names the job in logs and errors: "regression run"
    task: str  # the Celery task that executes one job: "regressions.execute"
    queued: str
    started: str  # the state a claim moves a queued job to
    running: tuple[str, ...]  # states in which a worker holds the job (its heartbeat must keep going)
    cancelled: str
    active: tuple[str, ...]
    stale_seconds: Callable[[], float]  # from settings, read when used
    queued_grace_seconds: Callable[[], float]


def send(task: str, *args, what: str = "job", expires: float | None = None) -> bool:
    """Send the named task; False (logged) when the broker is away: every kind's sweep starts what it missed.
    `expires`: seconds after which a worker drops the message unrun (work a periodic task does anyway)."""
    try:
        if current_app.conf.task_always_eager:  # CELERY_TASK_ALWAYS_EAGER: run it here, as .delay() would
            current_app.loader.import_default_modules()
            current_app.tasks[task].apply(args=list(args))
        else:
            current_app.send_task(task, args=list(args), expires=expires)
    except Exception:  # noqa: BLE001 - any broker failure: the database still holds the job
        log.warning("could not enqueue %s %s (%s); the sweep will start it", what, args, task, exc_info=True)
        return False
    return True


def enqueue(kind: JobKind, job_id: int) -> bool:
    return send(kind.task, job_id, what=kind.what)


def enqueue_on_commit(kind: JobKind, job_id: int) -> None:
    """Enqueue once the transaction that created the job commits (a worker must find its row)."""
    transaction.on_commit(lambda: enqueue(kind, job_id))


def cancel(kind: JobKind, job: Model) -> bool:
    """Ask a job to stop; a queued job is cancelled at once. False when it has already ended."""
    now = timezone.now()
    objects = kind.model.objects
    if objects.filter(id=job.id, state=kind.queued).update(state=kind.cancelled, cancel_requested=True,
                                                           finished_at=now):
        return True
    return bool(objects.filter(id=job.id, state__in=kind.active).update(cancel_requested=True))


def claim(kind: JobKind, job_id: int, logger: logging.Logger = log) -> Model | None:
    """Take a queued job, or one whose worker stopped beating (a resume), and say which in ``logger`` (the kind's
    execution module's, so that a job's story reads in one log); None when another worker has it."""
    job = leases.claim(kind.model, job_id, queued=kind.queued, started=kind.started, running=kind.running,
                       stale_seconds=kind.stale_seconds())
    if job is not None:
        logger.info("%s %s: %s (attempt %s)", kind.what, job.id, "resuming" if job.attempts > 1 else "starting",
                    job.attempts)
    return job


def lease(kind: JobKind, job: Model) -> leases.Lease:
    return leases.Lease(job, kind.what, kind.stale_seconds())


def sweep(kind: JobKind) -> int:
    """Enqueue queued jobs nobody took and jobs whose worker stopped beating (a crash, a restart); end the jobs
    whose cancel was asked after their worker died. The number enqueued."""
    now = timezone.now()
    stale = now - dt.timedelta(seconds=kind.stale_seconds())
    queued_for = now - dt.timedelta(seconds=kind.queued_grace_seconds())
    objects = kind.model.objects
    ids = list(objects.filter(Q(state=kind.queued, created_at__lt=queued_for)
                              | Q(state__in=kind.running, heartbeat_at__lt=stale),
                              cancel_requested=False).values_list("id", flat=True)[:20])
    # A cancel asked of a job whose worker is gone: nobody else will finish it.
    objects.filter(state__in=kind.running, heartbeat_at__lt=stale, cancel_requested=True).update(
        state=kind.cancelled, finished_at=now)
    for job_id in ids:
        enqueue(kind, job_id)
    return len(ids)
