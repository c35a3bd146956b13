"""The replica's real-time driver: steps the simulated engine core on the wall clock and releases its tokens.

One asyncio task plays vLLM's engine-core busy loop: it calls ``core.step(start)``, sleeps
until the step's simulated ``end_time`` and goes on with the next step, idling when the
core has nothing to do. The clock is ``time.monotonic()``.

The simulated timeline does not drift with the event loop's wake-up jitter: while the
engine is busy, step k+1 starts exactly at step k's end (the GPU does not wait for the
Python frontend), as long as the loop is less than ``MAX_LAG_SECONDS`` late; beyond that
(an overloaded process) the next step starts at the real "now", so simulated time never
runs ahead of what clients can see. Because a step may therefore start a little before
the real moment it is computed, new requests wait in an arrivals list and enter the core
only for the first step that starts after they arrived (``queued_time`` = arrival at the
engine): a request is never scheduled before it was queued.

Outputs go through a model of vLLM's frontend: after a step ends, its tokens reach the
requests once the output processor has detokenised them (``detokenize_seconds_per_token``
× the step's tokens, in step order). That work overlaps the next step, as in vLLM where the
engine core is a separate process, and is part of vLLM's "overhead" (e2e − queue − prefill
− decode) together with input processing before the request is queued (see ``app.py``).

A watcher notices clients that went away (the connection's transport closes) and aborts
their requests in the core within ``DISCONNECT_POLL_SECONDS``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from engine.replica.metrics import ReplicaMetrics
from engine.sim.core import EngineCore
from engine.sim.request import RequestRejected, SimRequest, StepOutput

log = logging.getLogger(__name__)

DISCONNECT_POLL_SECONDS = 0.05
# How late the event loop may wake up (OS scheduling hiccups on a busy host) before the simulated
# timeline gives in and restarts at "now" (a process that cannot keep pace: the engine slows down).
MAX_LAG_SECONDS = 0.05
# When a step schedules nothing (every waiting request is blocked), re-check this often instead of spinning.
IDLE_RECHECK_SECONDS = 0.01

# Why a request ended without finishing.
ABORT_CLIENT = "client"
ABORT_SHUTDOWN = "shutdown"
ABORT_ERROR = "error"
ABORT_REJECTED = "rejected"


@dataclasses.dataclass(eq=False)
class TrackedRequest:
    """A request between the HTTP handler and the engine core: what has been released to the handler."""

    sim: SimRequest
    http_request: Any = None  # aiohttp request whose transport the disconnect watcher checks
    released: int = 0  # tokens handed to the handler so far
    done: bool = False  # the last token has been released
    aborted: str | None = None  # ABORT_* when the request ended early
    error: str | None = None  # why the core refused it (ABORT_REJECTED)
    queued_at: float = 0.0  # when it reached the engine (becomes the core's queued_time)
    first_release: float | None = None  # frontend time of the first token release
    last_token_ts: float | None = None  # engine time of the last release (for inter-token latency)
    update: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    async def wait_update(self) -> None:
        """Until something new was released (or the request ended), then consume the notification."""
        await self.update.wait()
        self.update.clear()


class RealTimeDriver:
    """Runs one ``EngineCore`` in real time and hands its outputs to the waiting requests."""

    def __init__(
        self,
        core: EngineCore,
        *,
        metrics: ReplicaMetrics,
        detokenize_seconds_per_token: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.core = core
        self.metrics = metrics
        self.detokenize_seconds_per_token = max(0.0, detokenize_seconds_per_token)
        self.clock = clock
        self.requests: dict[str, TrackedRequest] = {}
        self._arrivals: deque[TrackedRequest] = deque()  # submitted, not yet in the core
        self.error: BaseException | None = None
        self._wake = asyncio.Event()
        self._last_end = 0.0
        self._last_release = 0.0
        self._pending_releases: set[asyncio.TimerHandle] = set()
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._counter_values: dict[str, float] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._run(), name="replica-engine-loop"),
            loop.create_task(self._watch_disconnects(), name="replica-disconnect-watch"),
        ]

    async def stop(self) -> None:
        """Stop stepping; requests still in flight are aborted as a shutdown."""
        self._closing = True
        self._wake.set()
        self.abort_all(ABORT_SHUTDOWN)
        for handle in self._pending_releases:
            handle.cancel()
        self._pending_releases.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    @property
    def alive(self) -> bool:
        return self.error is None and not self._closing

    @property
    def num_in_flight(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ requests
    def submit(self, sim: SimRequest, *, http_request: Any = None) -> TrackedRequest:
        """Hand ``sim`` to the engine now; it joins the core's queue for the first step starting after now."""
        if not self.alive:
            raise RuntimeError("the engine core is not running")
        tracked = TrackedRequest(sim=sim, http_request=http_request, queued_at=self.clock())
        self.requests[sim.request_id] = tracked
        self._arrivals.append(tracked)
        self._refresh_gauges()
        self._wake.set()
        return tracked

    def abort(self, request_id: str, reason: str = ABORT_CLIENT) -> None:
        """End a request early (idempotent): drop it from the core and wake its handler."""
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return
        if not tracked.done:
            tracked.aborted = reason
            if tracked in self._arrivals:
                self._arrivals.remove(tracked)
            else:
                try:
                    self.core.abort_request(request_id, self.clock())
                except Exception:  # the core may already have let it go; the request is gone either way
                    log.exception("aborting %s in the engine core failed", request_id)
        tracked.update.set()
        self._refresh_gauges()
        self._wake.set()

    def finish(self, request_id: str) -> None:
        """The handler has delivered everything: forget the request."""
        self.requests.pop(request_id, None)

    def abort_all(self, reason: str) -> None:
        for request_id in list(self.requests):
            self.abort(request_id, reason)

    # ------------------------------------------------------------------ the engine loop
    def _has_work(self) -> bool:
        return bool(self._arrivals) or self.core.has_unfinished_requests()

    def _admit_arrivals(self, start: float) -> None:
        """Put the requests that reached the engine by ``start`` into the core's waiting queue. As vLLM's engine
        core takes new requests from its input queue between steps, one that came in during a step is queued
        (queued_ts) when that step ended, not when it arrived: the virtual simulator does the same, so a replica's
        queue time and the simulator's mean the same thing (engine/sim/traffic_fit.py replays the one with the
        other)."""
        arrivals = self._arrivals
        while arrivals and arrivals[0].queued_at <= start:
            tracked = arrivals.popleft()
            try:
                self.core.add_request(tracked.sim, max(tracked.queued_at, start))
            except RequestRejected as exc:
                self.requests.pop(tracked.sim.request_id, None)
                tracked.aborted = ABORT_REJECTED
                tracked.error = str(exc)
                tracked.update.set()

    async def _run(self) -> None:
        try:
            while not self._closing:
                if not self._has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                now = self.clock()
                # Busy engine: the next step follows the previous one back to back. Idle engine: it
                # starts when the first arrival came in (not before the last step ended). Either way,
                # a loop that woke up more than MAX_LAG_SECONDS late restarts the timeline at "now".
                busy = self.core.has_unfinished_requests()
                if busy:
                    start = self._last_end
                    self.metrics.loop_wake_lag.observe(max(0.0, now - start))
                else:
                    start = max(self._last_end, self._arrivals[0].queued_at)
                if now - start > MAX_LAG_SECONDS:
                    if busy:  # how far the process keeps up: the replica's engine_sim_ metrics
                        self.metrics.timeline_resyncs.inc()
                        self.metrics.timeline_lost.inc(now - start)
                    start = now
                self._admit_arrivals(start)
                if not self.core.has_unfinished_requests():
                    await asyncio.sleep(0)  # only rejected arrivals, or ones that came after `start`
                    continue
                output = self.core.step(start)
                self._after_step(output)
                if output.num_scheduled_tokens == 0 and not output.new_tokens and output.end_time <= start:
                    # Nothing could run (waiting requests that do not fit): wait for a change, do not spin.
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), IDLE_RECHECK_SECONDS)
                    except TimeoutError:
                        pass
                    self._last_end = 0.0  # the engine was idle meanwhile: restart on the real clock
                    continue
                self._last_end = output.end_time
                delay = output.end_time - self.clock()
                # Yield even when late so handlers and the network get their turn between steps.
                await asyncio.sleep(delay if delay > 0 else 0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken core is fatal for the replica, as EngineDeadError is for vLLM
            log.exception("the simulated engine core failed; the replica is now unhealthy")
            self.error = exc
            self.abort_all(ABORT_ERROR)

    def _after_step(self, output: StepOutput) -> None:
        metrics = self.metrics
        if output.num_scheduled_tokens:
            metrics.iteration_tokens.observe(output.num_scheduled_tokens)
        self._refresh_gauges()
        self._sync_counters()
        if not output.new_tokens and not output.finished:
            return
        # The frontend's output processing for this step: detokenising its tokens, after the previous step's.
        tokens = sum(output.new_tokens.values())
        release_at = max(output.end_time + tokens * self.detokenize_seconds_per_token, self._last_release)
        self._last_release = release_at
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def release() -> None:
            self._pending_releases.discard(handle)
            self._release(output)

        handle = loop.call_later(max(0.0, release_at - self.clock()), release)
        self._pending_releases.add(handle)

    def _release(self, output: StepOutput) -> None:
        now = self.clock()
        metrics = self.metrics
        finished = {request.request_id for request in output.finished}
        for request_id, count in output.new_tokens.items():
            tracked = self.requests.get(request_id)
            if tracked is None or tracked.aborted:
                continue  # aborted while the step was running: vLLM drops such outputs too
            if tracked.first_release is None:
                tracked.first_release = now
                metrics.prompt_tokens.inc(tracked.sim.prompt_tokens)
            elif tracked.last_token_ts is not None:
                metrics.inter_token_latency.observe(output.end_time - tracked.last_token_ts)
            tracked.last_token_ts = output.end_time
            tracked.released += count
            metrics.generation_tokens.inc(count)
            tracked.update.set()
        for request_id in finished:
            tracked = self.requests.get(request_id)
            if tracked is not None and not tracked.aborted:
                tracked.done = True
                tracked.update.set()

    def _refresh_gauges(self) -> None:
        core, metrics = self.core, self.metrics
        metrics.num_requests_running.set(core.num_running)
        metrics.num_requests_waiting.set(core.num_waiting + len(self._arrivals))
        metrics.kv_cache_usage.set(core.kv_cache_usage)

    def _sync_counters(self) -> None:
        """Move the core's cumulative counters into Prometheus counters (which only go up)."""
        metrics = self.metrics
        pairs = [
            ("num_preemptions_total", metrics.num_preemptions),
            ("prefix_cache_queries", metrics.prefix_cache_queries),
            ("prefix_cache_hits", metrics.prefix_cache_hits),
        ]
        if metrics.spec_enabled:
            pairs += [
                ("spec_num_drafts", metrics.spec_num_drafts),
                ("spec_num_draft_tokens", metrics.spec_num_draft_tokens),
                ("spec_num_accepted_tokens", metrics.spec_num_accepted_tokens),
            ]
        for name, counter in pairs:
            self._advance(name, getattr(self.core, name, 0), counter)
        if metrics.spec_enabled:
            per_position = getattr(self.core, "spec_num_accepted_tokens_per_pos", None) or ()
            for position, (value, counter) in enumerate(zip(per_position, metrics.spec_accepted_per_pos)):
                self._advance(f"spec_pos_{position}", value, counter)

    def _advance(self, name: str, value: float, counter) -> None:
        previous = self._counter_values.get(name, 0)
        if value > previous:
            counter.inc(value - previous)
            self._counter_values[name] = value

    # ------------------------------------------------------------------ client disconnects
    async def _watch_disconnects(self) -> None:
        while not self._closing:
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
            for request_id, tracked in list(self.requests.items()):
                http_request = tracked.http_request
                if http_request is None or tracked.done:
                    continue
                transport = http_request.transport
                if transport is None or transport.is_closing():
                    log.info("client of %s went away; aborting it", request_id)
                    self.abort(request_id, ABORT_CLIENT)
