"""The simulated KV-cache block pool: vLLM V1's paged blocks, prefix caching by chained hashes, LRU eviction.

Like ``vllm/v1/core/block_pool.py`` and ``kv_cache_manager.py``: the pool holds
``num_blocks`` blocks of ``block_size`` tokens (block 0 is vLLM's reserved null
block, so one fewer is usable); a request owns the blocks covering its computed
tokens; a full prompt block is registered under a hash chained over the token ids
of every block before it, so a later request with the same prefix reuses it
(full blocks only, at least one token always recomputed); freed blocks keep their
contents and join the tail of a free queue, tail block of a request first, and
allocation takes from the head, evicting whatever was cached there (LRU).

Two economies keep a simulated hour of traffic fast, without changing what vLLM
would hit: runs of blocks nobody can ever hit again (unique prompts, generated
tokens) are counted instead of listed, and a preempted request's own blocks are
kept as one "group" segment (it is the only request that can hit them, when it is
rescheduled), which eviction shortens from its tail as vLLM would.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

_ANON, _HASHED, _GROUP = 0, 1, 2


class _Segment:
    """A run of free blocks in LRU order: anonymous blocks, one cached block, or a preempted request's blocks."""

    __slots__ = ("kind", "count", "key", "base", "alive")

    def __init__(self, kind: int, count: int, key: object = None, base: int = 0):
        self.kind = kind
        self.count = count
        self.key = key  # the block hash (_HASHED) or the owning request's key (_GROUP)
        self.base = base  # _GROUP: index of the request's first block in the group
        self.alive = True


class _CachedBlock:
    """A block registered under a prefix hash: how many requests use it, and its free-queue entry when unused."""

    __slots__ = ("ref", "segment")

    def __init__(self) -> None:
        self.ref = 1
        self.segment: _Segment | None = None


class RequestBlocks:
    """The blocks one request holds: a leading run of hashed prompt blocks, then blocks only it can use."""

    __slots__ = ("key", "prompt_hashes", "hashes", "num_blocks", "sealed")

    def __init__(self, key: object, prompt_hashes: Sequence[int] | None):
        self.key = key
        self.prompt_hashes = prompt_hashes  # hash of every full prompt block, chained; None = unique prompt
        self.hashes: list[int | None] = []  # blocks [0, len) are registered prompt blocks (None: a duplicate)
        self.num_blocks = 0
        self.sealed = False  # own blocks follow the hashed run: no further prompt block can be registered


class CacheHit:
    """What a prefix-cache lookup found: shared prompt blocks and (after a preemption) the request's own blocks."""

    __slots__ = ("hashed_blocks", "own_blocks", "evictable")

    def __init__(self, hashed_blocks: int, own_blocks: int, evictable: int):
        self.hashed_blocks = hashed_blocks
        self.own_blocks = own_blocks
        self.evictable = evictable  # hit blocks currently in the free queue (they stop being free when used)

    @property
    def num_blocks(self) -> int:
        return self.hashed_blocks + self.own_blocks


NO_HIT = CacheHit(0, 0, 0)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The chained hash of every full block of a prompt (vLLM hashes the parent's hash with the block's ids)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


