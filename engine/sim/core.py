"""A simulated vLLM V1 engine core: one scheduler step at a time, on the caller's clock.

``EngineCore.step(now)`` does what one iteration of vLLM's ``EngineCore.step``
does (``vllm/v1/core/sched/scheduler.py``): schedule the RUNNING requests first
(a decode asks for 1 token, 1 + k with speculative decoding; a partial prefill
for the rest of its prompt, capped by ``long_prefill_token_threshold``), each
allocating KV blocks and, when the pool is exhausted, preempting the last running
request (the lowest-priority one under ``priority``) by recompute; then, if
nothing was preempted, admit WAITING requests in FCFS (or priority) order while
the token budget, ``max_num_seqs`` and the KV pool allow, reusing prefix-cache
hits and chunking prefills. The step's duration comes from the roofline in
``cost_model.py`` (plus the proposer's drafting time); the step emits a token
for every request whose known tokens are all computed.

Nothing here touches a GPU: it is a model, labelled as such wherever its output
is shown. ``max_num_partial_prefills`` / ``max_long_partial_prefills`` (which
vLLM V1 refuses unless 1, and recent vLLM removed) are modelled as vLLM V0
applied them, and only when ``max_num_partial_prefills > 1``.

Speed: a decoding request's step differs from the last only by a longer context,
so decoding requests are kept as one aggregate (a tick counter, per-residue block
counts, a heap of finish ticks) and a step visits only the requests that are
prefilling, newly admitted, finishing or preempted; preemption when the pool runs
short is reproduced from the tail of the running list without visiting the rest.
``advance`` runs a whole series of identical decode steps in closed form up to the
next event. ``SimOptions(fast_path=False)`` turns both off (every request visited
every step, exactly as the V1 loop reads); tests check that the two agree.

The scheduler's loops are ``scheduler.SchedulerMixin``; the requests in and out are in
``request.py``, the simulator's own parameters in ``options.py``.
"""
from __future__ import annotations

import heapq
import math
from collections import deque

from engine.config import EngineConfig
from engine.sim.cost_model import StepCostModel
from engine.sim.kv_cache import BlockPool, prompt_block_hashes
from engine.sim.memory import MemoryPlan, SimulationConfigError, plan_memory
from engine.sim.options import SimOptions
from engine.sim.profiles import HardwareProfile, ModelProfile, hardware_profile, model_profile
from engine.sim.request import FINISHED, RUNNING, WAITING, EngineRequest, RequestRejected, SimRequest, StepOutput
from engine.sim.scheduler import SchedulerMixin
from engine.sim.speculative import LOOKAHEAD_METHODS, AcceptanceSampler, DraftCostModel, acceptance_rates


