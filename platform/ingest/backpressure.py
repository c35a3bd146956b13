"""Whether ingest takes another export: pushes back (503 / UNAVAILABLE + retry delay) when the platform is behind.

Accepted data goes spool → ClickHouse (the span writer) → decomposition (the request builder); only
then are its request rows queryable. The slowest stage sets the pace: when it falls behind, the work
waits on disk in the spool (the writer stops taking more while the decomposition's backlog is full),
and ingest refuses new exports once that backlog is too big or too old:

- `spool_full`: the spool holds INGEST_SPOOL_MAX_BYTES (its disk bound; always applies);
- `backlog_bytes`: accepted but not yet queryable, in bytes as spooled, beyond INGEST_BACKLOG_MAX_BYTES;
- `backlog_age`: the oldest accepted export not yet queryable arrived more than INGEST_BACKLOG_MAX_SECONDS ago.

While ClickHouse is unreachable the last two do not apply: the spool is there to hold the data of an
outage, up to its own bound. Exporters retry refused exports (OTLP says so for 503 and UNAVAILABLE),
so refusing early keeps the delay to queryable rows bounded instead of accepting more than the
platform can digest.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from . import metrics


class Backpressure:
    def __init__(self, *, spool, backlog, store_unavailable: Callable[[], bool], max_bytes: int,
                 max_age_seconds: float, clock: Callable[[], float] = time.time):
        """`spool`: ingest.spool.Spool; `backlog`: traces.backlog.DecompositionBacklog."""
        self.spool = spool
        self.backlog = backlog
        self.store_unavailable = store_unavailable
        self.max_bytes = max_bytes
        self.max_age_seconds = max_age_seconds
        self.clock = clock
        self.shutting_down = False

    def pending_bytes(self) -> int:
        """Accepted and not yet queryable, in bytes as spooled."""
        return self.spool.pending_bytes + self.backlog.pending_bytes()

    def oldest_age(self) -> float:
        """Seconds since the oldest accepted export that is not yet queryable arrived (0 when none)."""
        arrivals = []
        spooled = self.spool.oldest_pending_arrival()
        if spooled is not None:
            arrivals.append(spooled)
        oldest = self.backlog.oldest()
        if oldest is not None:
            written_ms, arrival = oldest
            arrivals.append(arrival if arrival is not None else written_ms / 1000)
        return max(0.0, self.clock() - min(arrivals)) if arrivals else 0.0

    def refusal(self) -> str | None:
        """Why the next export must be refused, or None to take it."""
        if self.spool.pending_bytes >= self.spool.max_bytes:
            reason = "spool_full"
        elif self.store_unavailable():
            reason = None
        elif self.max_bytes and self.pending_bytes() > self.max_bytes:
            reason = "backlog_bytes"
        elif self.max_age_seconds and self.oldest_age() > self.max_age_seconds:
            reason = "backlog_age"
        else:
            reason = None
        metrics.BACKPRESSURE.set(0 if reason is None else 1)
        return reason

    def publish(self) -> dict:
        """Set the backlog gauges (at scrape time) and return them for /readyz."""
        traces = self.backlog.traces()
        decompose_bytes = self.backlog.pending_bytes()
        age = self.oldest_age()
        metrics.SPOOL_PENDING_BYTES.set(self.spool.pending_bytes)
        metrics.DECOMPOSE_PENDING_TRACES.set(traces)
        metrics.DECOMPOSE_PENDING_BYTES.set(decompose_bytes)
        metrics.BACKLOG_OLDEST_SECONDS.set(age)
        return {
            "decomposition_pending_bytes": decompose_bytes,
            "backlog_bytes": self.spool.pending_bytes + decompose_bytes,
            "backlog_oldest_seconds": round(age, 3),
        }
