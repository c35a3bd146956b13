"""Running a simulated replica inside an asyncio program: bind, serve, drain and stop.

``ReplicaServer`` is what other programs (the fleet controller, tests, benchmarks) use;
``run_replica`` is the foreground loop behind ``python -m engine.replica``.

Shutdown follows vLLM behind uvicorn: stop accepting connections, let in-flight requests
finish for up to ``shutdown_timeout`` seconds (``/health`` answers 503 meanwhile, and new
requests on open connections are refused with 503), abort what is left (streams get an
error event, JSON requests a 503), flush the spans, close.
"""
from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider

from engine.addresses import host_port
from engine.config import EngineConfig
from engine.replica.app import (
    DEFAULT_EMBEDDING_DIMENSION,
    DEFAULT_MAX_BODY_BYTES,
    ReplicaState,
    build_replica_app,
    replica_state,
)
from engine.replica.driver import ABORT_SHUTDOWN
from engine.sim.options import SimOptions

log = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = 10.0


class ReplicaServer:
    """One simulated replica listening on ``host:port`` (port 0 picks a free one; see ``.port``).

    Building it builds the simulated engine core, so a config the simulator cannot run
    raises here (``ValueError``, or ``LookupError`` for a model/GPU without a profile).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        group: str = "default",
        served_model_name: str | None = None,
        tracer_provider: TracerProvider | None = None,
        options: SimOptions | None = None,
        seed: int = 0,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        enable_prompt_tokens_details: bool = False,
        embedding_dimension: int = DEFAULT_EMBEDDING_DIMENSION,
    ):
        self.config = config
        self.host = host
        self.port = port
        self.shutdown_timeout = shutdown_timeout
        self.app = build_replica_app(
            config,
            group=group,
            served_model_name=served_model_name,
            tracer_provider=tracer_provider,
            options=options,
            seed=seed,
            max_body_bytes=max_body_bytes,
            enable_prompt_tokens_details=enable_prompt_tokens_details,
            embedding_dimension=embedding_dimension,
        )
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._stopping: asyncio.Task | None = None

    @property
    def state(self) -> ReplicaState:
        return replica_state(self.app)

    @property
    def url(self) -> str:
        return f"http://{host_port(self.host, self.port)}"

    async def start(self) -> None:
        # handler_cancellation: a client that disconnects cancels its handler at once (the
        # driver's transport watcher is the backstop for runners that do not set it).
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=self.shutdown_timeout + 5
        )
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await self._site.start()
        except BaseException:
            await self._runner.cleanup()
            raise
        addresses = self._runner.addresses
        if addresses:
            self.port = addresses[0][1]

    async def stop(self, timeout: float | None = None) -> None:
        """Drain (up to ``timeout``, default ``shutdown_timeout``) and close; safe to call more than once."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(self.shutdown_timeout if timeout is None else timeout))
        await asyncio.shield(self._stopping)

    def abort_in_flight(self) -> None:
        """Give up on the in-flight requests now (a second SIGTERM/SIGINT)."""
        state = self.state
        state.draining = True
        if state.driver is not None:
            state.driver.abort_all(ABORT_SHUTDOWN)

    async def _stop(self, timeout: float) -> None:
        if self._runner is None:
            return
        state = self.state
        state.draining = True
        if self._site is not None:
            await self._site.stop()  # no new connections; open ones keep streaming
        await state.drain(timeout)
        await self._runner.cleanup()  # app shutdown + cleanup: stops the driver, flushes spans
        self._runner = None

    async def __aenter__(self) -> ReplicaServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()


async def run_replica(server: ReplicaServer, *, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set or SIGTERM/SIGINT arrives; a second signal aborts in-flight requests."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            log.info("received %s: draining (up to %.0f s)", signal.Signals(signum).name, server.shutdown_timeout)
            stop.set()
        else:
            log.warning("received %s again: aborting in-flight requests", signal.Signals(signum).name)
            server.abort_in_flight()

    installed = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, on_signal, signum)
            installed.append(signum)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals on this platform
            pass
    try:
        await server.start()
        state = server.state
        log.info(
            "simulated vLLM replica ready on %s (model %s, group %s, engine config %s)",
            server.url, state.served_model_name, state.group, state.config.version,
        )
        await stop.wait()
    finally:
        await server.stop()
        for signum in installed:
            loop.remove_signal_handler(signum)
