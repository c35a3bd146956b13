"""The gateway's response cache: one per replica group, exact and semantic, looked up before admission.

**Which cache.** A request's group is drawn first (or pinned with ``X-Engine-Group``); the
cache of that group is consulted before the request waits for an admission slot. A hit is
answered by the gateway at once; a miss goes on to the group's replicas, and a complete
answer from one of them (HTTP 200, every choice finished) is stored in that group's cache
after the client has it. A request that fails over to another group is not stored (the
cache of a group holds only what its own replicas answered).

**Lookup.** Exact first (the canonical key's digest, the full key compared: a digest
collision is a miss, ``collision``), then, if the group has one, semantic (the query's
embedding against the stored queries of the same namespace, model and context). Each
request's SERVER span gets ``observatory.cache.result`` = hit | miss | bypass |
not_cacheable | error, and, as they apply, ``served_from`` (exact_cache | semantic_cache),
``lookup_ms``, ``similarity``, ``key`` (the exact key's hex digest) and ``miss_reason``; ``threshold`` when
the request set its own (``X-Observatory-Cache-Threshold``, where the group's ``client_threshold`` allows it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterable

import aiohttp
import numpy as np
import orjson

from engine.gateway.cache_answers import Unassemblable, assemble_stream, finished_cleanly
from engine.gateway.cache_config import MEMORY_STORE, CacheSpec
from engine.gateway.cache_keys import (
    Directives,
    NotCacheable,
    canonical_request,
    is_deterministic,
    key_bytes,
    namespace,
    semantic_query,
)
from engine.gateway.cache_redis import RedisExactStore, RedisLink, RedisSemanticStore
from engine.gateway.cache_store import Entry, MemoryExactStore, MemorySemanticStore, StoreUnavailable
from engine.gateway.semantic import Embedder, EmbeddingFailed

log = logging.getLogger(__name__)

HIT, MISS, BYPASS, NOT_CACHEABLE, ERROR = "hit", "miss", "bypass", "not_cacheable", "error"
EXACT_CACHE, SEMANTIC_CACHE = "exact_cache", "semantic_cache"
# A streamed answer is kept (to be assembled) up to this many times max_entry_bytes: chunks carry overhead.
STREAM_CAPTURE_FACTOR = 8


def sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclasses.dataclass
class Pending:
    """What storing a miss's answer needs: the exact key and, for the semantic cache, vector and context."""

    digest: bytes
    key: bytes
    partition: str | None = None
    context: bytes | None = None
    tag: int = 0
    vector: np.ndarray | None = None


@dataclasses.dataclass
class Lookup:
    result: str
    served_from: str | None = None
    miss_reason: str | None = None
    key_hex: str | None = None
    lookup_ms: float | None = None
    similarity: float | None = None
    threshold: float | None = None  # the request's own semantic threshold, when it set one
    answer: bytes | None = None  # the stored answer on a hit
    pending: Pending | None = None  # set when the answer to come may be stored

    def attributes(self) -> dict:
        attributes = {"observatory.cache.result": self.result}
        for name, value in (("served_from", self.served_from), ("miss_reason", self.miss_reason),
                            ("key", self.key_hex), ("lookup_ms", self.lookup_ms), ("similarity", self.similarity),
                            ("threshold", self.threshold)):
            if value is not None:
                attributes[f"observatory.cache.{name}"] = value
        return attributes


class Capture:
    """The raw bytes of a streamed answer, kept up to a bound (``overflow`` past it)."""

    __slots__ = ("chunks", "size", "limit", "overflow")

    def __init__(self, limit: int):
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit = limit
        self.overflow = False

    def add(self, chunk: bytes) -> None:
        if self.overflow:
            return
        self.size += len(chunk)
        if self.size > self.limit:
            self.overflow = True
            self.chunks = []
        else:
            self.chunks.append(chunk)


