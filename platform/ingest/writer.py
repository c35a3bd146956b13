"""Moves spooled batches into ClickHouse in order, retrying while ClickHouse is away, and reports what it wrote."""
from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path

from traces.os_threads import name_os_thread
from traces.row_encoding import bulk_insert_settings
from traces.store import ClickHouseStore, StoreUnavailable

from . import metrics
from .rows import RESOURCE_COLUMNS, call_columns_of, span_columns_of
from .spool import Spool

log = logging.getLogger(__name__)


class SpanWriter(threading.Thread):
    # A batch that ClickHouse refuses as a whole is retried this many times (it is more likely a
    # problem of the store than of every record in it) before records are dead-lettered one by one.
    SYSTEMIC_RETRIES = 5

    def __init__(self, spool: Spool, store: ClickHouseStore, *, batch_spans: int, max_delay: float,
                 on_written: Callable[[list[tuple[tuple, tuple | None]], int], None] | None = None,
                 schema=None, room: Callable[[float], bool] | None = None):
        """`on_written(items, written_ms)` gets what each insert stored; `room(timeout)` blocks while the
        decomposition has no room for more (the writer then leaves the rest in the spool, on disk)."""
        super().__init__(name="span-writer", daemon=True)
        self.spool = spool
        self.store = store
        self.batch_spans = batch_spans
        self.max_delay = max_delay
        self.on_written = on_written
        self.room = room
        # When the insert in progress started (ms since the epoch), None between inserts: the rows it
        # stores have ingested_at >= this, and nothing has reported them yet.
        self._insert_started_ms: int | None = None
        # Whether ClickHouse failed the last attempt (the writer is backing off): ingest then keeps
        # spooling up to the spool's limit instead of pushing back on the backlog's age.
        self.store_unavailable = False
        self._stop_event = threading.Event()
        self._idle = threading.Event()
        self.position = spool.checkpoint
        self.deadletter_dir = Path(spool.dir) / "deadletter"
        self.schema = schema  # a traces.ch_migrate.SchemaGate, or None when the caller migrates
        self._refusals = 0
        self.insert_settings = bulk_insert_settings(store.embedded)
        # span_resources rows already in ClickHouse: most batches repeat the same few resources, which
        # need inserting once (per day). Bounded; forgetting only means inserting a row again.
        self._resources_written: set[bytes] = set()

    def stop(self) -> None:
        self._stop_event.set()
        with self.spool._new_data:
            self.spool._new_data.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """True once everything appended so far has reached ClickHouse (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.spool.pending_bytes == 0:
                return True
            time.sleep(0.01)
        return self.spool.pending_bytes == 0

    def insert_in_flight(self) -> int | None:
        """When the insert in progress started (ms since the epoch), or None."""
        return self._insert_started_ms

    def run(self) -> None:
        name_os_thread(self.name)
        backoff = 0.1
        while not self._stop_event.is_set():
            try:
                if self.room is not None and not self._wait_for_room():
                    continue
                records, next_position = self._collect()
                if not records:
                    continue
                if self.schema is not None:
                    self.schema.ensure()
                self._insert_started_ms = time.time_ns() // 1_000_000
                try:
                    refused = self._write(records)
                    # Records ClickHouse refused (dead-lettered) are not stored, so not reported. The memos go
                    # with the commit (it frees the spool's cache): take them first.
                    written = [(r, self.spool.memo(position)) for position, r in records if position not in refused]
                    # Commit, then report: the bytes move from the spool's count to the decomposition's without
                    # being counted twice while the commit syncs (backpressure reads the sum). A crash in
                    # between loses no work: until the report, insert_in_flight() holds the decomposition's
                    # checkpoint before this insert, and a restart rebuilds what was stored since.
                    self.spool.commit(next_position)
                    self.position = next_position
                    if self.on_written is not None:
                        self.on_written(written, self._insert_started_ms)
                finally:
                    self._insert_started_ms = None
                metrics.SPOOL_PENDING_BYTES.set(self.spool.pending_bytes)
                self.store_unavailable = False
                backoff = 0.1
            except StoreUnavailable as exc:
                if self._stop_event.is_set():
                    break  # shutting down: the store is closing; the data stays in the spool
                self.store_unavailable = True
                metrics.STORE_UNAVAILABLE.inc()
                log.warning("ClickHouse unavailable, spooled data kept (retry in %.1fs): %s", backoff, exc)
                self._stop_event.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception:  # keep the writer alive whatever happens; the data stays in the spool
                log.exception("span writer failed; retrying")
                self._stop_event.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def _wait_for_room(self) -> bool:
        """Wait while the decomposition's backlog is full; False when stopping."""
        if self.room(0):
            return True
        started = time.perf_counter()
        try:
            while not self._stop_event.is_set():
                if self.room(0.25):
                    return True
            return False
        finally:
            metrics.WRITER_BLOCKED_SECONDS.inc(time.perf_counter() - started)

    # While exports keep arriving, the writer waits (up to max_delay) to fill its batch: an insert
    # costs ClickHouse a part to write and later merge, and 8k-span inserts cost ~30% more CPU per
    # span than 20k-span ones. A pause this long means traffic is light: what is there goes at once.
    QUIET_GAP = 0.05

    def _collect(self):
        records, next_position = self.spool.read_from(self.position, max_records=256)
        spans = sum(r[4] for _, r in records)
        deadline = time.monotonic() + self.max_delay
        while spans < self.batch_spans and not self._stop_event.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.spool.wait_for_data(min(self.QUIET_GAP, remaining) if records else remaining)
            more, next_position = self.spool.read_from(next_position, max_records=256)
            if not more:
                if records:
                    break
                continue
            records.extend(more)
            spans += sum(r[4] for _, r in more)
        return records, next_position

    def _insert(self, records) -> None:
        # Resources first, so a span is never stored without its resource row.
        resource_rows = []
        for _, record in records:
            if len(record) > 6:
                for row in record[6]:
                    if row not in self._resources_written:
                        self._resources_written.add(row)  # (also dedupes within the batch)
                        resource_rows.append(row)
        if resource_rows:
            try:
                self._insert_blob("span_resources", RESOURCE_COLUMNS, b"\n".join(resource_rows), len(resource_rows))
            except BaseException:
                self._resources_written.difference_update(resource_rows)
                raise
            if len(self._resources_written) > 10_000:
                self._resources_written = set(resource_rows)
        # Each record holds JSONCompactEachRow blobs; a batch is their concatenation, one per column list
        # (records spooled by an earlier version hold fewer columns: rows.span_columns_of / call_columns_of).
        for table, columns_of, blob_index, count_index in (
            ("spans", span_columns_of, 2, 4), ("llm_calls", call_columns_of, 3, 5),
        ):
            groups: dict[tuple, list] = {}
            for _, record in records:
                if record[blob_index]:
                    groups.setdefault(columns_of(record), []).append(record)
            for columns, group in groups.items():
                self._insert_blob(table, columns, b"\n".join(record[blob_index] for record in group),
                                  sum(record[count_index] for record in group))

    def _insert_blob(self, table: str, columns, blob: bytes, rows: int) -> None:
        started = time.perf_counter()
        self.store.insert_encoded(table, columns, blob, "JSONCompactEachRow", self.insert_settings)
        metrics.INSERT_SECONDS.labels(table).observe(time.perf_counter() - started)
        metrics.INSERT_ROWS.labels(table).inc(rows)

    def _write(self, records) -> set:
        """Insert the records; returns the positions of those ClickHouse refused (dead-lettered)."""
        try:
            self._insert(records)
            self._refusals = 0
            return set()
        except StoreUnavailable:
            raise
        except Exception:
            log.exception("ClickHouse refused a batch of %d records; inserting one by one", len(records))
        failures = []
        for item in records:
            try:
                self._insert([item])
            except StoreUnavailable:
                raise
            except Exception as exc:
                failures.append((item, exc))
        if failures and len(failures) == len(records) and self._refusals < self.SYSTEMIC_RETRIES:
            # Every record refused: more likely the store (schema, disk, limits) than the data.
            self._refusals += 1
            raise StoreUnavailable(f"ClickHouse refused every record of the batch: {failures[0][1]}")
        self._refusals = 0
        # Only what ClickHouse refuses on its own is set aside; the rest went through above.
        for item, exc in failures:
            self._deadletter(item, exc)
        return {position for (position, _), _ in failures}

    def _deadletter(self, item, exc: Exception) -> None:
        position, record = item
        self.deadletter_dir.mkdir(exist_ok=True)
        path = self.deadletter_dir / f"{position[0]:012d}-{position[1]:012d}.pickle"
        path.write_bytes(pickle.dumps({"error": repr(exc), "record": record}))
        metrics.SPOOL_DEADLETTER.inc()
        log.error("spool record %s kept in %s: ClickHouse refused it: %s", position, path, exc)
