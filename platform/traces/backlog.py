"""What waits for decomposition: the traces the writer stored, oldest first, with the bookkeeping that bounds it.

The span writer reports each batch it stored (`add_written`); the request builder takes the oldest
traces in chunks (`take`), and after decomposing a chunk reports it `done`. A trace reported again
while it waits keeps its place (it is decomposed once, from everything stored by then); one taken
and reported again meanwhile waits again at the end. A batch is complete when none of its traces
waits any more; then its records' arrival-to-queryable lag is known, and the checkpoint can move
past the time it was written.

Everything here is in memory and bounded by the writer, which waits (`has_room`) while `max_traces`
traces wait: the spool on disk holds the rest, and ingest answers 503 once that backlog is too big
or too old (observatory.backpressure).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict, deque


@dataclasses.dataclass(eq=False)
class WrittenBatch:
    """One insert of the span writer (or, after a restart, a slice of the traces it left undecomposed)."""

    seq: int
    written_ms: int  # wall clock before the insert: every row of it has ingested_at >= this
    bytes: int  # spool bytes of its records (rows as spooled)
    arrivals: list[float]  # wall-clock arrival of each record (for the lag histogram); [] when unknown
    waiting: int = 0  # traces first reported by this batch that still wait


@dataclasses.dataclass
class Chunk:
    """Traces taken for one decomposition step: {project: [(trace id, batch seq)]}."""

    traces: dict[int, list[tuple[str, int]]]
    memos: list  # [(project id, trace ids, memo)] reported since the last take, for the trace memory first
    taken_ms: int

    def __len__(self) -> int:
        return sum(len(t) for t in self.traces.values())

    def trace_ids(self, project_id: int) -> list[str]:
        return sorted(t for t, _ in self.traces.get(project_id, ()))


class DecompositionBacklog:
    def __init__(self, max_traces: int):
        self.max_traces = max_traces
        self._lock = threading.Condition(threading.Lock())
        self._waiting: OrderedDict[tuple[int, str], int] = OrderedDict()  # (project, trace) -> batch seq
        self._batches: deque[WrittenBatch] = deque()
        self._by_seq: dict[int, WrittenBatch] = {}
        self._memos: list = []
        self._seq = 0
        self._bytes = 0
        self._in_flight = 0  # traces of the chunk being decomposed

    # -- producer: the span writer -------------------------------------------------------------
    def has_room(self) -> bool:
        with self._lock:
            return len(self._waiting) < self.max_traces

    def wait_for_room(self, timeout: float) -> bool:
        """Block while the backlog is full (the writer then leaves the rest in the spool); True if there is room."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._waiting) >= self.max_traces:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
            return True

    def add_written(self, items: list[tuple[tuple, tuple | None]], written_ms: int) -> None:
        """A batch the writer stored: [(spool record, in-memory memo or None)]."""
        nbytes = 0
        arrivals = []
        for record, _memo in items:
            nbytes += len(record[2]) + len(record[3])
            if len(record) > 8:
                arrivals.append(record[8])
        with self._lock:
            self._seq += 1
            batch = WrittenBatch(self._seq, written_ms, nbytes, arrivals)
            waiting = self._waiting
            for record, _memo in items:
                project_id = record[0]
                for trace_id in record[1]:
                    key = (project_id, trace_id)
                    if key not in waiting:
                        waiting[key] = batch.seq
                        batch.waiting += 1
            # Only what the memory needs: the records' row blobs (~1 KB a span) are in ClickHouse now.
            self._memos.extend((record[0], record[1], memo) for record, memo in items if memo is not None)
            self._append(batch)

    def add_recovered(self, project_id: int, traces: list[tuple[str, int]], slice_traces: int = 5000) -> int:
        """Traces stored before a restart and not decomposed since, as (trace id, first ingested_at ms),
        in slices ordered by that time, so the checkpoint moves as each slice is done.

        They go before whatever waits already (what the writer stored since the start, from the spool the
        last process left, is newer): the oldest work first, so the checkpoint moves past the last process's
        leftovers as soon as they are done, not only once the new backlog is done too. A trace already
        waiting keeps its place."""
        traces = sorted(traces, key=lambda t: (t[1], t[0]))
        added = 0
        with self._lock:
            slices: list[tuple[WrittenBatch, list[tuple[int, str]]]] = []
            for start in range(0, len(traces), slice_traces):
                part = traces[start : start + slice_traces]
                self._seq += 1
                batch = WrittenBatch(self._seq, part[0][1], 0, [])
                keys = []
                for trace_id, _ in part:
                    key = (project_id, trace_id)
                    if key not in self._waiting:
                        self._waiting[key] = batch.seq
                        batch.waiting += 1
                        keys.append(key)
                added += batch.waiting
                slices.append((batch, keys))
            for batch, keys in reversed(slices):
                for key in reversed(keys):
                    self._waiting.move_to_end(key, last=False)
                self._append(batch, front=True)
        return added

    def _append(self, batch: WrittenBatch, front: bool = False) -> None:
        (self._batches.appendleft if front else self._batches.append)(batch)
        self._by_seq[batch.seq] = batch
        self._bytes += batch.bytes

    # -- consumer: the request builder ---------------------------------------------------------
    def take(self, max_traces: int) -> Chunk | None:
        """The oldest waiting traces (at most max_traces), and every memo reported so far; None when
        nothing waits. The traces leave the backlog now: reported again while being decomposed, they
        wait again."""
        with self._lock:
            memos, self._memos = self._memos, []
            waiting = self._waiting
            if not waiting and not memos:
                return None
            taken: dict[int, list[tuple[str, int]]] = {}
            for _ in range(min(max_traces, len(waiting))):
                (project_id, trace_id), seq = waiting.popitem(last=False)
                taken.setdefault(project_id, []).append((trace_id, seq))
            chunk = Chunk(taken, memos, time.time_ns() // 1_000_000)
            self._in_flight = len(chunk)
            self._lock.notify_all()
            return chunk

    def put_back(self, chunk: Chunk) -> None:
        """A chunk that failed: its traces wait again at the front, in their order, unless reported again
        meanwhile (then they already wait, for the later batch)."""
        with self._lock:
            self._memos[:0] = chunk.memos
            for project_id, traces in reversed(list(chunk.traces.items())):
                for trace_id, seq in reversed(traces):
                    key = (project_id, trace_id)
                    if key in self._waiting:
                        # Waiting for a later batch now: that batch is not complete before this trace is done.
                        later = self._by_seq.get(self._waiting[key])
                        if later is not None:
                            later.waiting -= 1
                    self._waiting[key] = seq
                    self._waiting.move_to_end(key, last=False)
            self._in_flight = 0

    def done(self, chunk: Chunk) -> list[WrittenBatch]:
        """The chunk's rows are stored: returns the batches now complete (oldest first)."""
        with self._lock:
            for traces in chunk.traces.values():
                for _trace_id, seq in traces:
                    batch = self._by_seq.get(seq)
                    if batch is not None:
                        batch.waiting -= 1
            self._in_flight = 0
            complete = []
            # Batches complete in order: a later one may have no trace waiting while an older one does,
            # but the checkpoint and the lag are about everything written up to a point.
            while self._batches and self._batches[0].waiting <= 0:
                batch = self._batches.popleft()
                del self._by_seq[batch.seq]
                self._bytes -= batch.bytes
                complete.append(batch)
            return complete

    # -- what is waiting -----------------------------------------------------------------------
    def traces(self) -> int:
        """Traces waiting or being decomposed."""
        with self._lock:
            return len(self._waiting) + self._in_flight

    def pending_bytes(self) -> int:
        """Spool bytes of the stored batches not yet completely decomposed."""
        return self._bytes

    def oldest(self) -> tuple[int, float | None] | None:
        """(written_ms, earliest arrival or None) of the oldest batch not completely decomposed."""
        with self._lock:
            if not self._batches:
                return None
            batch = self._batches[0]
            return batch.written_ms, (min(batch.arrivals) if batch.arrivals else None)

    def idle(self) -> bool:
        with self._lock:
            return not self._waiting and not self._in_flight and not self._memos and not self._batches
