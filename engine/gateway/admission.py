"""Bounded admission: a fixed number of requests in flight upstream, a bounded FIFO queue, a bounded wait.

A request that finds the queue full, or waits longer than ``max_wait_s``, is shed
(the gateway answers 429 with ``Retry-After``): nothing ever waits without bound, and
the queue cannot grow the gateway's memory without bound either.
"""
from __future__ import annotations

import asyncio
import collections


class Overloaded(Exception):
    """The request was shed; ``reason`` is ``queue_full`` or ``queue_timeout``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class AdmissionController:
    """At most ``max_concurrency`` holders; up to ``max_queue`` waiters, served first come, first served."""

    def __init__(self, max_concurrency: int, max_queue: int, max_wait_s: float):
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self._in_flight = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        return sum(1 for waiter in self._waiters if not waiter.done())

    async def acquire(self) -> float:
        """Take a slot, waiting in the queue if needed; returns the seconds waited. Raises Overloaded."""
        if self._in_flight < self.max_concurrency and not self._waiters:
            self._in_flight += 1
            return 0.0
        if self.queued >= self.max_queue:
            raise Overloaded("queue_full", f"the gateway is at capacity ({self.max_concurrency} requests in "
                                           f"flight, {self.max_queue} waiting)")
        loop = asyncio.get_running_loop()
        started = loop.time()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.max_wait_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed over just as the wait ended (timeout or cancellation): give it back.
                self.release()
            else:
                waiter.cancel()
                self._remove(waiter)
            if isinstance(exc, TimeoutError):
                raise Overloaded("queue_timeout", f"no capacity became free within {self.max_wait_s:g} s") from None
            raise
        return loop.time() - started

    def release(self) -> None:
        """Free a slot, handing it straight to the oldest live waiter if there is one."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; the count stays
                return
        self._in_flight -= 1

    def _remove(self, waiter: asyncio.Future) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass  # release() already popped it
