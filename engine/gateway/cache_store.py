"""The response cache's in-process stores (``store: memory``): exact entries by digest, semantic entries by vector.

Both are bounded: at most ``max_entries`` entries, the least recently used evicted first
(a hit counts as a use), and entries past their TTL are misses (``expired``) and dropped
when met. Every entry keeps its full key (the exact key, or the semantic context key)
beside the answer; the cache compares it before serving anything.
"""
from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from collections.abc import Callable

import numpy as np

from engine.gateway.semantic import VectorIndex

_FRAME = b"LGC1"


class StoreUnavailable(Exception):
    """The store could not be asked (Redis down or slow); the request is served as a miss."""


@dataclasses.dataclass(slots=True)
class Entry:
    key: bytes  # the whole key the answer was stored under
    body: bytes  # the answer's JSON
    expires: float = float("inf")  # time.time() seconds

    @property
    def size(self) -> int:
        return len(self.key) + len(self.body)

    def pack(self) -> bytes:
        """The entry as bytes for an external store (its expiry is the store's TTL)."""
        return _FRAME + len(self.key).to_bytes(4, "big") + self.key + self.body


def unpack(data: bytes | None) -> Entry | None:
    """An entry packed by ``Entry.pack``; None for anything else (a foreign or damaged value)."""
    if not data or data[:4] != _FRAME or len(data) < 8:
        return None
    length = int.from_bytes(data[4:8], "big")
    if len(data) < 8 + length:
        return None
    return Entry(key=data[8:8 + length], body=data[8 + length:])


EvictionCounter = Callable[[str, str, int], None]  # (kind, reason, count)


class MemoryExactStore:
    kind = "exact"

    def __init__(self, ttl_s: float, max_entries: int, on_evict: EvictionCounter):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._on_evict = on_evict
        self._entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self._bytes = 0

    def sizes(self) -> tuple[int, int]:
        return len(self._entries), self._bytes

    async def get(self, digest: bytes) -> tuple[Entry | None, str]:
        entry = self._entries.get(digest)
        if entry is None:
            return None, "absent"
        if entry.expires <= time.time():
            self._drop(digest)
            self._on_evict(self.kind, "expired", 1)
            return None, "expired"
        self._entries.move_to_end(digest)
        return entry, ""

    async def put(self, digest: bytes, entry: Entry) -> None:
        entry.expires = time.time() + self.ttl_s
        self._drop(digest)
        self._entries[digest] = entry
        self._bytes += entry.size
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
            self._on_evict(self.kind, "capacity", 1)

    def _drop(self, digest: bytes) -> None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self._bytes -= entry.size

    async def close(self) -> None:
        self._entries.clear()


class MemorySemanticStore:
    kind = "semantic"

    def __init__(self, ttl_s: float, max_entries: int, on_evict: EvictionCounter):
        self.ttl_s = ttl_s
        self.index = VectorIndex(max_entries, on_evict=lambda reason, count: on_evict(self.kind, reason, count),
                                 payload_bytes=lambda entry: entry.size if entry is not None else 0)

    def sizes(self) -> tuple[int, int]:
        return len(self.index), self.index.bytes

    async def search(self, partition: str, tag: int, vector: np.ndarray,
                     threshold: float) -> tuple[Entry | None, float]:
        """(the best entry at or above ``threshold`` or None, the best similarity found)."""
        entry_id, similarity, entry = self.index.search(partition, tag, vector, time.time(), threshold)
        return (entry if entry_id is not None else None), similarity

    async def add(self, partition: str, tag: int, vector: np.ndarray, entry: Entry) -> None:
        now = time.time()
        entry.expires = now + self.ttl_s
        self.index.add(partition, uuid.uuid4().hex, tag, vector, entry.expires, now, entry)

    async def close(self) -> None:
        self.index = VectorIndex(1)
