"""The simulated KV block pool: capacity, prefix hits on full blocks, LRU eviction, preemption remnants."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sim.kv_cache import BlockPool, RequestBlocks, prompt_block_hashes

BLOCK = 16


def _request(key, ids=None):
    return RequestBlocks(key, prompt_block_hashes(ids, BLOCK) if ids is not None else None)


def test_null_block_is_reserved_and_usage_counts_held_blocks():
    pool = BlockPool(11, BLOCK)
    assert pool.num_usable == 10 and pool.num_free == 10 and pool.usage == 0.0
    request = _request(1)
    assert pool.allocate(request, 33)  # 33 tokens -> 3 blocks
    assert request.num_blocks == 3 and pool.num_free == 7
    assert abs(pool.usage - 0.3) < 1e-12
    pool.free(request)
    assert pool.num_free == 10 and pool.usage == 0.0
    pool.check()


def test_allocation_that_does_not_fit_changes_nothing():
    pool = BlockPool(5, BLOCK)
    request = _request(1)
    assert not pool.allocate(request, 5 * BLOCK)
    assert request.num_blocks == 0 and pool.num_free == 4
    assert pool.allocate(request, 4 * BLOCK)
    assert pool.num_free == 0


def test_prefix_hit_counts_full_blocks_and_always_leaves_the_last_token():
    pool = BlockPool(64, BLOCK)
    ids = list(range(40))  # 2 full blocks + 8 tokens
    first = _request(1, ids)
    assert pool.allocate(first, 40, num_tokens_to_cache=40)
    second = _request(2, ids)
    hit = pool.lookup(second, 40)
    assert hit.num_blocks == 2  # the partial third block is never shared
    # A prompt of exactly two blocks may reuse only one: the last token must be recomputed.
    exact = _request(3, ids[:32])
    assert pool.lookup(exact, 32).num_blocks == 1
    # A prompt sharing one block then diverging hits one block.
    other = _request(4, ids[:16] + [999] * 24)
    assert pool.lookup(other, 40).num_blocks == 1
    pool.check()


def test_shared_blocks_are_freed_only_when_the_last_user_leaves():
    pool = BlockPool(64, BLOCK)
    ids = list(range(64))
    a, b = _request(1, ids), _request(2, ids)
    assert pool.allocate(a, 64, num_tokens_to_cache=64)
    hit = pool.lookup(b, 64)
    assert hit.num_blocks == 3
    free_before = pool.num_free
    assert pool.allocate(b, 64, hit, num_tokens_to_cache=64)
    assert pool.num_free == free_before - 1  # only the last block is new
    pool.free(a)
    assert pool.num_free == free_before - 1 + 1  # a's private block only
    pool.free(b)
    assert pool.num_free == pool.num_usable
    pool.check()


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first():
    pool = BlockPool(9, BLOCK)  # 8 usable
    old_ids, new_ids = list(range(64)), list(range(1000, 1064))
    old = _request(1, old_ids)
    assert pool.allocate(old, 64, num_tokens_to_cache=64)
    pool.free(old)
    assert pool.lookup(_request(9, old_ids), 64).num_blocks == 3  # still cached while free
    newer = _request(2, new_ids)
    assert pool.allocate(newer, 64, num_tokens_to_cache=64)  # takes the 4 never-used blocks first
    assert pool.lookup(_request(9, old_ids), 64).num_blocks == 3
    pool.free(newer)
    filler = _request(3)
    assert pool.allocate(filler, 2 * BLOCK)  # evicts the two oldest free blocks: old's tail first
    assert pool.lookup(_request(9, old_ids), 64).num_blocks == 2
    assert pool.lookup(_request(9, new_ids), 64).num_blocks == 3
    pool.check()


def test_a_preempted_request_can_hit_its_own_blocks_until_they_are_evicted():
    pool = BlockPool(20, BLOCK)
    request = _request(7)  # unique prompt: only the request itself can ever hit its blocks
    assert pool.allocate(request, 100)
    pool.free(request, num_computed=100, resumable=True)  # 6 full blocks kept for it
    hit = pool.lookup(request, 101)
    assert hit.num_blocks == 6 and hit.evictable == 6
    assert pool.allocate(request, 101, hit)
    assert request.num_blocks == 7
    pool.free(request)
    pool.release_group(7)
    assert pool.lookup(request, 101).num_blocks == 0
    pool.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "preempt"]), st.integers(0, 5),
                          st.integers(1, 200), st.booleans()), max_size=60))
def test_random_operations_never_exceed_capacity(operations):
    pool = BlockPool(24, BLOCK)
    requests: dict[int, RequestBlocks] = {}
    computed: dict[int, int] = {}
    shared = list(range(300))
    for op, key, tokens, use_ids in operations:
        if op == "alloc":
            blocks = requests.get(key)
            if blocks is None:
                blocks = _request(key, shared[:tokens] if use_ids else None)
                requests[key] = blocks
                hit = pool.lookup(blocks, tokens) if blocks.num_blocks == 0 else None
            else:
                hit = None
            total = computed.get(key, 0) + tokens
            if hit is not None and pool.allocate(blocks, total, hit, num_tokens_to_cache=total):
                computed[key] = total
            elif hit is None and pool.allocate(blocks, total, num_tokens_to_cache=total):
                computed[key] = total
        elif key in requests:
            pool.free(requests.pop(key), num_computed=computed.pop(key, 0), resumable=op == "preempt")
        pool.check()
        # Blocks in use are exactly the distinct blocks the requests hold (shared prefix blocks once).
        shared_held = {h for r in requests.values() for h in r.hashes if h is not None}
        private = sum(r.num_blocks - sum(1 for h in r.hashes if h is not None) for r in requests.values())
        assert pool.num_usable - pool.num_free == private + len(shared_held) <= pool.num_usable