class BlockPool:
    """A fixed pool of KV blocks with vLLM V1's allocation, prefix-cache and eviction rules."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), not {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_usable = num_blocks - 1  # vLLM reserves block 0 as the null block
        self.enable_prefix_caching = enable_prefix_caching
        self.num_free = self.num_usable
        self._queue: deque[_Segment] = deque([_Segment(_ANON, self.num_usable)])
        self._cached: dict[int, _CachedBlock] = {}
        self._groups: dict[object, _Segment] = {}

    # ------------------------------------------------------------------ inspection
    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vllm:kv_cache_usage_perc; cached free blocks count as free)."""
        return 1.0 - self.num_free / self.num_usable

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, blocks: RequestBlocks, num_tokens: int) -> CacheHit:
        """The longest cached prefix of a request with nothing computed (vLLM's get_computed_blocks).

        At most ``num_tokens - 1`` tokens may hit: the last token is always recomputed to
        produce logits, and only whole blocks count.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        cap = (num_tokens - 1) // self.block_size
        hashed = 0
        evictable = 0
        prompt_hashes = blocks.prompt_hashes
        if prompt_hashes:
            cached = self._cached
            limit = min(cap, len(prompt_hashes))
            while hashed < limit:
                entry = cached.get(prompt_hashes[hashed])
                if entry is None:
                    break
                if entry.ref == 0:
                    evictable += 1
                hashed += 1
        own = 0
        group = self._groups.get(blocks.key)
        if group is not None and group.base == hashed and hashed < cap:
            own = min(group.count, cap - hashed)
            evictable += own
        if hashed == 0 and own == 0:
            return NO_HIT
        return CacheHit(hashed, own, evictable)

    # ------------------------------------------------------------------ allocation
    def blocks_needed(self, blocks: RequestBlocks, num_tokens: int, hit: CacheHit = NO_HIT) -> int:
        """Blocks the free queue must supply so the request covers ``num_tokens`` slots (hits included)."""
        new = -(-num_tokens // self.block_size) - blocks.num_blocks - hit.num_blocks
        return (new if new > 0 else 0) + hit.evictable

    def allocate(self, blocks: RequestBlocks, num_tokens: int, hit: CacheHit = NO_HIT, *,
                 num_tokens_to_cache: int = 0) -> bool:
        """Grow the request to cover ``num_tokens`` slots, using ``hit`` first; False (nothing changed) if short.

        ``num_tokens_to_cache`` is how many tokens will be computed after this step: the
        full prompt blocks among them are registered for later requests to hit.
        """
        new = -(-num_tokens // self.block_size) - blocks.num_blocks - hit.num_blocks
        if new < 0:
            new = 0
        if new + hit.evictable > self.num_free:
            return False
        if hit.hashed_blocks:
            self._touch_hashed(blocks, hit.hashed_blocks)
        if hit.own_blocks:
            self._touch_group(blocks, hit.own_blocks)
        if new:
            self.take(new)
            blocks.num_blocks += new
        if num_tokens_to_cache and blocks.prompt_hashes and self.enable_prefix_caching:
            self._register(blocks, num_tokens_to_cache)
        return True

    def take(self, count: int) -> None:
        """Take ``count`` blocks from the head of the free queue, evicting cached contents there (LRU)."""
        if count > self.num_free:
            raise RuntimeError(f"block pool asked for {count} blocks with {self.num_free} free")
        self.num_free -= count
        queue = self._queue
        while count:
            segment = queue[0]
            if not segment.alive:
                queue.popleft()
                continue
            kind = segment.kind
            if kind == _HASHED:
                queue.popleft()
                segment.alive = False
                del self._cached[segment.key]
                count -= 1
                continue
            taken = segment.count if segment.count <= count else count
            segment.count -= taken
            count -= taken
            if segment.count == 0:
                queue.popleft()
                segment.alive = False
                if kind == _GROUP:
                    del self._groups[segment.key]

    def _touch_hashed(self, blocks: RequestBlocks, count: int) -> None:
        cached = self._cached
        for block_hash in blocks.prompt_hashes[:count]:
            entry = cached[block_hash]
            if entry.ref == 0:
                entry.segment.alive = False
                entry.segment = None
                self.num_free -= 1
            entry.ref += 1
            blocks.hashes.append(block_hash)
        blocks.num_blocks += count

    def _touch_group(self, blocks: RequestBlocks, count: int) -> None:
        group = self._groups.pop(blocks.key)
        self.num_free -= count
        remaining = group.count - count
        if remaining:
            # The rest of the request's old blocks lie past the capped hit: still free, but no longer findable.
            group.kind = _ANON
            group.count = remaining
            group.key = None
        else:
            group.alive = False
        blocks.num_blocks += count
        blocks.sealed = True

    def _register(self, blocks: RequestBlocks, num_computed: int) -> None:
        if blocks.sealed:
            return
        full = min(num_computed // self.block_size, len(blocks.prompt_hashes), blocks.num_blocks)
        hashes = blocks.hashes
        cached = self._cached
        while len(hashes) < full:
            block_hash = blocks.prompt_hashes[len(hashes)]
            if block_hash in cached:
                hashes.append(None)  # computed twice in the same step by two requests: the copy stays private
            else:
                cached[block_hash] = _CachedBlock()
                hashes.append(block_hash)

    # ------------------------------------------------------------------ freeing
    def free(self, blocks: RequestBlocks, *, num_computed: int = 0, resumable: bool = False) -> None:
        """Return a request's blocks to the free queue, tail block first (so it is evicted first).

        ``resumable`` (a preemption): the request's own full computed blocks stay findable by
        the request itself until evicted, as vLLM's block hashes make them.
        """
        if not blocks.num_blocks:
            return
        own = blocks.num_blocks - len(blocks.hashes)
        if own:
            own_full = 0
            if resumable and self.enable_prefix_caching:
                own_full = min(own, num_computed // self.block_size - len(blocks.hashes))
                if own_full < 0:
                    own_full = 0
            if own - own_full:
                self._push_anon(own - own_full)
            if own_full:
                stale = self._groups.get(blocks.key)
                if stale is not None:
                    stale.kind, stale.key = _ANON, None
                group = _Segment(_GROUP, own_full, blocks.key, len(blocks.hashes))
                self._queue.append(group)
                self._groups[blocks.key] = group
        returned = own
        cached = self._cached
        for block_hash in reversed(blocks.hashes):
            if block_hash is None:
                self._push_anon(1)
                returned += 1
                continue
            entry = cached[block_hash]
            entry.ref -= 1
            if entry.ref == 0:  # still shared by another request otherwise
                segment = _Segment(_HASHED, 1, block_hash)
                entry.segment = segment
                self._queue.append(segment)
                returned += 1
        self.num_free += returned
        blocks.hashes = []
        blocks.num_blocks = 0
        blocks.sealed = False

    def _push_anon(self, count: int) -> None:
        queue = self._queue
        if queue:
            tail = queue[-1]
            if tail.kind == _ANON and tail.alive:
                tail.count += count
                return
        queue.append(_Segment(_ANON, count))

    def release_group(self, key: object) -> None:
        """Forget a finished or aborted request's own cached blocks (only it could have hit them)."""
        group = self._groups.pop(key, None)
        if group is not None:
            group.kind, group.key = _ANON, None

    def check(self) -> None:
        """Assert the pool's bookkeeping is consistent (used by tests)."""
        free = sum(s.count for s in self._queue if s.alive)
        assert free == self.num_free, (free, self.num_free)
        assert 0 <= self.num_free <= self.num_usable
        for block_hash, entry in self._cached.items():
            assert entry.ref >= 0
            assert (entry.ref == 0) == (entry.segment is not None and entry.segment.alive), block_hash
