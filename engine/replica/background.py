"""A simulated replica on its own event-loop thread, for synchronous programs (tests, benchmarks, scripts).

    with BackgroundReplica(config, group="baseline") as replica:
        requests.post(replica.url + "/v1/completions", json={...})

The replica runs exactly as under ``python -m engine.replica``; only the loop lives in a
daemon thread instead of the main one. ``stop()`` drains like a SIGTERM.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.replica.app import ReplicaState
from engine.replica.server import ReplicaServer

T = TypeVar("T")


class BackgroundReplica:
    """Start a ``ReplicaServer`` (same keyword arguments) in a background thread; ``url`` once started."""

    def __init__(self, config: EngineConfig, *, start_timeout: float = 30.0, **server_kwargs: Any):
        self._config = config
        self._server_kwargs = server_kwargs
        self._start_timeout = start_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: ReplicaServer | None = None
        self._stopped = threading.Event()

    @property
    def server(self) -> ReplicaServer:
        if self._server is None:
            raise RuntimeError("the replica has not been started")
        return self._server

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def state(self) -> ReplicaState:
        return self.server.state

    def start(self) -> BackgroundReplica:
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            loop = self._loop
            asyncio.set_event_loop(loop)

            async def boot() -> None:
                self._server = ReplicaServer(self._config, **self._server_kwargs)
                await self._server.start()

            try:
                loop.run_until_complete(boot())
            except BaseException as exc:
                started.set_exception(exc)
                loop.close()
                self._stopped.set()
                return
            started.set_result(None)
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()
                self._stopped.set()

        self._thread = threading.Thread(target=run, name="background-replica", daemon=True)
        self._thread.start()
        started.result(timeout=self._start_timeout)
        return self

    def call(self, function: Callable[[], T], timeout: float = 10.0) -> T:
        """Run ``function`` on the replica's loop thread (to read its state consistently) and return its result."""
        if self._loop is None:
            raise RuntimeError("the replica has not been started")

        async def invoke() -> T:
            return function()

        return asyncio.run_coroutine_threadsafe(invoke(), self._loop).result(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Drain (up to ``timeout`` s, default the server's shutdown timeout), close and join the thread."""
        loop, server = self._loop, self._server
        if loop is None or self._stopped.is_set() or server is None:
            return
        drain = server.shutdown_timeout if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(server.stop(timeout), loop)
        try:
            future.result(drain + 30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(10)

    def __enter__(self) -> BackgroundReplica:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
