"""A write-ahead spool on local disk: an acknowledged batch is fsynced here before ClickHouse ever sees it.

Segments `seg-NNNNNNNNNNNN.log` hold frames `magic | length | crc32 | payload`. The
writer consumes them in order and records how far it got in `checkpoint` (written
atomically); consumed segments are deleted. After a crash everything past the
checkpoint is replayed; ClickHouse tables are keyed by trace/span id, so a replay
of rows that did reach ClickHouse does not duplicate query results. A torn frame
at the end of the last segment was never acknowledged and is cut off.
"""
from __future__ import annotations

import logging
import os
import pickle
import struct
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_MAGIC = b"LOS1"
_HEADER = struct.Struct("<4sII")  # magic, payload length, crc32
_MAX_FRAME = 1 << 31


class SpoolFull(Exception):
    """The spool holds more unconsumed bytes than allowed: refuse new data until the writer catches up."""


Position = tuple[int, int]  # (segment number, byte offset)


class Spool:
    def __init__(self, directory: str | os.PathLike, *, max_bytes: int, segment_bytes: int, fsync: bool = True,
                 cache_bytes: int = 256 * 1024 * 1024, arrival_of: Callable[[Any], float | None] | None = None):
        """`arrival_of(record)`: when a record's data arrived (seconds since the epoch), read from a record
        spooled by an earlier process, for oldest_pending_arrival()."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self._lock = threading.Lock()  # appends
        self._sync_lock = threading.Lock()  # one fsync at a time, covering every append before it
        self._new_data = threading.Condition(threading.Lock())
        self._written_seq = 0
        self._synced_seq = 0
        self._cache: OrderedDict[Position, tuple[Any, int]] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit = cache_bytes
        self._checkpoint: Position = self._read_checkpoint()
        self._recover_tail()
        segments = self.segments()
        self._segment_no = segments[-1] if segments else max(self._checkpoint[0], 1)
        self._file = open(self._segment_path(self._segment_no), "ab")
        self._offset = self._file.tell()
        self._pending_bytes = self._measure_pending()
        # (position, arrival) of the records not yet consumed, oldest first (for the backlog's age).
        self._arrivals: deque[tuple[Position, float]] = deque()
        if self._pending_bytes:
            self._arrivals.append((self._checkpoint, self._first_pending_arrival(arrival_of)))

    # -- paths and bookkeeping -----------------------------------------------------------------
    def _segment_path(self, number: int) -> Path:
        return self.dir / f"seg-{number:012d}.log"

    def segments(self) -> list[int]:
        return sorted(int(p.name[4:16]) for p in self.dir.glob("seg-*.log"))

    def _read_checkpoint(self) -> Position:
        path = self.dir / "checkpoint"
        try:
            segment, offset = path.read_text().split()
            return int(segment), int(offset)
        except (FileNotFoundError, ValueError):
            return (0, 0)

    def _measure_pending(self) -> int:
        total = 0
        seg, off = self._checkpoint
        for number in self.segments():
            if number < seg:
                continue
            size = self._segment_path(number).stat().st_size
            total += size - off if number == seg else size
        return max(total, 0)

    def _recover_tail(self) -> None:
        """Cut a torn or corrupt frame off the end of the newest segment."""
        segments = self.segments()
        if not segments:
            return
        path = self._segment_path(segments[-1])
        good = 0
        with open(path, "rb") as f:
            data = f.read()
        while good + _HEADER.size <= len(data):
            magic, length, crc = _HEADER.unpack_from(data, good)
            end = good + _HEADER.size + length
            if magic != _MAGIC or end > len(data) or zlib.crc32(data[good + _HEADER.size : end]) != crc:
                break
            good = end
        if good != len(data):
            log.warning("spool: cutting %d bytes of an unacknowledged torn write from %s", len(data) - good, path.name)
            with open(path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())

    def _first_pending_arrival(self, arrival_of) -> float:
        """When the oldest record left by the previous process arrived: read from it when the record says,
        else the time its segment was last written."""
        try:
            records, _ = self.read_from(self._checkpoint, max_records=1)
        except (OSError, RuntimeError, pickle.UnpicklingError):
            records = []
        if records and arrival_of is not None:
            arrival = arrival_of(records[0][1])
            if arrival is not None:
                return arrival
        position = records[0][0] if records else self._checkpoint
        try:
            return self._segment_path(position[0]).stat().st_mtime
        except OSError:
            return time.time()

    def oldest_pending_arrival(self) -> float | None:
        """Arrival time of the oldest record not yet consumed, or None when there is none."""
        try:
            return self._arrivals[0][1]
        except IndexError:
            return None

    @property
    def cache_bytes(self) -> int:
        """Bytes (as spooled) of the records kept in memory for the consumer."""
        return self._cache_bytes

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def checkpoint(self) -> Position:
        return self._checkpoint

    # -- producer side -------------------------------------------------------------------------
    def append(self, record: Any, memo: Any = None, arrival: float | None = None) -> Position:
        """Write one record durably; returns once it is on disk (fsync shared with concurrent appends).

        `memo` is kept in memory only (never written) for the consumer: see memo(). `arrival`: when its
        data arrived (default now), for oldest_pending_arrival()."""
        payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) >= _MAX_FRAME:
            raise ValueError("record too large for the spool")
        frame = _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload
        with self._lock:
            if self._pending_bytes + len(frame) > self.max_bytes:
                raise SpoolFull(f"spool holds {self._pending_bytes} bytes (limit {self.max_bytes})")
            if self._offset >= self.segment_bytes:
                self._rotate()
            position = (self._segment_no, self._offset)
            self._file.write(frame)
            self._file.flush()
            self._offset += len(frame)
            self._pending_bytes += len(frame)
            self._written_seq += 1
            my_seq = self._written_seq
            self._remember(position, record, memo, len(frame))
            self._arrivals.append((position, time.time() if arrival is None else arrival))
        self._sync(my_seq)
        with self._new_data:
            self._new_data.notify_all()
        return position

    def _sync(self, my_seq: int) -> None:
        if not self.fsync:
            return
        with self._sync_lock:
            if self._synced_seq >= my_seq:
                return  # an fsync that started after our write already covered it
            with self._lock:
                target = self._written_seq
                fileno = self._file.fileno()
            os.fsync(fileno)
            self._synced_seq = target

    def _rotate(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._segment_no += 1
        self._file = open(self._segment_path(self._segment_no), "ab")
        self._offset = 0
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _remember(self, position: Position, record: Any, memo: Any, size: int) -> None:
        if self._cache_bytes + size > self._cache_limit:
            return  # the consumer will read this one back from disk
        self._cache[position] = (record, size, memo)
        self._cache_bytes += size

    def memo(self, position: Position) -> Any:
        """The in-memory memo given with the record at `position`, if it is still cached (else None)."""
        cached = self._cache.get(position)
        return cached[2] if cached is not None else None

    # -- consumer side -------------------------------------------------------------------------
    def wait_for_data(self, timeout: float) -> None:
        with self._new_data:
            self._new_data.wait(timeout)

    def read_from(self, position: Position, max_records: int) -> tuple[list[tuple[Position, Any]], Position]:
        """Up to max_records records at or after `position`, and the position after the last one."""
        out: list[tuple[Position, Any]] = []
        segment, offset = position
        with self._lock:
            current_segment, current_offset = self._segment_no, self._offset
        while len(out) < max_records:
            if (segment, offset) >= (current_segment, current_offset):
                break
            cached = self._cache.get((segment, offset))
            if cached is not None:
                out.append(((segment, offset), cached[0]))
                offset += cached[1]
                continue
            path = self._segment_path(segment)
            if not path.exists() or (segment < current_segment and offset >= path.stat().st_size):
                later = [n for n in self.segments() if n > segment]
                if not later:
                    break
                segment, offset = later[0], 0
                continue
            with open(path, "rb") as f:
                f.seek(offset)
                limit = current_offset if segment == current_segment else None
                while len(out) < max_records and (limit is None or offset < limit):
                    header = f.read(_HEADER.size)
                    if len(header) < _HEADER.size:
                        break
                    magic, length, crc = _HEADER.unpack(header)
                    payload = f.read(length)
                    if magic != _MAGIC or len(payload) != length or zlib.crc32(payload) != crc:
                        raise RuntimeError(f"spool segment {path.name} is corrupt at offset {offset}")
                    out.append(((segment, offset), pickle.loads(payload)))
                    offset += _HEADER.size + length
            if segment == current_segment:
                break
        return out, (segment, offset)

    def commit(self, position: Position) -> None:
        """Everything before `position` is in ClickHouse: persist that and free its space."""
        tmp = self.dir / "checkpoint.tmp"
        with open(tmp, "w") as f:
            f.write(f"{position[0]} {position[1]}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / "checkpoint")
        self._fsync_dir()
        with self._lock:
            old = self._checkpoint
            self._checkpoint = position
            for key in [k for k in self._cache if k < position]:
                self._cache_bytes -= self._cache.pop(key)[1]
            arrivals = self._arrivals
            while arrivals and arrivals[0][0] < position:
                arrivals.popleft()
            for number in self.segments():
                if number < position[0] and number != self._segment_no:
                    try:
                        self._segment_path(number).unlink()
                    except FileNotFoundError:
                        pass
            self._pending_bytes = self._measure_pending() if old[0] != position[0] else max(
                0, self._pending_bytes - (position[1] - old[1]))

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
