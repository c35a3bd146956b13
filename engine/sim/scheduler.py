"""vLLM V1's scheduler loops as the base of ``EngineCore``: the waiting queue, the decode aggregate's bookkeeping,
the RUNNING loop with preemption by recompute (exact, or planned without visiting the aggregate) and the WAITING
loop that admits requests with prefix-cache hits and chunked prefills."""
from __future__ import annotations

import heapq
from collections import deque
from itertools import islice

from engine.config import EngineConfig
from engine.sim.kv_cache import NO_HIT, BlockPool, CacheHit
from engine.sim.request import RUNNING, WAITING, EngineRequest


class SchedulerMixin:
    """The scheduling half of ``EngineCore``; it works on the state ``EngineCore.__init__`` sets up (below)."""

    config: EngineConfig
    pool: BlockPool
    block_size: int
    max_model_len: int
    max_num_seqs: int
    spec_k: int
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    _threshold: int
    _partial_gate: bool
    _priority: bool
    _lookahead: int
    _waiting_fcfs: deque[EngineRequest]
    _waiting_heap: list[tuple[int, float, int, EngineRequest]]
    _num_waiting: int
    _running: dict[int, EngineRequest]
    _explicit: dict[int, EngineRequest]
    _tick: int
    _agg_n: int
    _agg_offset: int
    _bucket: list[int]
    _finish_heap: list[tuple[int, int, EngineRequest]]
    _admitted_last_step: bool

    # ------------------------------------------------------------------ waiting queue
    def _push_waiting(self, seq: EngineRequest, *, front: bool) -> None:
        seq.state = WAITING
        self._num_waiting += 1
        if self._priority:
            heapq.heappush(self._waiting_heap, (seq.req.priority, seq.req.arrival_time, seq.order, seq))
        elif front:
            self._waiting_fcfs.appendleft(seq)
        else:
            self._waiting_fcfs.append(seq)

    def _peek_waiting(self) -> EngineRequest | None:
        if self._priority:
            heap = self._waiting_heap
            while heap and heap[0][3].state != WAITING:
                heapq.heappop(heap)
            return heap[0][3] if heap else None
        queue = self._waiting_fcfs
        while queue and queue[0].state != WAITING:
            queue.popleft()
        return queue[0] if queue else None

    def _pop_waiting(self) -> None:
        if self._priority:
            heapq.heappop(self._waiting_heap)
        else:
            self._waiting_fcfs.popleft()
        self._num_waiting -= 1

    # ------------------------------------------------------------------ the decode aggregate
    def _join(self, seq: EngineRequest) -> None:
        tick = self._tick
        seq.agg = True
        seq.t0, seq.c0, seq.g0 = tick, seq.computed, seq.generated
        seq.key = (tick - seq.computed) % self.block_size
        self._bucket[seq.key] += 1
        self._agg_n += 1
        self._agg_offset += seq.computed - tick + 1
        seq.finish_tick = tick + seq.output - seq.generated
        heapq.heappush(self._finish_heap, (seq.finish_tick, seq.order, seq))
        del self._explicit[seq.order]

    def _sync(self, seq: EngineRequest) -> None:
        """Materialise an aggregate member's counters at the current tick."""
        steps = self._tick - seq.t0
        seq.computed = seq.c0 + steps
        seq.generated = seq.g0 + steps
        seq.req.num_generated = seq.generated
        blocks = -(-seq.computed // self.block_size)
        if blocks > seq.blocks.num_blocks:
            seq.blocks.num_blocks = blocks

    def _leave(self, seq: EngineRequest) -> None:
        self._sync(seq)
        seq.agg = False
        self._bucket[seq.key] -= 1
        self._agg_n -= 1
        self._agg_offset -= seq.c0 - seq.t0 + 1
        self._explicit[seq.order] = seq

    def _dissolve(self) -> None:
        for seq in list(self._running.values()):
            if seq.agg:
                self._leave(seq)

    def _leave_running(self, seq: EngineRequest) -> None:
        if seq.agg:
            self._leave(seq)
        del self._running[seq.order]
        self._explicit.pop(seq.order, None)

    # ------------------------------------------------------------------ the RUNNING and WAITING loops
    def _running_ask(self, seq: EngineRequest, budget: int) -> int:
        """Tokens a running request asks for this step (vLLM: num_tokens_with_spec - num_computed_tokens, capped)."""
        decoding = seq.generated > 0 and seq.computed == seq.num_tokens - 1
        num_new = seq.num_tokens - seq.computed
        if decoding:
            num_new += self.spec_k
        if 0 < self._threshold < num_new:
            num_new = self._threshold
        if num_new > budget:
            num_new = budget
        cap = self.max_model_len - 1 - seq.computed
        return num_new if num_new < cap else cap

    def _slots(self, seq: EngineRequest, num_new: int) -> int:
        lookahead = self._lookahead if seq.generated > 0 else 0
        slots = seq.computed + num_new + lookahead
        return slots if slots < self.max_model_len else self.max_model_len

    def _fast_plan(self, budget: int) -> tuple[int, list[tuple[EngineRequest, int]]] | None:
        """The running loop's outcome without visiting the aggregate, or None when only the exact loop can tell.

        Returns the blocks the running requests need and each explicit request's ask. Decoding
        members ask for one token each. If the explicit requests (prefills) all come after the
        members in the running order, vLLM's loop gives them what the budget leaves, in order;
        otherwise their asks must all fit whole, so that the order does not matter.
        """
        members = self._agg_n
        need = self._bucket[self._tick % self.block_size] if members else 0
        asks: list[tuple[EngineRequest, int]] = []
        explicit = self._explicit
        if not explicit:
            return need, asks
        pool = self.pool
        count = len(explicit)
        tail = list(islice(reversed(self._running), count))
        if all(order in explicit for order in tail):
            remaining = budget - members
            for order in reversed(tail):
                seq = explicit[order]
                num_new = self._running_ask(seq, remaining) if remaining > 0 else 0
                if num_new > 0:
                    need += pool.blocks_needed(seq.blocks, self._slots(seq, num_new))
                    remaining -= num_new
                asks.append((seq, num_new))
            return need, asks
        total = members
        for seq in explicit.values():
            num_new = self._running_ask(seq, budget)
            full = seq.num_tokens - seq.computed
            if 0 < self._threshold < full:
                full = self._threshold
            if num_new < full:
                return None  # the budget or max_model_len cuts an ask: the running order matters
            total += num_new
            need += pool.blocks_needed(seq.blocks, self._slots(seq, num_new))
            asks.append((seq, num_new))
        return (need, asks) if total <= budget else None

    def _preempt_tail(self, need: int, asks: list[tuple[EngineRequest, int]], preempted: list[EngineRequest]) -> list[tuple[EngineRequest, int]]:
        """Preempt from the end of the running list until the remaining requests' blocks fit.

        This is what vLLM's loop ends with: the first request whose allocation fails pops
        the last running request, again and again, until it fits (or pops itself); every
        request before it has been served, and demands only add up, so the victims are
        exactly the shortest tail whose removal makes the total fit.
        """
        pool = self.pool
        ask_of = {seq.order: num_new for seq, num_new in asks}
        key = self._tick % self.block_size
        while need > pool.num_free and self._running:
            victim = self._running[next(reversed(self._running))]
            if victim.agg:
                if victim.key == key:
                    need -= 1
                self._leave(victim)
            else:
                num_new = ask_of.get(victim.order, 0)
                if num_new > 0:
                    need -= pool.blocks_needed(victim.blocks, self._slots(victim, num_new))
            self._preempt(victim)
            preempted.append(victim)
        return asks

    def _schedule_running(self, budget: int, scheduled: list[tuple[EngineRequest, int]], preempted: list[EngineRequest]) -> int:
        """vLLM V1's RUNNING loop, request by request, with preemption by recompute."""
        running = list(self._running.values())
        index = 0
        pool = self.pool
        while index < len(running) and budget > 0:
            seq = running[index]
            num_new = self._running_ask(seq, budget)
            if num_new <= 0:
                index += 1
                continue
            while not pool.allocate(seq.blocks, self._slots(seq, num_new), num_tokens_to_cache=seq.computed + num_new):
                if self._priority:
                    victim = max(running, key=lambda s: (s.req.priority, s.req.arrival_time))
                    victim_index = running.index(victim)
                    running.pop(victim_index)
                    for position, (candidate, count) in enumerate(scheduled):
                        if candidate is victim:
                            scheduled.pop(position)
                            budget += count
                            index -= 1
                            break
                else:
                    victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.state != RUNNING:
                break
            scheduled.append((seq, num_new))
            budget -= num_new
            index += 1
        return budget

    def _preempt(self, seq: EngineRequest) -> None:
        del self._running[seq.order]
        self._explicit.pop(seq.order, None)
        self.pool.free(seq.blocks, num_computed=seq.computed, resumable=True)
        seq.computed = 0
        seq.preempted = True
        seq.req.num_preemptions += 1
        self.num_preemptions_total += 1
        self._push_waiting(seq, front=True)

    def _schedule_waiting(self, now: float, budget: int, scheduled: list[tuple[EngineRequest, int]]) -> int:
        """vLLM V1's WAITING loop: admit in queue order while tokens, sequences and blocks allow."""
        pool = self.pool
        skipped: list[EngineRequest] = []
        partial = long = 0
        if self._partial_gate:
            for seq, num_new in scheduled:
                if seq.computed + num_new < seq.num_tokens:
                    partial += 1
                    long += seq.long
        while budget > 0 and self._num_waiting:
            if len(self._running) >= self.max_num_seqs:
                break
            seq = self._peek_waiting()
            num_tokens = seq.num_tokens
            hit: CacheHit = pool.lookup(seq.blocks, num_tokens) if seq.blocks.prompt_hashes or seq.preempted \
                else NO_HIT
            computed = hit.num_blocks * self.block_size
            num_new = num_tokens - computed
            if 0 < self._threshold < num_new:
                num_new = self._threshold
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            if num_new > budget:
                num_new = budget
            if self._partial_gate and computed + num_new < num_tokens:
                is_long = num_tokens - computed > self._threshold
                if partial >= self.config.max_num_partial_prefills or (
                    is_long and long >= self.config.max_long_partial_prefills
                ):
                    # V0's concurrent partial prefills: a short prompt may go ahead of a blocked long one.
                    self._pop_waiting()
                    seq.state = -1  # hidden from the queue until put back below
                    skipped.append(seq)
                    continue
                partial += 1
                long += is_long
                seq.long = is_long
            slots = computed + num_new
            if slots > self.max_model_len:
                slots = self.max_model_len
            if not pool.allocate(seq.blocks, slots, hit, num_tokens_to_cache=computed + num_new):
                break
            self._pop_waiting()
            seq.state = RUNNING
            seq.computed = computed
            self._running[seq.order] = seq
            self._explicit[seq.order] = seq
            if self.config.enable_prefix_caching and not seq.preempted:
                # vLLM records preempted requests' lookups apart from these two counters.
                self.prefix_cache_queries += num_tokens
                self.prefix_cache_hits += computed
            if not seq.scheduled:
                seq.scheduled = True
                seq.req.scheduled_time = now
                seq.req.num_cached_tokens = computed
            scheduled.append((seq, num_new))
            budget -= num_new
            self._admitted_last_step = True
        for seq in reversed(skipped):
            self._push_waiting(seq, front=True)
        return budget
