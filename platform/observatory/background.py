"""The Celery worker (thread pool) and beat that `runplatform` runs in its own process when
OBSERVATORY_INPROCESS_WORKER is on (the default with chdb, which only this process may open).

Both are threads: a worker's prefork pool or a beat process would fork a process that holds the
embedded ClickHouse and the ingest threads. Durable state lives in the database, so a stop
between a tick and its task loses nothing that the next tick does not redo.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

from celery.beat import EmbeddedService
from celery.worker import WorkController, state
from django.conf import settings
from jobs.leases import SHUTTING_DOWN

from observatory.celery_app import QUEUES, app, queue_name

log = logging.getLogger(__name__)


class InProcessWorker:
    def __init__(self, *, concurrency: int | None = None, beat: bool = True):
        self.concurrency = concurrency or settings.OBSERVATORY_INPROCESS_WORKER_THREADS
        self.with_beat = beat
        self.worker = None
        self.beat = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        app.loader.import_default_modules()
        _ensure_broker_folders()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run_worker, name="celery-worker", daemon=True)
        self._thread.start()
        if self.with_beat:
            self.beat = EmbeddedService(app, thread=True)
            self.beat.start()
        log.info("in-process Celery worker (%d threads)%s started on %s", self.concurrency,
                 " and beat" if self.with_beat else "", settings.CELERY_BROKER_URL.split("://", 1)[0])

    def _new_worker(self):
        return WorkController(
            app=app,
            hostname=f"platform-{socket.gethostname()}-{id(self):x}@localhost",
            pool_cls="threads",
            concurrency=self.concurrency,
            queues=[queue_name(q) for q in QUEUES],
            without_heartbeat=True,
            without_mingle=True,
            without_gossip=True,
            optimization="fair",
        )

    def _run_worker(self) -> None:
        """Run the worker; if its consumer dies (a broker outage it gave up on), start a new one."""
        backoff = 1.0
        while not self._stopping.is_set():
            self.worker = self._new_worker()
            started = time.monotonic()
            try:
                self.worker.start()
            except Exception:
                log.exception("in-process Celery worker stopped")
            if self._stopping.is_set():
                return
            backoff = 1.0 if time.monotonic() - started > 60 else min(backoff * 2, 30.0)
            log.warning("in-process Celery worker exited; starting it again in %.0f s", backoff)
            self._stopping.wait(backoff)

    def stop(self) -> None:
        self._stopping.set()
        SHUTTING_DOWN.set()  # running regression runs stop sending and are resumed after a restart
        if self.worker is not None:
            # Asked, not forced: the consumer loop sees the flag at its next turn (within the 2 s its polling read
            # of the filesystem broker waits; a second with Redis) and shuts the worker down in its own thread.
            # Stopping it from this thread closed the broker connection under the loop's read ("I/O operation on
            # closed file", a CRITICAL traceback at every shutdown with Redis). Asked first, so that it winds down
            # while beat stops (beat sleeps up to a second between ticks).
            state.should_stop = 0
        if self.beat is not None:
            self.beat.stop()
            self.beat = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive() and self.worker is not None:
                log.warning("the in-process Celery worker did not stop within 10 s; stopping it")
                try:
                    self.worker.stop(in_sighandler=False, exitcode=0)
                except Exception:  # a worker that failed to start has nothing to stop
                    log.debug("stopping the in-process worker", exc_info=True)
                self._thread.join(timeout=5)
            self._thread = None
        self.worker = None


def _ensure_broker_folders() -> None:
    options = settings.CELERY_BROKER_TRANSPORT_OPTIONS or {}
    for key in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder"):
        if options.get(key):
            Path(options[key]).mkdir(parents=True, exist_ok=True)


def start_background() -> InProcessWorker | None:
    """Start the in-process worker and beat when the settings ask for them (called by runplatform)."""
    if not settings.OBSERVATORY_INPROCESS_WORKER:
        return None
    worker = InProcessWorker()
    worker.start()
    return worker
