"""SLO goodput in the simulator: the highest request rate at which enough requests meet every latency SLO.

DistServe's definition (Zhong et al., OSDI 2024): a request is *good* when its TTFT, TPOT
and end-to-end latency are each within their threshold (a threshold not set is not
checked; a request refused or unfinished is bad). Attainment at a rate is the share of
good requests among those after the first 10% (the empty engine at the start flatters);
goodput is the highest rate whose attainment reaches the target share, found by doubling
up from the workload's own rate and bisecting (log scale) to ``precision`` relative
width. The same seed draws the same requests at every rate (arrival gaps scaled), so the
search compares rates on common random numbers. Everything runs in the simulator's
virtual time and is labelled ``simulated``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.config import EngineConfig
from engine.sim.profiles import HardwareProfile
from engine.sim.virtual import percentile, simulate

from .workload import Workload

THRESHOLD_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms")
WARMUP_SHARE = 0.1
MAX_RATE = 10_000.0


@dataclasses.dataclass(frozen=True)
class Slo:
    thresholds: dict[str, float]  # ttft_ms / tpot_ms / e2e_ms → ms
    target: float  # share of requests that must be good, e.g. 0.99
    source: str = ""  # which SLOs they came from

    def to_dict(self) -> dict[str, Any]:
        return {"thresholds": dict(self.thresholds), "target": self.target, "source": self.source}


@dataclasses.dataclass
class Measure:
    """One simulated run of a config at one rate."""

    rate: float
    attainment: float
    completed: int
    ttft_p99: float
    tpot_p99: float
    e2e_p99: float
    mean_queue_ms: float
    mean_prefill_ms: float
    mean_decode_ms: float
    preemptions: int
    mean_kv_usage: float
    max_kv_usage: float
    spec_acceptance: float | None
    prefix_hit_rate: float
    throughput: float
    # Per SLO threshold (ttft_ms / tpot_ms / e2e_ms), over the scored requests: the value at the target share
    # (the 95th percentile for a 95% target, of the requests it applies to: TPOT needs two output tokens; None
    # when too many are refused or unfinished) and the share of the scored requests over the threshold (a refused
    # or unfinished request counts against every threshold).
    at_target: dict[str, float | None] = dataclasses.field(default_factory=dict)
    over: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: _rounded(v) for k, v in dataclasses.asdict(self).items()}


def _rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, float):
        return round(value, 4) if math.isfinite(value) else None
    return value


def measure(config: EngineConfig, workload: Workload, slo: Slo, rate: float, *, count: int = 600,
            seed: int = 0, stop_early: bool = False, hardware: HardwareProfile | None = None) -> Measure:
    """One simulated run at ``rate``. ``stop_early``: end the run as soon as so many requests are certainly bad
    that the target share cannot be reached (only pass/fail is wanted; the figures are then of a partial run).
    ``hardware``: a calibrated profile of the group's GPU (tuning.calibration), used for configs on that GPU; None,
    or a config on another GPU type: the published profile."""
    if hardware is not None and hardware.name != config.gpu_type:
        hardware = None
    model_len = config.resolved().max_model_len
    requests = workload.requests(rate, count, seed=seed, max_len=model_len)
    skip = int(len(requests) * WARMUP_SHARE)
    stop = _hopeless(requests[skip:], slo) if stop_early else None
    result = simulate(config, requests, seed=seed, stop=stop, hardware=hardware)
    options = result.engine.options
    rejected = {id(r) for r, _ in result.rejected}
    good = scored = 0
    ttft, tpot, e2e = [], [], []
    limits = slo.thresholds
    scored_values: dict[str, list[float]] = {metric: [] for metric in limits}
    for index, request in enumerate(requests):
        done = id(request) not in rejected and request.finish_reason == "length" \
            and request.first_token_time is not None
        if done:
            first = (options.client_first_token(request) - request.arrival_time) * 1e3
            total = (options.client_end(request) - request.arrival_time) * 1e3
            per_token = (total - first) / (request.num_generated - 1) if request.num_generated > 1 else None
            ttft.append(first)
            e2e.append(total)
            if per_token is not None:
                tpot.append(per_token)
        if index < skip:
            continue
        scored += 1
        if not done:
            for values in scored_values.values():
                values.append(math.inf)
            continue
        for metric, value in (("ttft_ms", first), ("tpot_ms", per_token), ("e2e_ms", total)):
            if metric in scored_values and value is not None:
                scored_values[metric].append(value)
        ok = first <= limits.get("ttft_ms", math.inf) and total <= limits.get("e2e_ms", math.inf) and (
            per_token is None or per_token <= limits.get("tpot_ms", math.inf))
        good += ok
    s = result.summary
    p99 = lambda values: percentile(sorted(values), 99) if values else math.nan  # noqa: E731
    return Measure(rate=rate, attainment=good / scored if scored else 0.0, completed=s.completed,
                   ttft_p99=p99(ttft), tpot_p99=p99(tpot), e2e_p99=p99(e2e), mean_queue_ms=s.mean_queue_ms,
                   mean_prefill_ms=s.mean_prefill_ms, mean_decode_ms=s.mean_decode_ms,
                   preemptions=s.num_preemptions, mean_kv_usage=s.mean_kv_cache_usage,
                   max_kv_usage=s.max_kv_cache_usage, spec_acceptance=s.spec_acceptance_rate,
                   prefix_hit_rate=s.prefix_cache_hit_rate, throughput=s.request_throughput,
                   at_target={metric: percentile(sorted(values), slo.target * 100) if values else math.nan
                              for metric, values in scored_values.items()},
                   over={metric: sum(v > limits[metric] for v in values) / scored if scored else 0.0
                         for metric, values in scored_values.items()})


def _hopeless(scored: list, slo: Slo):
    """stop(now) for the simulator: True once more of the ``scored`` requests are certainly bad at ``now`` than
    the target allows (waiting for a first token past the TTFT threshold, or unfinished past the e2e one; or
    finished with a latency over a threshold; the response's API time after the last token is left out, so the
    count never overstates)."""
    limits = slo.thresholds
    ttft_s = limits.get("ttft_ms", math.inf) / 1e3
    e2e_s = limits.get("e2e_ms", math.inf) / 1e3
    tpot_s = limits.get("tpot_ms", math.inf) / 1e3
    allowed = len(scored) - math.ceil(slo.target * len(scored) - 1e-9)

    def stop(now: float) -> bool:
        bad = 0
        for request in scored:
            arrival = request.arrival_time
            if arrival > now:
                break
            first = request.first_token_time
            if first is None:
                late = now - arrival > ttft_s or now - arrival > e2e_s
            elif request.finished_time is None:
                late = first - arrival > ttft_s or now - arrival > e2e_s
            else:
                generated = request.num_generated
                late = first - arrival > ttft_s or request.finished_time - arrival > e2e_s or (
                    generated > 1 and (request.finished_time - first) / (generated - 1) > tpot_s)
            if late:
                bad += 1
                if bad > allowed:
                    return True
        return False

    return stop


@dataclasses.dataclass
class Goodput:
    goodput: float  # requests/s; 0 when even a nearly idle engine misses the target
    best_attainment: float  # the highest attainment seen (what the lowest rate reached)
    at: Measure | None  # the measure at the goodput rate
    evaluations: int

    def to_dict(self) -> dict[str, Any]:
        return {"goodput": round(self.goodput, 4), "best_attainment": round(self.best_attainment, 4),
                "at": self.at.to_dict() if self.at else None, "evaluations": self.evaluations}


def goodput(config: EngineConfig, workload: Workload, slo: Slo, *, seed: int = 0, count: int = 600,
            precision: float = 0.02, start: float | None = None, stop_early: bool = True,
            hardware: HardwareProfile | None = None) -> Goodput:
    """The highest rate (req/s) whose attainment ≥ ``slo.target`` (bracket by doubling, then bisect).
    ``stop_early=False`` runs every rate to its end (the same result, slower)."""
    evaluations = 0

    def run(rate: float, early: bool = True) -> Measure:
        nonlocal evaluations
        evaluations += 1
        return measure(config, workload, slo, rate, count=count, seed=seed, stop_early=stop_early and early,
                       hardware=hardware)

    rate = max(start or workload.rate or 1.0, 0.01)
    # Where a failing run's attainment is reported (best_attainment: the first rate, and the rates below it when it
    # fails), it is measured whole; elsewhere only pass/fail counts and a hopeless run stops early.
    first = run(rate, early=False)
    best_attainment = first.attainment
    if first.attainment >= slo.target:
        low, low_m = rate, first
        high = None
        while high is None:
            candidate = low * 2
            if candidate > MAX_RATE:
                return Goodput(low, best_attainment, low_m, evaluations)
            m = run(candidate)
            if m.attainment >= slo.target:
                low, low_m = candidate, m
            else:
                high = candidate
    else:
        high = rate
        low, low_m = None, None
        candidate = rate
        while low is None:
            candidate /= 4
            m = run(candidate, early=False)
            best_attainment = max(best_attainment, m.attainment)
            if m.attainment >= slo.target:
                low, low_m = candidate, m
            elif candidate < rate / 256 or candidate < 0.005:
                # Nearly idle and still missing: no rate meets these SLOs with this config.
                return Goodput(0.0, best_attainment, None, evaluations)
            else:
                high = candidate
    while high / low > 1 + precision:
        middle = math.sqrt(low * high)
        m = run(middle)
        if m.attainment >= slo.target:
            low, low_m = middle, m
        else:
            high = middle
    return Goodput(low, max(best_attainment, low_m.attainment), low_m, evaluations)