class EngineCore(SchedulerMixin):
    """The simulated engine core of one replica (all its tensor-parallel GPUs)."""

    def __init__(self, config: EngineConfig, *, hardware: HardwareProfile | None = None,
                 model: ModelProfile | None = None, options: SimOptions | None = None, seed: int = 0):
        config = config.validate().resolved()
        self.config = config
        self.hardware = hardware or hardware_profile(config.gpu_type)
        self.options = (options or SimOptions()).resolved_for(self.hardware)
        self.model = model or model_profile(config.model)
        self.cost = StepCostModel(
            self.model, self.hardware, tensor_parallel_size=config.tensor_parallel_size,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        self.memory: MemoryPlan = plan_memory(config, self.model, self.hardware)
        num_blocks = self.options.num_gpu_blocks_override or self.memory.num_blocks
        block_size = config.block_size
        self.block_size = block_size
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        if num_blocks - 1 < -(-self.max_model_len // block_size):
            raise SimulationConfigError(
                f"the KV cache holds {(num_blocks - 1) * block_size} tokens ({num_blocks - 1} blocks of "
                f"{block_size}), fewer than one request of max_model_len={self.max_model_len} needs: vLLM refuses "
                f"to start; lower max_model_len, raise gpu_memory_utilization or tensor_parallel_size"
            )
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching)
        self.num_blocks_total = num_blocks
        self._threshold = config.long_prefill_token_threshold
        self._partial_gate = config.enable_chunked_prefill and config.max_num_partial_prefills > 1
        self._priority = config.scheduling_policy == "priority"

        spec = config.speculative_config
        self.spec_k = spec.num_speculative_tokens if spec else 0
        self._lookahead = self.spec_k if spec and spec.method in LOOKAHEAD_METHODS else 0
        self._sampler: AcceptanceSampler | None = None
        self._drafter: DraftCostModel | None = None
        if spec is not None:
            rates = acceptance_rates(spec.method, spec.num_speculative_tokens, self.options.acceptance_rates)
            self.spec_acceptance_rates = rates
            self._sampler = AcceptanceSampler(rates, seed)
            self._drafter = DraftCostModel(
                spec, self.model, self.hardware, tensor_parallel_size=config.tensor_parallel_size,
                kv_cache_dtype=config.kv_cache_dtype,
            )
        self._aggregate = self.options.fast_path and spec is None

        # Request queues.
        self._requests: dict[str, EngineRequest] = {}
        self._waiting_fcfs: deque[EngineRequest] = deque()
        self._waiting_heap: list[tuple[int, float, int, EngineRequest]] = []
        self._num_waiting = 0
        self._running: dict[int, EngineRequest] = {}  # admission order, like vLLM's running list
        self._explicit: dict[int, EngineRequest] = {}  # running requests outside the aggregate
        self._order = 0

        # The decode aggregate.
        self._tick = 0
        self._agg_n = 0
        self._agg_offset = 0  # sum of (c0 - t0 + 1): the context sum at tick t is offset + n·t
        self._bucket = [0] * block_size  # members needing a new block when tick % block_size == index
        self._finish_heap: list[tuple[int, int, EngineRequest]] = []
        self._last_step_end: float | None = None
        self._admitted_last_step = False

        # Counters (vLLM's Prometheus metrics).
        self.num_preemptions_total = 0
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_num_accepted_tokens_per_pos = [0] * self.spec_k
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_finished = 0
        self.num_steps_total = 0
        self.busy_seconds_total = 0.0
        self.itl_samples: list[tuple[float, int]] = []
        # The API server's token stream as a fluid queue: work (seconds) not yet done at _stream_clock.
        self._stream_cost = self.options.api_seconds_per_output_token or 0.0
        self._stream_event = self.options.api_seconds_per_event or 0.0
        self._streaming = bool(self._stream_cost or self._stream_event)
        self._stream_backlog = 0.0
        self._stream_clock = -math.inf
        self._stream_last_work = 0.0
        self._stream_lag = 0.0  # how far behind the engine the stream is after the last step
        # The share of the engine's compute the API server takes while it works (the cores are shared).
        self._stream_share = self.hardware.api_core_share if self._streaming else 0.0
        self._admit_backlog = 0.0  # the server's admission work not yet done at _stream_clock

    def set_hardware(self, hardware: HardwareProfile) -> None:
        """Run the steps from now on with ``hardware``'s constants (a GPU that degrades or is swapped mid-run: a
        driver update, a noisy neighbour, thermal throttling). The KV cache keeps its size: memory was planned at
        start-up, as vLLM's is."""
        self.hardware = hardware
        config = self.config
        self.cost = StepCostModel(self.model, hardware, tensor_parallel_size=config.tensor_parallel_size,
                                  kv_cache_dtype=config.kv_cache_dtype)
        if self._drafter is not None:
            self._drafter = DraftCostModel(config.speculative_config, self.model, hardware,
                                           tensor_parallel_size=config.tensor_parallel_size,
                                           kv_cache_dtype=config.kv_cache_dtype)

    # ------------------------------------------------------------------ state
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def kv_cache_usage(self) -> float:
        return self.pool.usage

    def has_unfinished_requests(self) -> bool:
        return bool(self._running) or self._num_waiting > 0

    def get_request(self, request_id: str) -> SimRequest | None:
        seq = self._requests.get(request_id)
        return seq.req if seq is not None else None

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: SimRequest, now: float) -> None:
        """Queue a request (vLLM's ``add_request``); sets ``queued_time = now``."""
        self._validate(request)
        hashes = None
        if request.prompt_token_ids is not None and self.config.enable_prefix_caching:
            hashes = prompt_block_hashes(request.prompt_token_ids, self.block_size)
        self._order += 1
        seq = EngineRequest(request, self._order, hashes)
        request.queued_time = now
        request.num_generated = 0
        request.finish_reason = None
        self._requests[request.request_id] = seq
        self._push_waiting(seq, front=False)

    def _validate(self, request: SimRequest) -> None:
        if not isinstance(request.request_id, str) or not request.request_id:
            raise RequestRejected("request_id must be a non-empty string")
        if request.request_id in self._requests:
            raise RequestRejected(f"request {request.request_id!r} is already in the engine")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(request, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestRejected(f"{name} must be an integer >= 1, not {value!r}")
        if isinstance(request.priority, bool) or not isinstance(request.priority, int):
            raise RequestRejected(f"priority must be an integer, not {request.priority!r}")
        total = request.prompt_tokens + request.output_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({request.prompt_tokens} in the messages, {request.output_tokens} in the "
                f"completion). Please reduce the length of the messages or completion."
            )
        ids = request.prompt_token_ids
        if ids is not None and len(ids) != request.prompt_tokens:
            raise RequestRejected(
                f"prompt_token_ids has {len(ids)} ids but prompt_tokens is {request.prompt_tokens}"
            )

    def abort_request(self, request_id: str, now: float) -> SimRequest | None:
        """Abort a waiting or running request (client went away); returns it, or None if unknown/finished."""
        seq = self._requests.get(request_id)
        if seq is None or seq.state == FINISHED:
            return None
        if seq.state == WAITING:
            self._num_waiting -= 1  # its queue entry is skipped lazily
            self.pool.release_group(seq.order)
        else:
            self._leave_running(seq)
        self._finish(seq, now, "abort")
        return seq.req

    # ------------------------------------------------------------------ stepping
    def step(self, now: float) -> StepOutput:
        """Schedule one step starting at ``now``, run it, and return what it produced (tokens per request).

        Afterwards every running request's ``num_generated`` is current.
        """
        out = self._step(now, collect=True)
        self.sync_all()
        return out

    def advance(self, now: float, until: float | None = None, *, collect: bool = True) -> StepOutput:
        """One step, then as many identical decode-only steps as start before ``until`` with nothing changing.

        A run ends at the first event: a request finishing (its step is the run's last),
        the KV pool running short, or ``until`` (the next arrival). The result sums the
        run (``num_steps`` steps); with ``collect=False`` ``new_tokens`` stays empty,
        which is what makes long runs cheap.
        """
        out = self._step(now, collect=collect)
        if collect:
            self.sync_all()
        if (
            not self._aggregate
            or out.finished
            or out.num_preempted
            or self._explicit
            or self._agg_n == 0
            or self._admitted_last_step
            or self._stream_share
        ):
            return out
        steps = self._run_length(out.end_time, until)
        if steps <= 0:
            return out
        run = self._run(out.end_time, steps, collect)
        out.num_steps += run.num_steps
        out.end_time = run.end_time
        out.duration = out.end_time - out.start_time
        out.num_scheduled_tokens += run.num_scheduled_tokens
        out.finished.extend(run.finished)
        if collect:
            for request_id, count in run.new_tokens.items():
                out.new_tokens[request_id] = out.new_tokens.get(request_id, 0) + count
            self.sync_all()
        return out

    def _step(self, now: float, collect: bool) -> StepOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int]] = []
        preempted: list[EngineRequest] = []
        agg_tokens = 0
        plan = self._fast_plan(budget) if self._aggregate else None
        if plan is not None and self._priority and plan[0] > self.pool.num_free:
            plan = None  # priority preemption picks its victims across the whole running list
        if plan is not None:
            need, asks = plan
            if need > self.pool.num_free:
                asks = self._preempt_tail(need, asks, preempted)
            agg_tokens = self._agg_n
            if agg_tokens:
                self.pool.take(self._bucket[self._tick % self.block_size])
            budget -= agg_tokens
            allocate, slots = self.pool.allocate, self._slots
            for seq, num_new in asks:
                if seq.state != RUNNING or num_new <= 0:
                    continue
                ok = allocate(seq.blocks, slots(seq, num_new), num_tokens_to_cache=seq.computed + num_new)
                assert ok, "the fast path checked the blocks"
                scheduled.append((seq, num_new))
                budget -= num_new
        else:
            if self._agg_n:
                self._dissolve()
            budget = self._schedule_running(budget, scheduled, preempted)
        self._admitted_last_step = False
        if not preempted:
            budget = self._schedule_waiting(now, budget, scheduled)
        return self._execute(now, scheduled, agg_tokens, preempted, collect)

    # ------------------------------------------------------------------ running the step
    def _execute(self, now: float, scheduled: list[tuple[EngineRequest, int]], agg_tokens: int,
                 preempted: list[EngineRequest], collect: bool) -> StepOutput:
        # 1. The target model's forward pass over everything scheduled.
        num_tokens = agg_tokens
        num_logits = agg_tokens
        pairs = 0.0
        kv_read = 0.0
        if agg_tokens:
            pairs = kv_read = float(self._agg_offset + self._agg_n * self._tick)
        spec_k = self.spec_k
        for seq, num_new in scheduled:
            computed = seq.computed
            num_tokens += num_new
            num_logits += num_new if spec_k and seq.generated > 0 and computed == seq.num_tokens - 1 else 1
            pairs += num_new * computed + num_new * (num_new + 1) / 2
            kv_read += computed + num_new
        duration = self.cost.pass_time(num_tokens, num_logits, pairs, kv_read)

        # 2. Sampling (and verification of drafts): who emits how many tokens.
        emitters: list[tuple[EngineRequest, int]] = []
        verified = False
        draft_requests = 0
        draft_first_pass = 0
        draft_context = 0.0
        for seq, num_new in scheduled:
            decoding = seq.generated > 0 and seq.computed == seq.num_tokens - 1
            seq.computed += num_new
            if seq.computed < seq.num_tokens:
                draft_first_pass += num_new  # a partial prefill chunk: no token yet
                continue
            emitted = 1
            drafts = num_new - 1 if spec_k and decoding else 0
            if drafts > 0:
                verified = True
                accepted = self._sampler.draw(drafts)
                seq.computed -= drafts - accepted
                emitted += accepted
                self.spec_num_drafts += 1
                self.spec_num_draft_tokens += drafts
                self.spec_num_accepted_tokens += accepted
                per_position = self.spec_num_accepted_tokens_per_pos
                for position in range(accepted):
                    per_position[position] += 1
                draft_first_pass += 1 + accepted
            else:
                draft_first_pass += num_new
            remaining = seq.output - seq.generated
            if emitted > remaining:
                emitted = remaining
            emitters.append((seq, emitted))
            if seq.generated + emitted < seq.output:
                draft_requests += 1
                draft_context += seq.computed + 1

        # 3. Verifying drafts costs a fixed extra; the proposer drafts for the next step before this
        # step's outputs are returned.
        if verified:
            duration += self._drafter.verify_overhead
        if self._drafter is not None and draft_requests:
            duration += self._drafter.time(draft_requests, draft_first_pass, draft_context)
        if self._stream_share:
            duration = self._contended(now, duration)
        end = now + duration
        out = StepOutput(start_time=now, duration=duration, end_time=end, num_scheduled_tokens=num_tokens,
                         num_preempted=len(preempted))
        new_tokens = out.new_tokens
        record_itl = self.options.record_itl
        if self._streaming:
            self._stream(now, end, agg_tokens + sum(emitted for _seq, emitted in emitters),
                         self._agg_n + sum(1 for _seq, emitted in emitters if emitted), 1)
        lag = self._stream_lag if self._streaming else 0.0

        # 4. The aggregate: every member computed one token and sampled the next.
        if agg_tokens:
            if collect:
                for seq in self._running.values():
                    if seq.agg:
                        new_tokens[seq.req.request_id] = 1
            if record_itl:
                previous = self._last_step_end
                self.itl_samples.append((end - previous if previous is not None else duration, agg_tokens))
            self.generation_tokens_total += agg_tokens
            self._tick += 1

        # 5. Tokens of the requests visited one by one.
        for seq, emitted in emitters:
            request = seq.req
            first = seq.generated == 0
            seq.generated += emitted
            request.num_generated = seq.generated
            self.generation_tokens_total += emitted
            if first:
                request.first_token_time = end
                request.stream_lag_first = lag
                self.prompt_tokens_total += seq.prompt
            elif record_itl:
                self.itl_samples.append((end - seq.last_emit, 1))
            seq.last_emit = end
            request.last_token_time = end
            if collect:
                new_tokens[request.request_id] = emitted
            if seq.generated >= seq.output:
                self._leave_running(seq)
                self._finish(seq, end, "length")
                out.finished.append(request)

        # 6. Aggregate members whose last token came in this step.
        if self._agg_n:
            self._pop_finished(end, out)

        # 7. Requests now decoding join the aggregate (prefills just completed; after an exact step, all).
        if self._aggregate and self._explicit:
            for seq in list(self._explicit.values()):
                if seq.generated > 0 and seq.computed == seq.num_tokens - 1:
                    self._join(seq)
        if num_tokens:
            self.num_steps_total += 1
            self.busy_seconds_total += duration
            self._last_step_end = end
        return out

    def _pop_finished(self, end: float, out: StepOutput) -> None:
        heap = self._finish_heap
        tick = self._tick
        while heap and heap[0][0] <= tick:
            finish_tick, _order, seq = heapq.heappop(heap)
            if not seq.agg or seq.finish_tick != finish_tick or seq.state != RUNNING:
                continue  # stale entry: the member left the aggregate since
            self._leave_running(seq)
            seq.last_emit = end
            seq.req.last_token_time = end
            self._finish(seq, end, "length")
            out.finished.append(seq.req)

    def _finish(self, seq: EngineRequest, now: float, reason: str) -> None:
        if seq.blocks.num_blocks:
            self.pool.free(seq.blocks)
        self.pool.release_group(seq.order)
        seq.state = FINISHED
        request = seq.req
        request.num_generated = seq.generated
        request.finish_reason = reason
        request.finished_time = now
        request.stream_lag_last = self._stream_lag if self._streaming and self._stream_clock <= now else 0.0
        del self._requests[request.request_id]
        if reason == "length":
            self.num_requests_finished += 1

    def _stream(self, start: float, end: float, tokens: int, streams: int, steps: int) -> None:
        """The API server's token stream over ``steps`` equal steps from ``start`` to ``end`` that made ``tokens``
        tokens for ``streams`` streams each (each step's share at its end), as a fluid queue: a step whose output
        needs more of the server than the step lasts leaves a backlog that grows, one that needs less drains it.
        Each token costs the server its per-token work; each stream's step costs one event, unless the server is
        still behind on that stream's previous output, which the new tokens then join (vLLM merges a lagging
        stream's outputs): with a backlog of L seconds each stream is visited about once per L, so a step of d
        seconds costs streams · d / max(d, L) events. The server shares its time between the tokens and the
        requests it is admitting (``stream_admit``), so either class waits longer while the other has work. The
        lag at a token's step is how much later than the engine the client sees it."""
        self._stream_drain(start - self._stream_clock)
        step = (end - start) / steps
        token_work = tokens / steps * self._stream_cost
        event = self._stream_event
        for _ in range(steps):
            self._stream_drain(step)
            backlog = self._stream_backlog
            work = token_work
            if event and streams:
                work += streams * event * (step / backlog if backlog > step else 1.0)
            self._stream_backlog = backlog + work
        self._stream_clock = end
        self._stream_last_work = work
        backlog = self._stream_backlog
        self._stream_lag = backlog + min(backlog, self._admit_backlog)

    def _contended(self, start: float, duration: float) -> float:
        """A step's duration when the API server works beside it on the same cores: while the server has work
        the engine runs at (1 − share) of its speed. The server's work is what waits at the step's start (this
        step's tokens come at its end): d' = d + share · min(waiting, d')."""
        share = self._stream_share
        self._stream_advance(start)
        waiting = self._stream_backlog + self._admit_backlog
        if waiting * (1.0 - share) >= duration:
            return duration / (1.0 - share)
        return duration + share * waiting

    def _stream_advance(self, when: float) -> None:
        """The server's work done up to ``when`` (nothing if the server's clock is already past it)."""
        self._stream_drain(when - self._stream_clock)
        self._stream_clock = max(self._stream_clock, when)

    def _stream_drain(self, elapsed: float) -> None:
        """``elapsed`` seconds of the server's work: shared equally while both classes wait, else all to one."""
        if elapsed <= 0:
            return
        admit, tokens = self._admit_backlog, self._stream_backlog
        if admit > 0 and tokens > 0:
            both = min(admit, tokens)
            if elapsed <= 2 * both:
                admit -= elapsed / 2
                tokens -= elapsed / 2
            else:
                rest = elapsed - 2 * both
                admit = max(0.0, admit - both - rest)
                tokens = max(0.0, tokens - both - rest)
        elif admit > 0:
            admit = max(0.0, admit - elapsed)
        else:
            tokens = max(0.0, tokens - elapsed)
        self._admit_backlog, self._stream_backlog = admit, tokens

    def stream_admit(self, arrival: float, work: float) -> float:
        """One request's API work before the engine (``work`` seconds) on the one API-server process
        (SimOptions.api_server_serial): requests are admitted in turn, and share the server with the tokens it
        streams. Returns when the request reaches the engine core. A request arriving during a step already
        simulated competes with the tokens before that step's, which the server gets at the step's end."""
        if arrival >= self._stream_clock:
            self._stream_advance(arrival)
            tokens = self._stream_backlog
        else:
            tokens = max(0.0, self._stream_backlog - self._stream_last_work)
        self._admit_backlog += work
        admit = self._admit_backlog
        return arrival + admit + min(admit, tokens)

    def stream_release(self, when: float, work: float) -> None:
        """A finished request's API work after its last token (``work`` seconds: the response's end, the request's
        teardown) on the one API-server process (SimOptions.api_server_serial): load on the server like an
        admission's, which the requests it admits next and the engine's steps beside it share."""
        self._stream_advance(when)
        self._admit_backlog += work

    # ------------------------------------------------------------------ runs of decode steps
    def _run_length(self, start: float, until: float | None) -> int:
        """How many decode-only steps can follow from ``start`` before an event changes the batch."""
        n = self._agg_n
        tick = self._tick
        heap = self._finish_heap
        while heap and (not heap[0][2].agg or heap[0][2].finish_tick != heap[0][0] or heap[0][2].state != RUNNING):
            heapq.heappop(heap)
        if not heap:
            return 0
        steps = heap[0][0] - tick  # the finishing step is the run's last
        # KV blocks: members need one block each per block_size steps, at their residue.
        free = self.pool.num_free
        size = self.block_size
        cycles = free // n
        if cycles * size < steps:
            remaining = free - cycles * n
            used = 0
            extra = 0
            bucket = self._bucket
            while extra < size:
                need = bucket[(tick + extra) % size]
                if used + need > remaining:
                    break
                used += need
                extra += 1
            steps = min(steps, cycles * size + extra)
        if steps <= 0:
            return 0
        if until is not None:
            context = self._agg_offset + n * tick
            steps = self.cost.decode_steps_before(n, context, until - start, steps)
        return steps

    def _run(self, start: float, steps: int, collect: bool) -> StepOutput:
        """``steps`` decode-only steps of the unchanged aggregate, summed in closed form."""
        n = self._agg_n
        tick = self._tick
        size = self.block_size
        context = self._agg_offset + n * tick
        blocks = (steps // size) * n
        bucket = self._bucket
        for extra in range(steps % size):
            blocks += bucket[(tick + extra) % size]
        self.pool.take(blocks)
        duration = self.cost.decode_run_time(n, context, steps)
        if self._streaming:
            self._stream(start, start + duration, n * steps, n, steps)
        if self.options.record_itl:
            step_time = self.cost.decode_step_time
            samples = self.itl_samples
            for index in range(steps):
                samples.append((step_time(n, context + index * n), n))
        end = start + duration
        out = StepOutput(start_time=start, duration=duration, end_time=end, num_scheduled_tokens=n * steps,
                         num_steps=steps)
        if collect:
            for seq in self._running.values():
                out.new_tokens[seq.req.request_id] = steps
        self._tick = tick + steps
        self.generation_tokens_total += n * steps
        self.num_steps_total += steps
        self.busy_seconds_total += duration
        self._last_step_end = end
        self._pop_finished(end, out)
        return out

    # ------------------------------------------------------------------ introspection for tests and metrics
    def sync_all(self) -> None:
        """Bring every running request's ``num_generated`` up to date (the aggregate keeps them lazily)."""
        for seq in self._running.values():
            if seq.agg:
                self._sync(seq)

    def running_requests(self) -> list[SimRequest]:
        """Running requests in vLLM's running-list order."""
        return [seq.req for seq in self._running.values()]

    def waiting_requests(self) -> list[SimRequest]:
        """Waiting requests in the order they would be scheduled."""
        if self._priority:
            entries = sorted(entry for entry in self._waiting_heap if entry[3].state == WAITING)
            return [entry[3].req for entry in entries]
        return [seq.req for seq in self._waiting_fcfs if seq.state == WAITING]

    def blocks_in_use(self) -> int:
        return self.pool.num_usable - self.pool.num_free

    def running_block_demand(self) -> int:
        """Blocks the running requests would take from the free queue if the next step gave each its full ask."""
        self.sync_all()
        demand = 0
        for seq in self._running.values():
            num_new = self._running_ask(seq, self.max_num_batched_tokens)
            if num_new > 0:
                demand += self.pool.blocks_needed(seq.blocks, self._slots(seq, num_new))
        return demand
