"""Leased background jobs (regression runs, tuning studies): a row is claimed with a conditional update that
writes a random lease token, a thread keeps its heartbeat going, and every later write of the execution is
conditional on the token, so a worker that stalled past the stale time and lost its job to another changes
nothing any more. The sweeps re-claim jobs whose heartbeat went stale (their worker died)."""
from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections.abc import Iterable
from typing import Self

from django.db import connection
from django.db.models import F, Model, QuerySet
from django.utils import timezone

# Set when this process's worker is stopping (observatory.background, or Celery's worker_shutting_down): a job
# stops where it is, keeps what finished, and stays claimed; a sweep after the restart resumes it.
SHUTTING_DOWN = threading.Event()


class LeaseLost(RuntimeError):
    """Another worker holds the job now."""


def claim(model: type[Model], job_id: int, *, queued: str, started: str, running: Iterable[str],
          stale_seconds: float) -> Model | None:
    """Take a ``queued`` job (its state becomes ``started``), or one in a ``running`` state whose worker stopped
    beating for ``stale_seconds`` (a resume); None when another worker has it or a cancel was asked."""
    now = timezone.now()
    lease = uuid.uuid4().hex
    taken = model.objects.filter(id=job_id, state=queued, cancel_requested=False).update(
        state=started, started_at=now, heartbeat_at=now, attempts=F("attempts") + 1, lease=lease)
    if not taken:
        taken = model.objects.filter(
            id=job_id, state__in=list(running), heartbeat_at__lt=now - dt.timedelta(seconds=stale_seconds),
            cancel_requested=False).update(heartbeat_at=now, attempts=F("attempts") + 1, lease=lease)
    return model.objects.get(id=job_id) if taken else None


def leased_update(job: Model, what: str, **fields) -> None:
    """A write of the execution holding ``job``'s lease; LeaseLost when another worker has the job now."""
    if not type(job).objects.filter(id=job.id, lease=job.lease).update(**fields):
        raise LeaseLost(f"{what} {job.id} was taken over by another worker")


class Heartbeat:
    """Beats the ``heartbeat_at`` of the rows ``rows`` selects (selected again at each beat) from a thread of its
    own, every quarter of the stale time, while the block it guards runs: a tuning worker's trial leases. ``Lease``
    beats a claimed job's row this way."""

    def __init__(self, rows: QuerySet | None, name: str, stale_seconds: float):
        self.rows = rows
        self.interval = max(0.2, stale_seconds / 4.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _keep(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                if not self.beat():
                    return
        finally:
            connection.close()

    def beat(self) -> bool:
        """One beat; False ends the thread."""
        self.rows.update(heartbeat_at=timezone.now())
        return True


class Lease(Heartbeat):
    """Keeps a claimed job's heartbeat going from a thread of its own, and says when the lease was lost or a
    cancel asked. ``what`` names the job in errors ("regression run")."""

    def __init__(self, job: Model, what: str, stale_seconds: float):
        super().__init__(None, f"lease-{what.replace(' ', '-')}-{job.id}", stale_seconds)
        self.job = job
        self.what = what
        self.lost = False
        self.cancel_asked = False

    def beat(self, **fields) -> bool:
        model = type(self.job)
        if not model.objects.filter(id=self.job.id, lease=self.job.lease).update(heartbeat_at=timezone.now(),
                                                                                  **fields):
            self.lost = True
            return False
        self.cancel_asked = model.objects.filter(id=self.job.id, cancel_requested=True).exists()
        return True

    def check(self) -> None:
        """LeaseLost when another worker took the job over."""
        if self.lost:
            raise LeaseLost(f"{self.what} {self.job.id} was taken over by another worker")

    def stop_now(self) -> bool:
        """The job should stop where it is: lease lost, cancel asked, or this worker stopping."""
        return self.lost or self.cancel_asked or SHUTTING_DOWN.is_set()
