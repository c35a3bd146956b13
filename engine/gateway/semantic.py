"""The semantic cache's parts: the embeddings client and the in-gateway vector index.

**Embeddings.** The query text goes to the operator's OpenAI-compatible ``/v1/embeddings``
URL (``{"model", "input", "encoding_format": "float"}``; ``Authorization: Bearer $api_key_env``
when named) with a total timeout of ``timeout_s``. Any failure is an ``EmbeddingFailed``
with the miss reason the span records: ``embeddings_unavailable`` (no connection),
``embeddings_timeout``, ``embeddings_error`` (a non-200 answer) or ``embeddings_malformed``
(not a vector of finite numbers). The request is then served as a miss; the client never
sees the failure.

**Index.** One float32 matrix per partition (namespace and model), rows L2-normalised, so
a lookup is one matrix-vector product: cosine similarity against every stored query of
the partition. Rows of another context (the rest of the request: system prompt, earlier
turns, parameters; its 64-bit tag) or past their expiry are masked out before the best
row is taken. Above ``EXACT_ROWS`` rows the product alone reads too much memory (100,000
x 384 float32 is 150 MB per lookup: 10-15 ms on the project's VMs), so a partition also
keeps each row's sign bits (48 bytes at 384 dimensions), and a lookup first takes the
``CANDIDATES`` live rows nearest by Hamming distance of those bits (all rows at the cut-off
distance included), then scores them exactly. A row at cosine 0.9 or more differs from the query in about 14% of its sign bits,
a random row in 50%, so the best row is among the candidates unless more than
``CANDIDATES`` rows crowd around the query (then a hit is still a row above the threshold,
perhaps not the very best). Without ``numpy.bitwise_count`` (NumPy < 2.0) lookups stay exact. The index holds at most ``max_entries`` rows over all partitions; the least
recently used row goes first (a hit counts as a use). Expired rows are dropped as they
are met and in a sweep every ``_SWEEP_EVERY`` additions to a partition.
"""
from __future__ import annotations

import collections
import os
from collections.abc import Callable

import aiohttp
import numpy as np
import orjson

from engine.gateway.cache_config import SemanticSpec

MAX_DIMENSION = 8192
EXACT_ROWS = 4096
CANDIDATES = 128
_POPCOUNT = getattr(np, "bitwise_count", None)
_MAX_EMBEDDINGS_BODY = 4 * 1024 * 1024
_SWEEP_EVERY = 1024
_NO_MATCH = np.float32(-2.0)  # below any cosine similarity


