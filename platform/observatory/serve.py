"""Run the whole platform in this process: runtime threads, OTLP/gRPC, the web server, and their ordered stop.

A SIGTERM (or the first Ctrl-C) stops the platform within OBSERVATORY_SHUTDOWN_TIMEOUT_SECONDS at any
backlog, in this order:

1. at once: the HTTP listener and OTLP/gRPC stop taking new exports; exports and API requests being
   handled finish, and a body still arriving gets until the drain deadline (http_server.py), so every
   export in flight is answered (200 once durable, else 503 with Retry-After); the in-process Celery
   worker and beat stop (durable state is in the database: what they were doing is done again later);
2. during the drain the writer and the decomposition keep working, then stop at their next boundary
   (an insert, a chunk): what is left stays in the spool and the backlog's checkpoint, and resumes on
   the next start;
3. the trace store refuses new calls, waits for the calls in flight, and only then closes chdb:
   a chdb closed, or an interpreter ended, under a thread still inside it crashed the process before.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time

from django.conf import settings
from ingest.grpc_server import build_server

from .http_server import HttpServer
from .runtime import PlatformRuntime, set_runtime
from .wsgi import application

log = logging.getLogger(__name__)


def tune_gc() -> None:
    """Make the cyclic garbage collector cheap for ingest's allocation pattern (called once, after startup).

    Ingest allocates tens of GC-tracked containers per span (decoded attributes, rows, LLM calls,
    protobuf wrappers), nearly all freed by reference counting within the request, while the
    spool cache, the batches in flight and the decomposition's trace memory keep promoting
    survivors into the old generation. With the default thresholds (700, 10, 10) the ingest
    benchmark (200k spans) ran ~3,900 young, ~360 middle and ~27 full collections, the full ones
    ~0.2 s each: about 7 s of the process's 12 s of Python time went to the collector.
    - freeze(): the ~80k objects of Django, the imports and the settings live forever; keep them
      out of every future collection.
    - threshold0 100,000: a young collection every few thousand spans; what it finds alive is what
      is really in flight, so far fewer objects are examined in total.
    - threshold1/threshold2 50/20: a full collection every ~10^8 allocations (tens of seconds at full
      load) instead of every 70,000; reference cycles are rare here (Django and the server make a
      few per request), so what waits for the next full collection stays small.
    Measured: ~190 young, ~16 middle, 2 full collections, ~0.3 s in all, for the same run.
    Python 3.14's incremental collector reads threshold1 differently and ignores threshold2, so
    there only the young-generation threshold is raised.
    """
    gc.collect()
    gc.freeze()
    if sys.version_info >= (3, 14):
        _, threshold1, threshold2 = gc.get_threshold()
        gc.set_threshold(100_000, threshold1, threshold2)
    else:
        gc.set_threshold(100_000, 50, 20)


class PlatformServer:
    def __init__(self, http_bind: str | None = None, grpc_bind: str | None = None, *, grpc_enabled: bool | None = None):
        self.http_bind = http_bind or settings.HTTP_BIND
        self.grpc_bind = grpc_bind or settings.OTLP_GRPC_BIND
        self.grpc_enabled = settings.OTLP_GRPC_ENABLED if grpc_enabled is None else grpc_enabled
        self.runtime: PlatformRuntime | None = None
        self.http: HttpServer | None = None
        self.grpc = None
        self.background = None  # the in-process Celery worker and beat (observatory.background), if any
        self._stopped = threading.Event()
        self._stopped_cleanly = threading.Event()  # the watchdog stands down
        self._shutdown_started: float | None = None  # monotonic time of the signal
        self._stopping_side: threading.Thread | None = None
        self._grpc_stopped = None

    def start(self) -> None:
        tune_gc()
        self.runtime = PlatformRuntime()
        self.runtime.start()
        set_runtime(self.runtime)
        if self.grpc_enabled:
            self.grpc = build_server(self.runtime.service, self.grpc_bind)
            self.grpc.start()
        http = settings.HTTP
        try:
            self.http = HttpServer(
                application,
                self.http_bind,
                threads=settings.HTTP_THREADS,
                max_connections=http["MAX_CONNECTIONS"],
                header_timeout=http["HEADER_TIMEOUT_SECONDS"],
                keepalive_timeout=http["KEEPALIVE_SECONDS"],
                body_timeout=http["BODY_TIMEOUT_SECONDS"],
                max_header_bytes=http["MAX_HEADER_BYTES"],
                # Bodies a little over the ingest limit reach the view, which answers 413 with an OTLP
                # Status body; the server itself cuts off (plain 413) only far beyond it.
                max_body_bytes=max(2 * settings.INGEST["MAX_BODY_BYTES"], settings.INGEST["MAX_BODY_BYTES"] + (4 << 20)),
                drain_seconds=settings.SHUTDOWN["DRAIN_SECONDS"],
                retry_after=settings.INGEST["RETRY_AFTER_SECONDS"],
            )
        except OSError:
            self.stop()
            raise
        self.http.server.on_shutdown_started = self._begin_stopping

    @property
    def http_port(self) -> int:
        return self.http.port

    @property
    def grpc_port(self) -> int | None:
        return self.grpc.bound_port if self.grpc else None

    def serve_forever(self) -> None:
        """Serve until a signal (install_signal_handlers) or request_shutdown(); then stop in order."""
        try:
            self.http.serve()
        except KeyboardInterrupt:
            log.info("interrupted")
        finally:
            self.stop()

    def request_shutdown(self) -> None:
        """Begin the ordered stop (safe from a signal handler)."""
        if self._shutdown_started is None:
            self._shutdown_started = time.monotonic()
        if self.http is not None:
            self.http.begin_shutdown()

    def _begin_stopping(self) -> None:
        """Called in the event loop as the HTTP server starts its drain: stop what runs beside it, in a
        thread, so the drain of both sides overlaps."""
        if self._shutdown_started is None:
            self._shutdown_started = time.monotonic()
        log.info("shutting down: no new connections; draining exports in flight")
        self._stopping_side = threading.Thread(target=self._stop_side, name="shutdown", daemon=True)
        self._stopping_side.start()
        threading.Thread(target=self._watchdog, name="shutdown-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        """The last resort: a stop that overruns its budget ends the process (exit status 1, so it is not
        taken for a clean stop). Nothing acknowledged is lost: the spool is durable and resumes."""
        budget = settings.SHUTDOWN["TIMEOUT_SECONDS"]
        if self._stopped_cleanly.wait(max(0.0, self._shutdown_started + budget - time.monotonic())):
            return
        log.error("shutdown did not finish within %.0fs; exiting now (acknowledged data stays in the spool)", budget)
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:  # a broken log stream must not keep the process alive
                pass
        os._exit(1)

    def _stop_side(self) -> None:
        drain = settings.SHUTDOWN["DRAIN_SECONDS"]
        if self.grpc is not None:
            self._grpc_stopped = self.grpc.stop(grace=drain)
        if self.background is not None:
            self.background.stop()
        runtime = self.runtime
        if runtime is not None:
            # The writer and the decomposition go on with the backlog while exports drain, then stop at
            # their next boundary; whatever is left resumes on the next start.
            remaining = drain - (time.monotonic() - self._shutdown_started)
            if remaining > 0:
                runtime.wait_idle(timeout=remaining)
            runtime.stop_threads()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._shutdown_started is None:
            self._shutdown_started = time.monotonic()
        budget = settings.SHUTDOWN["TIMEOUT_SECONDS"]
        deadline = self._shutdown_started + budget - 1.0
        if self._stopping_side is None:  # not started by the HTTP server (startup failure, interrupt)
            self._stop_side()
        else:
            self._stopping_side.join(max(0.0, deadline - time.monotonic()))
        if self.grpc is not None and self._grpc_stopped is not None:
            self._grpc_stopped.wait(max(0.0, deadline - time.monotonic()))
        if self.runtime is not None:
            set_runtime(None)
            clean = self.runtime.close(deadline=deadline)
            if not clean:
                log.error("shutdown: some thread was still inside the trace store at the deadline; "
                          "leaving it open (its data is durable; the next start resumes)")
        self._stopped_cleanly.set()
        log.info("stopped in %.1fs", time.monotonic() - self._shutdown_started)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT begin the ordered stop (the serving loop then returns and stop() finishes it).

        During that shutdown another SIGTERM is ignored: process managers and make send SIGTERM to a whole
        process group and then to their children again, and dying then would skip the drain and leave the
        engine fleet running. A second SIGINT (Ctrl-C twice) still ends the process at once."""

        def again(signum, frame):
            log.warning("already shutting down (draining, stopping the engine); Ctrl-C again or SIGKILL to force")

        def handle(signum, frame):
            signal.signal(signal.SIGTERM, again)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            self.request_shutdown()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)


def end_process(code: int = 0) -> None:
    """Leave the process: normally, or with os._exit when a thread that cannot be stopped is still alive
    (a webhook being sent by the in-process worker, a request still in Django): the interpreter would
    wait for it at exit. Everything durable is closed by then."""
    lingering = [t.name for t in threading.enumerate()
                 if t is not threading.current_thread() and t.is_alive() and not t.daemon]
    if not lingering:
        return
    log.warning("exiting with threads still running (%s); their work resumes after a restart",
                ", ".join(sorted(lingering)))
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # a broken log stream must not keep the process alive
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
