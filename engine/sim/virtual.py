"""Virtual time: run a whole workload through the simulated engine as fast as the CPU allows, no sleeping.

``simulate(config, requests)`` feeds each request to an ``EngineCore`` when it
reaches the engine (its arrival plus the API server's tokenisation time), steps the
engine back to back while it has work, jumps the clock to the next arrival when it
is idle, and lets the core run whole series of identical decode steps at once up
to the next arrival. The summary uses the definitions of vLLM's
``benchmark_serving.py`` (milliseconds): TTFT = first token − arrival, TPOT =
(e2e − TTFT) / (output − 1) for outputs longer than one token, ITL = every gap
between consecutive tokens of a request, E2EL = response complete − arrival; and
the engine-side split of vLLM's ``llm_request`` span (queue, prefill, decode).
Every result is labelled ``simulated``.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.sim.core import EngineCore
from engine.sim.options import SimOptions
from engine.sim.profiles import HardwareProfile, ModelProfile
from engine.sim.request import RequestRejected, SimRequest

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles of one latency, in milliseconds (NaN when there is no sample)."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats:
        if not values:
            nan = math.nan
            return cls(nan, nan, nan, nan, 0)
        ordered = sorted(values)
        return cls(
            mean=sum(ordered) / len(ordered),
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
            count=len(ordered),
        )

    @classmethod
    def of_weighted(cls, samples: Sequence[tuple[float, int]]) -> LatencyStats:
        """Stats of a multiset given as (value, multiplicity) pairs."""
        pairs = sorted((value, weight) for value, weight in samples if weight > 0)
        total = sum(weight for _value, weight in pairs)
        if not total:
            return cls.of(())
        mean = sum(value * weight for value, weight in pairs) / total
        return cls(mean, _weighted_percentile(pairs, total, 50), _weighted_percentile(pairs, total, 90),
                   _weighted_percentile(pairs, total, 99), total)

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99, "count": self.count}


def percentile(ordered: Sequence[float], p: float) -> float:
    """Linear-interpolation percentile of sorted values (numpy's default, which vLLM's benchmark uses)."""
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _weighted_percentile(pairs: Sequence[tuple[float, int]], total: int, p: float) -> float:
    # The same interpolation as ``percentile`` on the expanded multiset, without expanding it.
    rank = (total - 1) * p / 100.0
    low_index = math.floor(rank)
    fraction = rank - low_index
    seen = 0
    low_value = None
    for value, weight in pairs:
        if low_value is None and low_index < seen + weight:
            low_value = value
            if low_index + 1 < seen + weight or fraction == 0:
                return value
        elif low_value is not None:
            return low_value + (value - low_value) * fraction
        seen += weight
    return pairs[-1][0] if low_value is None else low_value


@dataclasses.dataclass(frozen=True)
class SimulationSummary:
    """Aggregate figures of one simulated run (latencies in milliseconds, throughputs per second)."""

    simulated: bool
    config_version: str
    gpu_type: str
    model: str
    num_requests: int
    completed: int
    rejected: int
    duration_s: float  # first arrival to last response
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    mean_queue_ms: float
    mean_prefill_ms: float
    mean_decode_ms: float
    mean_overhead_ms: float
    num_preemptions: int
    mean_kv_cache_usage: float  # time-weighted over busy time
    max_kv_cache_usage: float
    num_gpu_blocks: int
    prefix_cache_hit_rate: float
    spec_acceptance_rate: float | None  # accepted / drafted tokens
    spec_mean_acceptance_length: float | None  # 1 + accepted per draft, as vLLM reports it
    num_steps: int
    busy_fraction: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SimulationResult:
    """Per-request outcomes (engine timestamps filled in) and the run's summary."""

    requests: list[SimRequest]
    rejected: list[tuple[SimRequest, str]]
    summary: SimulationSummary | None  # None when simulate() was asked for no figures
    engine: EngineCore
    engine_calls: int  # step/advance calls; fewer than summary.num_steps when runs of steps were skipped over