class EmbeddingFailed(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def unit_vector(values: object) -> np.ndarray:
    """A list of finite numbers as an L2-normalised float32 vector; EmbeddingFailed otherwise."""
    if not isinstance(values, list) or not 0 < len(values) <= MAX_DIMENSION or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise EmbeddingFailed("embeddings_malformed", f"the embedding is not a list of 1-{MAX_DIMENSION} numbers")
    vector = np.asarray(values, dtype=np.float32)
    norm = float(np.linalg.norm(vector))
    if not np.isfinite(vector).all() or not np.isfinite(norm) or norm == 0:
        raise EmbeddingFailed("embeddings_malformed", "the embedding is zero or not finite")
    return vector / np.float32(norm)


class Embedder:
    """Calls the operator's embeddings endpoint through the gateway's HTTP session."""

    def __init__(self, spec: SemanticSpec, session: Callable[[], aiohttp.ClientSession | None]):
        self.spec = spec
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
        self._body = {"model": spec.model, "encoding_format": "float"}

    async def embed(self, text: str) -> np.ndarray:
        session = self._session()
        if session is None:
            raise EmbeddingFailed("embeddings_unavailable", "the gateway has no HTTP session (not started)")
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.spec.api_key_env) if self.spec.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            async with session.post(self.spec.embeddings_url, data=orjson.dumps(dict(self._body, input=text)),
                                    headers=headers, timeout=self._timeout, allow_redirects=False) as response:
                if response.status != 200:
                    raise EmbeddingFailed("embeddings_error", f"the embeddings endpoint answered {response.status}")
                raw = await _read_limited(response)
        except TimeoutError:
            raise EmbeddingFailed("embeddings_timeout", f"no embedding within {self.spec.timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EmbeddingFailed("embeddings_unavailable", f"{type(exc).__name__}: {exc}") from None
        try:
            document = orjson.loads(raw)
            values = document["data"][0]["embedding"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            raise EmbeddingFailed("embeddings_malformed", "the answer has no data[0].embedding") from None
        return unit_vector(values)


async def _read_limited(response: aiohttp.ClientResponse) -> bytes:
    chunks, size = [], 0
    while chunk := await response.content.readany():
        size += len(chunk)
        if size > _MAX_EMBEDDINGS_BODY:
            raise EmbeddingFailed("embeddings_malformed", f"the answer is larger than {_MAX_EMBEDDINGS_BODY} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def sign_bits(vectors: np.ndarray, words: int) -> np.ndarray:
    """The sign bits of each vector (the last axis), packed into ``words`` 64-bit words."""
    packed = np.packbits(vectors > 0, axis=-1)
    missing = words * 8 - packed.shape[-1]
    if missing:
        packed = np.concatenate([packed, np.zeros(packed.shape[:-1] + (missing,), dtype=np.uint8)], axis=-1)
    return np.ascontiguousarray(packed).view(np.uint64)


class _Partition:
    """The rows of one namespace and model: vectors, their sign bits, context tags, expiry times, ids, payloads."""

    __slots__ = ("dimension", "words", "matrix", "bits", "tags", "expires", "ids", "payloads", "row_of", "size",
                 "adds")

    def __init__(self, dimension: int):
        self.dimension = dimension
        self.words = (dimension + 63) // 64
        self.matrix = np.empty((16, dimension), dtype=np.float32)
        self.bits = np.empty((self.words, 16), dtype=np.uint64)  # word-major: one pass per word reads it in order
        self.tags = np.empty(16, dtype=np.int64)
        self.expires = np.empty(16, dtype=np.float64)
        self.ids: list[str] = []
        self.payloads: list[object] = []
        self.row_of: dict[str, int] = {}
        self.size = 0
        self.adds = 0

    def append(self, entry_id: str, tag: int, vector: np.ndarray, expires: float, payload: object) -> None:
        if self.size == len(self.tags):
            capacity = 2 * self.size
            self.matrix = np.resize(self.matrix, (capacity, self.dimension))
            bits = np.empty((self.words, capacity), dtype=np.uint64)
            bits[:, :self.size] = self.bits[:, :self.size]
            self.bits = bits
            self.tags = np.resize(self.tags, capacity)
            self.expires = np.resize(self.expires, capacity)
        row = self.size
        self.matrix[row] = vector
        self.bits[:, row] = sign_bits(vector, self.words)
        self.tags[row] = tag
        self.expires[row] = expires
        self.ids.append(entry_id)
        self.payloads.append(payload)
        self.row_of[entry_id] = row
        self.size += 1
        self.adds += 1

    def remove(self, entry_id: str) -> object:
        row = self.row_of.pop(entry_id)
        last = self.size - 1
        payload = self.payloads[row]
        if row != last:  # the last row moves into the hole
            self.matrix[row] = self.matrix[last]
            self.bits[:, row] = self.bits[:, last]
            self.tags[row] = self.tags[last]
            self.expires[row] = self.expires[last]
            self.ids[row] = self.ids[last]
            self.payloads[row] = self.payloads[last]
            self.row_of[self.ids[row]] = row
        self.ids.pop()
        self.payloads.pop()
        self.size = last
        return payload

    def best(self, tag: int, vector: np.ndarray, now: float) -> tuple[int, float]:
        """(row, similarity) of the best live row of this context; row -1 when there is none."""
        if self.size == 0:
            return -1, -1.0
        live = (self.tags[:self.size] == tag) & (self.expires[:self.size] > now)
        if self.size <= EXACT_ROWS or _POPCOUNT is None:
            scores = np.where(live, self.matrix[:self.size] @ vector, _NO_MATCH)
            row = int(scores.argmax())
            score = float(scores[row])
            return (row, score) if score > _NO_MATCH else (-1, -1.0)
        query = sign_bits(vector, self.words)
        distances = _POPCOUNT(self.bits[0, :self.size] ^ query[0]).astype(np.uint16)
        for word in range(1, self.words):
            distances += _POPCOUNT(self.bits[word, :self.size] ^ query[word])
        far = self.words * 64 + 1  # no row is this far: where the masked rows go
        distances = np.where(live, distances, np.uint16(far))
        # The cut-off: the smallest distance with CANDIDATES rows at or below it (a histogram, not a sort).
        cut = min(int(np.searchsorted(np.cumsum(np.bincount(distances, minlength=far + 1)), CANDIDATES)), far - 1)
        candidates = np.flatnonzero(distances <= cut)
        if not len(candidates):
            return -1, -1.0
        scores = self.matrix[candidates] @ vector
        best = int(scores.argmax())
        return int(candidates[best]), float(scores[best])


class VectorIndex:
    """Stored query vectors, bounded to ``max_entries`` rows over all partitions (least recently used first out)."""

    def __init__(self, max_entries: int, on_evict: Callable[[str, int], None] = lambda reason, count: None,
                 payload_bytes: Callable[[object], int] = lambda payload: 0):
        self.max_entries = max_entries
        self._on_evict = on_evict
        self._payload_bytes = payload_bytes
        self._partitions: dict[str, _Partition] = {}
        self._order: collections.OrderedDict[str, str] = collections.OrderedDict()  # entry id -> partition
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._order

    @property
    def bytes(self) -> int:
        return self._bytes + sum(p.size * (p.dimension * 4 + p.words * 8 + 16) for p in self._partitions.values())

    def add(self, partition: str, entry_id: str, tag: int, vector: np.ndarray, expires: float, now: float,
            payload: object = None) -> None:
        if entry_id in self._order:
            return
        rows = self._partitions.get(partition)
        if rows is None or rows.dimension != len(vector):
            if rows is not None:  # the embedding model changed: its old vectors cannot be compared
                self._drop_partition(partition, "dimension")
            rows = self._partitions[partition] = _Partition(len(vector))
        rows.append(entry_id, tag, vector, expires, payload)
        self._order[entry_id] = partition
        self._bytes += self._payload_bytes(payload)
        if rows.adds % _SWEEP_EVERY == 0:
            self._sweep(partition, now)
        while len(self._order) > self.max_entries:
            oldest, _ = next(iter(self._order.items()))
            self.remove(oldest)
            self._on_evict("capacity", 1)

    def remove(self, entry_id: str) -> None:
        partition = self._order.pop(entry_id, None)
        if partition is None:
            return
        rows = self._partitions[partition]
        self._bytes -= self._payload_bytes(rows.remove(entry_id))
        if rows.size == 0:
            del self._partitions[partition]

    def search(self, partition: str, tag: int, vector: np.ndarray, now: float,
               threshold: float) -> tuple[str | None, float, object]:
        """(entry id, similarity, payload) of the most similar live row of ``tag`` in ``partition``.

        The id is None when that row is below ``threshold``, when the partition holds no live row
        of that context, or only vectors of another dimension (then the similarity is -1)."""
        rows = self._partitions.get(partition)
        if rows is None or rows.dimension != len(vector):
            return None, -1.0, None
        row, score = rows.best(tag, vector, now)
        if row < 0 or score < threshold:
            return None, score, None
        entry_id = rows.ids[row]
        self._order.move_to_end(entry_id)
        return entry_id, score, rows.payloads[row]

    def _sweep(self, partition: str, now: float) -> None:
        rows = self._partitions[partition]
        expired = [rows.ids[row] for row in np.flatnonzero(rows.expires[:rows.size] <= now)]
        for entry_id in expired:
            self.remove(entry_id)
        if expired:
            self._on_evict("expired", len(expired))

    def _drop_partition(self, partition: str, reason: str) -> None:
        entry_ids = list(self._partitions[partition].ids)
        for entry_id in entry_ids:
            self.remove(entry_id)
        self._on_evict(reason, len(entry_ids))
