"""Which traces had spans stored lately: lets the decomposition skip its lookups for traces it has never seen.

The request builder decomposes a trace again whenever spans of it are written. To know
whether its in-memory copy of a trace is complete, it used to ask ClickHouse, for every
trace, how many spans of it are stored, and which request rows it already has. Both tables
are ordered by trace id, so a batch of random ids reads one 8,192-row granule per id and
part: the whole `trace_id` column once the store holds a few million spans, and ~0.8 s of
CPU per 5,000 traces at 10 million (`ingest.bench --preload-traces`).

Most traces looked up are new. `TraceFilter` remembers, as a pair of Bloom filters, every
(project, trace) with a span written in the last `window` seconds: by this process (the
writer reports each insert) and, after a restart, by the process before it (`load`, from
`spans.ingested_at`). A trace it has not seen cannot have stored spans written within the
window, so when the only process writing the store (embedded mode, or a server-mode
deployment that says so) meets such a trace, its memory holds all of it and no lookup is
needed. A false positive (~0.25% at the sized load) only costs the lookup; there are no
false negatives within the window.

The price is the window: spans of a trace written more than `window` seconds after the
trace's earlier spans, by a process that no longer remembers the trace, are decomposed as
a new trace (its earlier rows stay). The decomposition joins spans that arrive "minutes apart" (docs/decomposition.md);
the default window is an hour, and 0 turns the filter off (every trace is looked up).

A new filter is started every `window` seconds, sized from what the last one took (16 bits
and 4 probes per trace, within `max_bytes` in all); a filter is dropped once it stopped taking
traces more than a window ago, so those kept cover at least the last `window` seconds. When
traffic outgrows a filter its false-positive rate rises, which costs lookups, never correctness.
Probing runs in numpy over whole batches: Python computes one hash per trace.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import numpy as np

_PROBES = 4
_BITS_PER_TRACE = 16
_MIN_BITS = 1 << 21  # 256 KiB: ~130k traces

# A trace id (32 lowercase hex digits) as one 64-bit number, the XOR of its two halves (64-bit ids
# written as 128-bit have a zero half), computed alike by Python (raw_hashes) and by ClickHouse (this
# expression), so the filter is loaded from the store without sending the ids to Python.
TRACE_HASH_SQL = ("bitXor(reinterpretAsUInt64(reverse(unhex(substring(trace_id, 1, 16)))), "
                  "reinterpretAsUInt64(reverse(unhex(substring(trace_id, 17, 16)))))")


def raw_hashes(trace_ids: Iterable[str], n: int) -> np.ndarray:
    """TRACE_HASH_SQL of each trace id, in Python."""
    return np.fromiter((int(t[:16], 16) ^ int(t[16:], 16) for t in trace_ids), dtype=np.uint64, count=n)


def _mixed(project_id: int, raw: np.ndarray) -> np.ndarray:
    """The project folded in and the bits mixed (splitmix64's finaliser): ids that are not random
    (sequential, or sharing a prefix) still spread over the whole filter."""
    with np.errstate(over="ignore"):
        z = raw ^ np.uint64((project_id * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class _Bloom:
    __slots__ = ("bits", "size", "count", "since")

    def __init__(self, size_bits: int, since: float):
        size_bits = max(_MIN_BITS, size_bits)
        self.size = size_bits - size_bits % 8
        self.bits = np.zeros(self.size // 8, dtype=np.uint8)
        self.count = 0
        self.since = since  # when it started taking traces

    def positions(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(byte index, bit mask) of every probe, shape (len(hashes), _PROBES), by double hashing."""
        h = hashes
        h1 = h & np.uint64(0xFFFFFFFF)
        h2 = (h >> np.uint64(32)) | np.uint64(1)
        with np.errstate(over="ignore"):
            probes = (h1[:, None] + h2[:, None] * np.arange(_PROBES, dtype=np.uint64)) % np.uint64(self.size)
        return (probes >> np.uint64(3)).astype(np.intp), (np.uint8(1) << (probes & np.uint64(7)).astype(np.uint8))

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        index, mask = self.positions(hashes)
        return ((self.bits[index] & mask) != 0).all(axis=1)

    def add(self, hashes: np.ndarray) -> None:
        index, mask = self.positions(hashes)
        np.bitwise_or.at(self.bits, index.ravel(), mask.ravel())
        self.count += len(hashes)


class TraceFilter:
    """The (project, trace) pairs with spans written in the last `window` seconds, give or take false positives."""

    def __init__(self, window_seconds: float, *, max_bytes: int = 256 << 20, clock=time.monotonic):
        if window_seconds <= 0:
            raise ValueError("window_seconds must be positive (a window of 0 means: no filter)")
        self.window = float(window_seconds)
        self.max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        # Newest first; new traces go into the first. Each filter stops taking traces when the next one
        # starts, and is dropped once that is more than a window ago: everything it holds is older.
        self._blooms = [_Bloom(_MIN_BITS, clock())]
        # Set once the traces written before this process started are in (see load): until then a
        # trace absent from the filter may still be stored, and `check_and_add` reports every trace seen.
        self.ready = threading.Event()

    def _start_new(self, size_bits: int, now: float) -> None:
        budget = self.max_bytes * 8 - sum(b.size for b in self._blooms)
        self._blooms.insert(0, _Bloom(min(size_bits, max(budget, _MIN_BITS)), now))
        # blooms[i] stopped taking traces when blooms[i - 1] started
        self._blooms = [b for i, b in enumerate(self._blooms) if i == 0 or now - self._blooms[i - 1].since < self.window]

    def _rotate_if_due(self, now: float) -> None:
        first = self._blooms[0]
        if now - first.since >= self.window:
            self._start_new(int(first.count * 1.5) * _BITS_PER_TRACE, now)

    def check_and_add(self, project_id: int, trace_ids: list[str]) -> np.ndarray:
        """Add these traces (distinct ids); for each, True when it may have been written before (always
        True until `ready`), False when it certainly was not within the window."""
        hashes = _mixed(project_id, raw_hashes(trace_ids, len(trace_ids)))
        with self._lock:
            seen = self._seen(hashes)
            self._blooms[0].add(hashes)
        if not self.ready.is_set():
            seen[:] = True
        return seen

    def may_contain(self, project_id: int, trace_ids: list[str]) -> np.ndarray:
        """For each trace, whether it may have been written within the window (nothing added)."""
        with self._lock:
            return self._seen(_mixed(project_id, raw_hashes(trace_ids, len(trace_ids))))

    def _seen(self, hashes: np.ndarray) -> np.ndarray:
        """Whether any filter kept may hold each hash (the caller holds the lock)."""
        self._rotate_if_due(self._clock())
        seen = np.zeros(len(hashes), dtype=bool)
        for bloom in self._blooms:
            seen |= bloom.contains(hashes)
        return seen

    def load(self, project_id: int, raw: np.ndarray) -> None:
        """Add traces written before this process started, given as TRACE_HASH_SQL values (see
        RequestBuilder.load_filter)."""
        if not len(raw):
            return
        hashes = _mixed(project_id, raw.astype(np.uint64, copy=False))
        with self._lock:
            self._rotate_if_due(self._clock())
            self._blooms[0].add(hashes)

    def reserve(self, expected: int) -> None:
        """Before loading `expected` traces: start a filter sized for them and what follows."""
        with self._lock:
            now = self._clock()
            self._start_new(int(expected * 1.5) * _BITS_PER_TRACE, now)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.bits.nbytes for b in self._blooms)
