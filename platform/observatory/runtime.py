"""The long-lived parts of one platform process: trace store, spool, writer, request builder and ingest service.

In embedded mode this process is the only one that may open the chdb directory, so
everything touching ClickHouse runs here, on threads.
"""
from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections
from ingest import service as ingest_service
from ingest.backpressure import Backpressure
from ingest.otlp import Limits
from ingest.rows import arrival_of
from ingest.service import IngestService
from ingest.spool import Spool
from ingest.writer import SpanWriter
from tenancy.models import Project
from traces import ch_migrate
from traces.request_builder import RequestBuilder
from traces.rollups import RollupBuilder
from traces.store import ClickHouseStore, get_store, set_pipeline_here

log = logging.getLogger(__name__)


class SpoolInUse(RuntimeError):
    pass


class PlatformRuntime:
    def __init__(self, store: ClickHouseStore | None = None, spool_dir: str | None = None):
        ingest = settings.INGEST
        self.store = store or get_store()
        self.spool_dir = Path(spool_dir or ingest["SPOOL_DIR"])
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.spool_dir / "LOCK", "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise SpoolInUse(f"another platform process is using the spool {self.spool_dir}") from None
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()
        self.spool = Spool(
            self.spool_dir,
            max_bytes=ingest["SPOOL_MAX_BYTES"],
            segment_bytes=ingest["SPOOL_SEGMENT_BYTES"],
            fsync=ingest["SPOOL_FSYNC"],
            cache_bytes=ingest["SPOOL_CACHE_BYTES"],
            arrival_of=arrival_of,
        )
        self.schema = ch_migrate.SchemaGate(self.store, log=log.info)
        self.builder = RequestBuilder(
            self.store,
            interval=ingest["DECOMPOSE_INTERVAL_SECONDS"],
            state_dir=self.spool_dir,
            schema=self.schema,
            project_ids=_project_ids,
            trace_window=ingest["TRACE_WINDOW_SECONDS"],
            max_span_age=ingest["MAX_SPAN_AGE_SECONDS"],
            max_pending_traces=ingest["DECOMPOSE_MAX_PENDING_TRACES"],
            chunk_traces=ingest["DECOMPOSE_CHUNK_TRACES"],
        )
        self.writer = SpanWriter(
            self.spool,
            self.store,
            batch_spans=ingest["WRITER_BATCH_SPANS"],
            max_delay=ingest["WRITER_MAX_DELAY_SECONDS"],
            on_written=self.builder.mark_written,
            schema=self.schema,
            room=self.builder.backlog.wait_for_room,
        )
        self.builder.insert_in_flight = self.writer.insert_in_flight
        self.backpressure = Backpressure(
            spool=self.spool,
            backlog=self.builder.backlog,
            store_unavailable=lambda: self.writer.store_unavailable,
            max_bytes=ingest["BACKLOG_MAX_BYTES"],
            max_age_seconds=ingest["BACKLOG_MAX_SECONDS"],
        )
        self.service = IngestService(
            self.spool,
            limits=Limits.from_settings(ingest),
            max_body_bytes=ingest["MAX_BODY_BYTES"],
            max_decompressed_bytes=ingest["MAX_DECOMPRESSED_BYTES"],
            retry_after=ingest["RETRY_AFTER_SECONDS"],
            fast_decoder=ingest["FAST_DECODER"],
            backpressure=self.backpressure,
        )
        self.rollups = RollupBuilder(
            self.store,
            interval=ingest["ROLLUP_INTERVAL_SECONDS"],
            settle_seconds=ingest["ROLLUP_SETTLE_SECONDS"],
            project_ids=_project_ids,
            schema=self.schema,
        )
        self.started = False

    def start(self, migrate: bool = True) -> None:
        if migrate:
            try:
                self.schema.ensure()
            except Exception as exc:  # ClickHouse away at start: ingest still works into the spool
                log.warning("ClickHouse not ready at start (%s); spooling until it is", exc)
        else:
            self.schema.ready = True
        self.writer.start()
        self.builder.start()
        self.rollups.start()
        self.started = True

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Everything accepted so far is in ClickHouse and decomposed (tests, benchmarks)."""
        return self.writer.wait_idle(timeout) and self.builder.wait_idle(timeout)

    def stop_threads(self) -> None:
        """Ask the writer, the decomposition and the rollups to stop at their next boundary (an insert,
        a chunk, a rollup step); they are joined by close()."""
        self.writer.stop()
        self.builder.stop()
        self.rollups.stop()

    def close(self, deadline: float | None = None) -> bool:
        """Stop the threads, then close the trace store once no call is inside it, then the spool, by
        `deadline` (time.monotonic()). False if some store call was still running then: the store is
        left open (closing chdb under it crashes the process), the rest is closed anyway."""
        if deadline is None:
            deadline = time.monotonic() + 30
        self.stop_threads()
        if self.started:
            for thread in (self.writer, self.builder, self.rollups, getattr(self.builder, "_loader", None)):
                if thread is not None and thread.is_alive():
                    thread.join(max(0.0, deadline - 1.0 - time.monotonic()))
                    if thread.is_alive():
                        log.warning("shutdown: %s did not stop in time", thread.name)
        clean = self.store.shutdown(timeout=max(0.0, deadline - time.monotonic()))
        self.spool.close()
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        self._lock_file.close()
        self.started = False
        return clean

    def stop(self) -> None:
        self.close()


def _project_ids() -> list[int]:
    close_old_connections()
    return list(Project.objects.values_list("id", flat=True))


_runtime: PlatformRuntime | None = None
_runtime_lock = threading.Lock()


def set_runtime(runtime: PlatformRuntime | None) -> None:
    """This process's pipeline (None: stopped), told to the apps through their own seams: ingest's OTLP/HTTP view
    finds the service, and jobs that need the store know whether this process may open it."""
    global _runtime
    with _runtime_lock:
        _runtime = runtime
        ingest_service.set_running(runtime.service if runtime is not None else None)
        set_pipeline_here(runtime is not None)


def get_runtime() -> PlatformRuntime | None:
    return _runtime