def simulate(
    config: EngineConfig,
    requests: Iterable[SimRequest],
    *,
    hardware: HardwareProfile | None = None,
    model: ModelProfile | None = None,
    options: SimOptions | None = None,
    seed: int = 0,
    skip: bool = True,
    stop: Callable[[float], bool] | None = None,
    stop_every: int = 64,
    figures: bool = True,
) -> SimulationResult:
    """Run ``requests`` (each with its ``arrival_time``) through a fresh simulated engine in virtual time.

    ``skip=False`` steps the engine one step at a time (for checking the event skipping). ``stop(now)``, asked
    every ``stop_every`` engine calls, ends the run early when it returns True (the caller knows the outcome
    already); unfinished requests stay unfinished. ``figures=False`` leaves out the run's summary (None) and the
    inter-token samples it needs, for a caller that reads only the requests' own times (a replay): each step of a
    run of decode steps is then not timed one by one.
    """
    options = dataclasses.replace(options or SimOptions(), record_itl=True) if figures else (options or SimOptions())
    engine = EngineCore(config, hardware=hardware, model=model, options=options, seed=seed)
    options = engine.options  # with the hardware profile's API overhead filled in
    # Requests in arrival order; each reaches the engine core after its API work (admit): at once on a GPU host,
    # or in turn on the CPU build's one API-server process, behind the other requests and the tokens it streams.
    arrivals = sorted(enumerate(requests), key=lambda item: (item[1].arrival_time, item[0]))
    serial = options.api_server_serial
    ready: list[tuple[float, int, SimRequest]] = []  # (when the engine core gets it, index, request), a heap
    accepted: list[SimRequest] = []
    rejected: list[tuple[SimRequest, str]] = []
    kv_weighted = 0.0
    kv_max = 0.0
    busy = 0.0
    count = len(arrivals)
    now = arrivals[0][1].arrival_time if arrivals else 0.0
    position = 0
    add, advance, step, admit = engine.add_request, engine.advance, engine.step, engine.stream_admit
    release = engine.stream_release
    calls = 0
    inf = math.inf
    while True:
        while position < count and arrivals[position][1].arrival_time <= now:
            index, request = arrivals[position]
            position += 1
            work = options.api_time_before(request.prompt_tokens)
            enter = admit(request.arrival_time, work) if serial else request.arrival_time + work
            heapq.heappush(ready, (enter, index, request))
        while ready and ready[0][0] <= now:
            enter, _index, request = heapq.heappop(ready)
            try:
                # vLLM's engine core takes new requests from its input queue between steps: a request that
                # reached it during a step is queued (queued_ts) at the step's end, not when it arrived.
                add(request, max(enter, now))
            except RequestRejected as exc:
                rejected.append((request, str(exc)))
                continue
            accepted.append(request)
        following = min(arrivals[position][1].arrival_time if position < count else inf,
                        ready[0][0] if ready else inf)
        if not engine.has_unfinished_requests():
            if following == inf:
                break
            now = max(now, following)
            continue
        until = following if following < inf else None
        out = advance(now, until, collect=False) if skip else step(now)
        calls += 1
        if serial:
            for request in out.finished:  # its API work after the last token, on the same server process
                release(request.finished_time, options.api_time_after(request.num_generated))
        if stop is not None and calls % stop_every == 0 and stop(out.end_time):
            break
        if out.num_scheduled_tokens == 0:
            # Nothing could run (every waiting request blocked): only a new arrival can change that.
            if following == inf:
                raise RuntimeError("the simulated engine is stuck: requests wait but nothing can be scheduled")
            now = max(now, following)
            continue
        usage = engine.kv_cache_usage
        kv_weighted += usage * out.duration
        busy += out.duration
        if usage > kv_max:
            kv_max = usage
        now = out.end_time
    summary = summarize(engine, accepted, rejected, options, busy=busy, kv_weighted=kv_weighted, kv_max=kv_max) \
        if figures else None
    return SimulationResult(requests=accepted, rejected=rejected, summary=summary, engine=engine, engine_calls=calls)


def summarize(engine: EngineCore, requests: Sequence[SimRequest], rejected: Sequence[tuple[SimRequest, str]],
              options: SimOptions, *, busy: float, kv_weighted: float, kv_max: float) -> SimulationSummary:
    """vLLM-benchmark-style figures for finished requests of a run."""
    done = [r for r in requests if r.finish_reason == "length"]
    ttft, tpot, e2el, queue, prefill, decode, overhead = [], [], [], [], [], [], []
    start = min((r.arrival_time for r in requests), default=0.0)
    end = start
    output_tokens = prompt_tokens = 0
    for request in done:
        response_end = options.client_end(request)
        end = max(end, response_end)
        first = options.client_first_token(request) - request.arrival_time
        total = response_end - request.arrival_time
        ttft.append(first * 1e3)
        e2el.append(total * 1e3)
        if request.num_generated > 1:
            tpot.append((total - first) / (request.num_generated - 1) * 1e3)
        queue.append((request.scheduled_time - request.queued_time) * 1e3)
        prefill.append((request.first_token_time - request.scheduled_time) * 1e3)
        decode.append((request.last_token_time - request.first_token_time) * 1e3)
        overhead.append((total - (request.last_token_time - request.queued_time)) * 1e3)
        output_tokens += request.num_generated
        prompt_tokens += request.prompt_tokens
    duration = end - start
    per_second = (lambda value: value / duration) if duration > 0 else (lambda value: 0.0)
    drafted = engine.spec_num_draft_tokens
    config = engine.config
    return SimulationSummary(
        simulated=True,
        config_version=config.version,
        gpu_type=config.gpu_type,
        model=config.model,
        num_requests=len(requests) + len(rejected),
        completed=len(done),
        rejected=len(rejected),
        duration_s=duration,
        request_throughput=per_second(len(done)),
        output_throughput=per_second(output_tokens),
        total_token_throughput=per_second(output_tokens + prompt_tokens),
        ttft_ms=LatencyStats.of(ttft),
        tpot_ms=LatencyStats.of(tpot),
        itl_ms=LatencyStats.of_weighted([(gap * 1e3, weight) for gap, weight in engine.itl_samples]),
        e2el_ms=LatencyStats.of(e2el),
        mean_queue_ms=_mean(queue),
        mean_prefill_ms=_mean(prefill),
        mean_decode_ms=_mean(decode),
        mean_overhead_ms=_mean(overhead),
        num_preemptions=engine.num_preemptions_total,
        mean_kv_cache_usage=kv_weighted / busy if busy > 0 else 0.0,
        max_kv_cache_usage=kv_max,
        num_gpu_blocks=engine.num_blocks_total,
        prefix_cache_hit_rate=(engine.prefix_cache_hits / engine.prefix_cache_queries
                               if engine.prefix_cache_queries else 0.0),
        spec_acceptance_rate=engine.spec_num_accepted_tokens / drafted if drafted else None,
        spec_mean_acceptance_length=(1 + engine.spec_num_accepted_tokens / engine.spec_num_drafts
                                     if engine.spec_num_drafts else None),
        num_steps=engine.num_steps_total,
        busy_fraction=busy / duration if duration > 0 else 0.0,
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan
