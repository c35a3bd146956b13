"""Run the whole platform in this process: runtime threads, OTLP/gRPC and the web server (waitress)."""
from __future__ import annotations

import gc
import logging
import signal
import sys
import threading

from django.conf import settings
from ingest.grpc_server import build_server
from waitress.server import create_server

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
      load) instead of every 70,000; reference cycles are rare here (Django and waitress make a
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


class _Shutdown(SystemExit):
    """Raised in the main thread by the signal handler to leave waitress's loop.

    A SystemExit: the signal can land anywhere in waitress's main-thread loop, whose handlers catch
    every exception but ExitNow, KeyboardInterrupt and SystemExit (wasyncore). Derived from Exception,
    it was once raised inside a channel's read handler, taken for that channel's error, and the loop
    went on serving: the platform never shut down."""


class PlatformServer:
    def __init__(self, http_bind: str | None = None, grpc_bind: str | None = None, *, grpc_enabled: bool | None = None):
        self.http_bind = http_bind or settings.HTTP_BIND
        self.grpc_bind = grpc_bind or settings.OTLP_GRPC_BIND
        self.grpc_enabled = settings.OTLP_GRPC_ENABLED if grpc_enabled is None else grpc_enabled
        self.runtime: PlatformRuntime | None = None
        self.http = None
        self.grpc = None
        self._stopped = threading.Event()

    def start(self) -> None:
        tune_gc()
        self.runtime = PlatformRuntime()
        self.runtime.start()
        set_runtime(self.runtime)
        if self.grpc_enabled:
            self.grpc = build_server(self.runtime.service, self.grpc_bind)
            self.grpc.start()
        host, _, port = self.http_bind.rpartition(":")
        self.http = create_server(
            application,
            host=host.strip("[]") or "127.0.0.1",
            port=int(port),
            threads=settings.HTTP_THREADS,
            # Bodies a little over the ingest limit reach the view, which answers 413 with an OTLP
            # Status body; waitress itself cuts off (plain 413) only far beyond it.
            max_request_body_size=max(2 * settings.INGEST["MAX_BODY_BYTES"], settings.INGEST["MAX_BODY_BYTES"] + (4 << 20)),
            channel_timeout=60,
            # Waitress reads bodies on its one I/O thread; with 8 KiB reads a 1 MB OTLP batch needs
            # ~128 GIL hand-offs while decoding threads run. Read big chunks and keep typical batches
            # in memory (larger ones spill to a temp file).
            recv_bytes=1024 * 1024,
            inbuf_overflow=4 * 1024 * 1024,
            connection_limit=200,
            ident="llm-observatory",
        )

    @property
    def http_port(self) -> int:
        return self.http.effective_port

    @property
    def grpc_port(self) -> int | None:
        return self.grpc.bound_port if self.grpc else None

    def serve_forever(self) -> None:
        try:
            self.http.run()
        except (_Shutdown, KeyboardInterrupt):
            log.info("shutting down")
        finally:
            self.stop()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.http is not None:
            self.http.close()
        if self.grpc is not None:
            self.grpc.stop(grace=5).wait(6)
        if self.runtime is not None:
            # Stop taking data, then let the writer drain what it can; the rest stays in the spool.
            set_runtime(None)
            self.runtime.wait_idle(timeout=10)
            self.runtime.stop()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT leave the serving loop in the main thread; stop() then drains and closes in order.

        During that shutdown another SIGTERM is ignored: process managers and make send SIGTERM to a whole
        process group and then to their children again, and dying then would skip the drain and leave the
        engine fleet running. A second SIGINT (Ctrl-C twice) still ends the process at once."""

        def again(signum, frame):
            log.warning("already shutting down (draining, stopping the engine); Ctrl-C again or SIGKILL to force")

        def handle(signum, frame):
            signal.signal(signal.SIGTERM, again)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            raise _Shutdown(f"signal {signum}")

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
