"""The response cache in Redis (``store: redis://host:port/db``): gateways behind one Redis share their answers.

Keys, under ``{key_prefix}:{group}:``:

- ``x:{digest}``: an exact entry (its full key and answer, ``cache_store.Entry.pack``), with
  a Redis TTL of ``exact.ttl_s``;
- ``s:{id}``: a semantic entry (its context key and answer), TTL ``semantic.ttl_s``;
- ``s:log``: a stream of the semantic entries' vectors (id, partition, context tag, float32
  vector, expiry), trimmed to about ``semantic.max_entries``.

The gateway always searches its own bounded index (``semantic.VectorIndex``); the Redis
search module's vector search (``FT.SEARCH``) is not used, whether the server has it or
not. The index is kept in step with Redis: before each semantic lookup the gateway reads
the stream's new records (one ``XREAD``), so an answer stored through another gateway is
found by this one; a candidate whose entry has expired in Redis is a miss and leaves the
index.

Every Redis call has ``store_timeout_s``; a failed or slow call makes the lookup a miss
(result ``error``, reason ``store_unavailable``) and Redis is left alone for a second, so
a Redis outage costs requests nothing but their cache.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from engine.gateway.cache_config import CacheSpec
from engine.gateway.cache_store import Entry, EvictionCounter, StoreUnavailable, unpack
from engine.gateway.semantic import MAX_DIMENSION, VectorIndex

log = logging.getLogger(__name__)

T = TypeVar("T")
PAUSE_AFTER_FAILURE_S = 1.0
_SYNC_BATCH = 1000


class RedisLink:
    """One Redis client for one group's cache, shared by its stores (the cache closes it): a timeout on every
    call, a pause after a failure."""

    def __init__(self, spec: CacheSpec, prefix: str):
        self.spec = spec
        self.prefix = prefix
        self._client: aioredis.Redis | None = None
        self._down_until = 0.0

    def _connect(self) -> aioredis.Redis:
        if self._client is None:
            password = os.environ.get(self.spec.password_env) if self.spec.password_env else None
            self._client = aioredis.from_url(self.spec.store, password=password or None,
                                             socket_timeout=self.spec.store_timeout_s,
                                             socket_connect_timeout=self.spec.store_timeout_s)
        return self._client

    async def run(self, call: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
        if time.monotonic() < self._down_until:
            raise StoreUnavailable("Redis failed less than a second ago")
        try:
            async with asyncio.timeout(self.spec.store_timeout_s):
                return await call(self._connect())
        except (RedisError, OSError, TimeoutError) as exc:
            if time.monotonic() >= self._down_until:
                log.warning("response cache: Redis %s failed (%s: %s); lookups are misses for %g s",
                            _safe_url(self.spec.store), type(exc).__name__, exc, PAUSE_AFTER_FAILURE_S)
            self._down_until = time.monotonic() + PAUSE_AFTER_FAILURE_S
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def _safe_url(url: str) -> str:
    return url.split("@")[-1]


class RedisExactStore:
    kind = "exact"

    def __init__(self, link: RedisLink, ttl_s: float):
        self.link = link
        self.ttl_ms = max(1, round(ttl_s * 1000))

    def sizes(self) -> None:
        return None  # held in Redis, not in this process

    def _key(self, digest: bytes) -> str:
        return f"{self.link.prefix}:x:{digest.hex()}"

    async def get(self, digest: bytes) -> tuple[Entry | None, str]:
        entry = unpack(await self.link.run(lambda r: r.get(self._key(digest))))
        return (entry, "") if entry is not None else (None, "absent")

    async def put(self, digest: bytes, entry: Entry) -> None:
        await self.link.run(lambda r: r.set(self._key(digest), entry.pack(), px=self.ttl_ms))


class RedisSemanticStore:
    kind = "semantic"

    def __init__(self, link: RedisLink, ttl_s: float, max_entries: int, on_evict: EvictionCounter):
        self.link = link
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.index = VectorIndex(max_entries, on_evict=lambda reason, count: on_evict(self.kind, reason, count))
        self._stream = f"{link.prefix}:s:log"
        self._last_id: bytes | str = "0-0"

    def sizes(self) -> tuple[int, int]:
        return len(self.index), self.index.bytes

    def _key(self, entry_id: str) -> str:
        return f"{self.link.prefix}:s:{entry_id}"

    async def search(self, partition: str, tag: int, vector: np.ndarray,
                     threshold: float) -> tuple[Entry | None, float]:
        await self.sync()
        entry_id, similarity, _ = self.index.search(partition, tag, vector, time.time(), threshold)
        if entry_id is None:
            return None, similarity
        entry = unpack(await self.link.run(lambda r: r.get(self._key(entry_id))))
        if entry is None:  # expired or evicted in Redis
            self.index.remove(entry_id)
        return entry, similarity

    async def add(self, partition: str, tag: int, vector: np.ndarray, entry: Entry) -> None:
        entry_id = uuid.uuid4().hex
        now = time.time()
        expires = now + self.ttl_s
        ttl_ms = max(1, round(self.ttl_s * 1000))
        record = {"id": entry_id, "p": partition, "t": str(tag), "v": vector.astype(np.float32).tobytes(),
                  "e": repr(expires)}

        async def write(r: aioredis.Redis):
            async with r.pipeline(transaction=False) as pipe:
                pipe.set(self._key(entry_id), entry.pack(), px=ttl_ms)
                pipe.xadd(self._stream, record, maxlen=self.max_entries, approximate=True)
                pipe.pexpire(self._stream, ttl_ms)
                return await pipe.execute()

        await self.link.run(write)
        self.index.add(partition, entry_id, tag, vector, expires, now)

    async def sync(self) -> None:
        """Read the records other gateways (and this one) appended since the last read into the index."""
        while True:
            reply = await self.link.run(lambda r: r.xread({self._stream: self._last_id}, count=_SYNC_BATCH))
            records = reply[0][1] if reply else []
            now = time.time()
            for record_id, fields in records:
                self._last_id = record_id
                parsed = _parse_record(fields)
                if parsed is not None and parsed[4] > now:
                    entry_id, partition, tag, vector, expires = parsed
                    self.index.add(partition, entry_id, tag, vector, expires, now)
            if len(records) < _SYNC_BATCH:
                return


def _parse_record(fields: dict) -> tuple[str, str, int, np.ndarray, float] | None:
    """A stream record as (id, partition, tag, unit vector, expiry); None when it is not one of ours."""
    try:
        entry_id = fields[b"id"].decode("ascii")
        partition = fields[b"p"].decode("utf-8")
        tag = int(fields[b"t"])
        raw = fields[b"v"]
        expires = float(fields[b"e"])
    except (KeyError, ValueError, UnicodeDecodeError, AttributeError):
        return None
    if not -2 ** 63 <= tag < 2 ** 63 or len(raw) % 4 or not 0 < len(raw) // 4 <= MAX_DIMENSION:
        return None
    vector = np.frombuffer(raw, dtype=np.float32)
    norm = float(np.linalg.norm(vector))
    if not np.isfinite(norm) or abs(norm - 1.0) > 1e-3:
        return None
    return entry_id, partition, tag, vector, expires