class ResponseCache:
    """One group's cache: its stores, its embeddings client, its metrics."""

    def __init__(self, group: str, spec: CacheSpec, metrics,
                 session: Callable[[], aiohttp.ClientSession | None] = lambda: None):
        self.group = group
        self.spec = spec
        self.metrics = metrics
        self.digest: Callable[[bytes], bytes] = sha256_digest  # tests may force collisions with a poorer one
        self._tasks: set[asyncio.Task] = set()
        # One Redis client for both stores of a Redis-backed cache; None for memory stores.
        self._link = link = RedisLink(spec, f"{spec.key_prefix}:{group}") if spec.store != MEMORY_STORE else None
        self.exact = self.semantic = self.embedder = None
        if spec.exact.enabled:
            self.exact = (RedisExactStore(link, spec.exact.ttl_s) if link else
                          MemoryExactStore(spec.exact.ttl_s, spec.exact.max_entries, self._count_eviction))
        if spec.semantic.enabled:
            self.embedder = Embedder(spec.semantic, session)
            self.semantic = (
                RedisSemanticStore(link, spec.semantic.ttl_s, spec.semantic.max_entries, self._count_eviction)
                if link else MemorySemanticStore(spec.semantic.ttl_s, spec.semantic.max_entries,
                                                 self._count_eviction))

    def _count_eviction(self, kind: str, reason: str, count: int) -> None:
        if count:
            self.metrics.cache_evictions.labels(self.group, kind, reason).inc(count)

    def sizes(self) -> Iterable[tuple[str, int, int]]:
        """(kind, entries, bytes) of the stores held in this process."""
        for store in (self.exact, self.semantic):
            sizes = store.sizes() if store is not None else None
            if sizes is not None:
                yield store.kind, sizes[0], sizes[1]

    # --- lookup --------------------------------------------------------------------------------------------

    @property
    def client_threshold(self) -> bool:
        """Whether a request may set its own semantic threshold."""
        return self.semantic is not None and self.spec.semantic.client_threshold

    async def lookup(self, headers, payload: dict, operation: str, directives: Directives,
                     threshold: float | None = None) -> Lookup:
        """What the cache holds for this request; ``threshold``: the request's own semantic threshold (else the
        group's)."""
        started = time.perf_counter()
        lookup = await self._lookup(headers, payload, operation, directives,
                                    threshold or self.spec.semantic.threshold)
        lookup.threshold = threshold
        if lookup.result in (HIT, MISS, ERROR):
            lookup.lookup_ms = (time.perf_counter() - started) * 1000
        metrics = self.metrics
        metrics.cache_requests.labels(self.group, lookup.result).inc()
        if lookup.result == HIT:
            metrics.cache_hits.labels(self.group, lookup.served_from).inc()
        return lookup

    async def _lookup(self, headers, payload: dict, operation: str, directives: Directives,
                      threshold: float) -> Lookup:
        if not directives.lookup and not directives.store:
            return Lookup(BYPASS)
        try:
            request = canonical_request(payload)
            if not self.spec.nondeterministic and not is_deterministic(request):
                raise NotCacheable("not_deterministic")
            space = namespace(headers)
            key = key_bytes(self.group, space, operation, request)
            if len(key) > self.spec.max_entry_bytes:
                raise NotCacheable("too_large")
        except NotCacheable as exc:
            return Lookup(BYPASS if directives.bypass else NOT_CACHEABLE, miss_reason=exc.reason)
        digest = self.digest(key)
        pending = Pending(digest, key)
        lookup = Lookup(MISS, key_hex=digest.hex(), pending=pending if directives.store else None)
        if directives.bypass:
            lookup.result = BYPASS
        elif self.exact is not None:
            entry, lookup.miss_reason = await self._get_exact(digest, key)
            if entry is not None:
                return dataclasses.replace(lookup, result=HIT, served_from=EXACT_CACHE, answer=entry.body,
                                           pending=None, miss_reason=None)
        if self.semantic is not None:
            await self._semantic(lookup, space, request, operation, payload.get("model"), directives.lookup,
                                 threshold)
        if lookup.result == MISS and lookup.miss_reason == "store_unavailable":
            lookup.result = ERROR
        return lookup

    async def _get_exact(self, digest: bytes, key: bytes) -> tuple[Entry | None, str]:
        started = time.perf_counter()
        try:
            entry, reason = await self.exact.get(digest)
        except StoreUnavailable:
            self._count_lookup("exact", ERROR, "store_unavailable")
            return None, "store_unavailable"
        finally:
            self.metrics.cache_lookup_seconds.labels("exact").observe(time.perf_counter() - started)
        if entry is not None and entry.key != key:
            entry, reason = None, "collision"
        self._count_lookup("exact", HIT if entry is not None else MISS, reason)
        return entry, reason

    async def _semantic(self, lookup: Lookup, space: str, request: dict, operation: str, model: object,
                        search: bool, threshold: float) -> None:
        try:
            text, context = semantic_query(operation, request)
        except NotCacheable as exc:
            lookup.miss_reason = lookup.miss_reason or exc.reason
            return
        pending = lookup.pending
        context_key = key_bytes(self.group, space, operation, context)
        tag = int.from_bytes(self.digest(context_key)[:8], "big", signed=True)
        partition = f"{space}\0{model}"
        started = time.perf_counter()
        try:
            vector = await self.embedder.embed(text)
        except EmbeddingFailed as exc:
            log.debug("response cache %s: %s", self.group, exc)
            self._count_lookup("semantic", MISS, exc.reason)
            if search:
                lookup.miss_reason = exc.reason
            return
        finally:
            self.metrics.cache_lookup_seconds.labels("embedding").observe(time.perf_counter() - started)
        if pending is not None:
            pending.partition, pending.context, pending.tag, pending.vector = partition, context_key, tag, vector
        if not search:
            return
        started = time.perf_counter()
        try:
            entry, similarity = await self.semantic.search(partition, tag, vector, threshold)
        except StoreUnavailable:
            self._count_lookup("semantic", ERROR, "store_unavailable")
            lookup.miss_reason = "store_unavailable"
            return
        finally:
            self.metrics.cache_lookup_seconds.labels("semantic").observe(time.perf_counter() - started)
        if similarity >= 0:
            lookup.similarity = round(similarity, 6)
        if entry is not None and entry.key != context_key:
            entry, reason = None, "collision"
        elif entry is None:
            reason = "below_threshold" if similarity >= 0 else "absent"
            if similarity >= threshold:
                reason = "expired"  # the best match left the store
        else:
            reason = ""
        self._count_lookup("semantic", HIT if entry is not None else MISS, reason)
        if entry is not None:
            lookup.result, lookup.served_from, lookup.answer, lookup.pending = HIT, SEMANTIC_CACHE, entry.body, None
            lookup.miss_reason = None
        else:
            lookup.miss_reason = reason

    def _count_lookup(self, kind: str, result: str, reason: str) -> None:
        self.metrics.cache_lookups.labels(self.group, kind, result).inc()
        if result != HIT:
            self.metrics.cache_misses.labels(self.group, kind, reason).inc()

    # --- store ---------------------------------------------------------------------------------------------

    def capture(self) -> Capture:
        return Capture(self.spec.max_entry_bytes * STREAM_CAPTURE_FACTOR)

    def store_later(self, pending: Pending, operation: str, *, body: bytes | None = None,
                    capture: Capture | None = None) -> None:
        """Store an answer (a JSON body, or a captured stream) in the background, after the client has it."""
        task = asyncio.get_running_loop().create_task(self._store_safely(pending, operation, body, capture))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def skip_store(self, reason: str) -> None:
        self.metrics.cache_stores.labels(self.group, reason).inc()

    async def _store_safely(self, pending: Pending, operation: str, body: bytes | None,
                            capture: Capture | None) -> None:
        try:
            await self._store(pending, operation, body, capture)
        except Exception:  # a bug must cost the cache an entry, never the gateway a task error
            log.exception("response cache %s: storing an answer failed", self.group)
            self.skip_store("error")

    async def _store(self, pending: Pending, operation: str, body: bytes | None, capture: Capture | None) -> None:
        try:
            if capture is not None:
                if capture.overflow:
                    return self.skip_store("too_large")
                document = assemble_stream(b"".join(capture.chunks), operation)
                body = orjson.dumps(document)
            else:
                document = orjson.loads(body)
        except (Unassemblable, orjson.JSONDecodeError) as exc:
            log.debug("response cache %s: answer not stored: %s", self.group, exc)
            return self.skip_store("unassemblable")
        if not finished_cleanly(document):
            return self.skip_store("unfinished")
        if len(pending.key) + len(body) > self.spec.max_entry_bytes:
            return self.skip_store("too_large")
        try:
            if self.exact is not None:
                await self.exact.put(pending.digest, Entry(pending.key, body))
            if self.semantic is not None and pending.vector is not None:
                await self.semantic.add(pending.partition, pending.tag, pending.vector, Entry(pending.context, body))
        except StoreUnavailable:
            return self.skip_store("store_unavailable")
        self.skip_store("stored")

    async def flush(self) -> None:
        """Wait for the answers being stored (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        if self._link is not None:
            await self._link.close()  # what the Redis stores hold open
            return
        for store in (self.exact, self.semantic):
            if store is not None:
                await store.close()


class CacheRegistry:
    """The caches of the current route table, by group; rebuilt for a group whose cache settings change."""

    def __init__(self, metrics, session: Callable[[], aiohttp.ClientSession | None]):
        self.metrics = metrics
        self._session = session
        self._caches: dict[str, ResponseCache] = {}
        self._retired: set[asyncio.Task] = set()

    def get(self, group: str) -> ResponseCache | None:
        return self._caches.get(group)

    def update(self, specs: Iterable) -> None:
        """Follow a route table (GroupSpecs): new caches for new or changed settings, old ones closed."""
        caches = {}
        for spec in specs:
            current = self._caches.get(spec.name)
            if spec.cache is None:
                continue
            if current is not None and current.spec == spec.cache:
                caches[spec.name] = current
            else:
                caches[spec.name] = ResponseCache(spec.name, spec.cache, self.metrics, self._session)
        for name, cache in self._caches.items():
            if caches.get(name) is not cache:
                self._retire(cache)
        self._caches = caches

    def _retire(self, cache: ResponseCache) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not started yet: nothing open
        task = loop.create_task(cache.close())
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    def sizes(self) -> Iterable[tuple[str, str, int, int]]:
        for name, cache in self._caches.items():
            for kind, entries, size in cache.sizes():
                yield name, kind, entries, size

    async def close(self) -> None:
        for cache in self._caches.values():
            await cache.close()
        self._caches = {}
        if self._retired:
            await asyncio.gather(*list(self._retired), return_exceptions=True)
