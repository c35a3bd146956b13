"""The run summary, with vLLM's metric names and definitions (``vllm/benchmarks/serve.py``, ``calculate_metrics``).

* Throughputs divide by the benchmark duration (first send to last completion).
  ``request_throughput`` counts successful requests; ``output_throughput`` their
  completion tokens; ``total_token_throughput`` adds their prompt tokens.
* Latency statistics are over successful requests: TTFT and E2EL one value each, TPOT
  one value per request with more than one output token, ITL every gap of every
  request pooled together. Mean, median, population standard deviation (numpy's
  default, as vLLM) and percentiles by linear interpolation (numpy's default), in ms.
* Goodput (``--goodput ttft:MS tpot:MS e2el:MS``): successful requests whose every
  given metric is <= its SLO, per second of duration. As in vLLM, a request with a
  single output token has TPOT 0 for this test; a metric that was not measured
  (TTFT without streaming) fails its SLO.
A metric with no values has None everywhere (written as null), never 0.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from engine.loadgen.client import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) by linear interpolation between closest ranks, as ``numpy.percentile``."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = (len(sorted_values) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = rank - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def _percentile_key(p: float) -> str:
    """vLLM's key for a percentile: 99 → "p99", 99.9 → "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


@dataclasses.dataclass(frozen=True)
class MetricStats:
    """Mean, median, standard deviation and percentiles of one latency metric, in milliseconds."""

    count: int
    mean: float | None
    median: float | None
    std: float | None
    percentiles: dict[str, float | None]  # "p90" → ms

    @classmethod
    def of(cls, values: Iterable[float], percentiles: Sequence[float]) -> MetricStats:
        data = sorted(values)
        if not data:
            return cls(0, None, None, None, {_percentile_key(p): None for p in percentiles})
        mean = math.fsum(data) / len(data)
        variance = math.fsum((v - mean) ** 2 for v in data) / len(data)
        return cls(
            count=len(data),
            mean=mean,
            median=percentile(data, 50.0),
            std=math.sqrt(variance),
            percentiles={_percentile_key(p): percentile(data, p) for p in percentiles},
        )


@dataclasses.dataclass(frozen=True)
class Summary:
    """What vLLM's serving benchmark prints, plus failures and the peak concurrency seen."""

    completed: int
    failed: int
    duration: float  # seconds
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    request_goodput: float | None  # req/s; None when no SLO was given
    output_throughput: float  # tok/s
    total_token_throughput: float  # tok/s
    max_concurrent_requests: int
    goodput_slos: dict[str, float]
    stats: dict[str, MetricStats]  # "ttft" | "tpot" | "itl" | "e2el"
    errors: dict[str, int]  # error.type → count

    def to_dict(self) -> dict[str, Any]:
        """vLLM's result keys: ``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``, ``p99_ttft_ms`` …"""
        out: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_concurrent_requests": self.max_concurrent_requests,
            "goodput_slos": dict(self.goodput_slos),
            "errors": dict(self.errors),
        }
        for metric in METRICS:
            stats = self.stats[metric]
            out[f"mean_{metric}_ms"] = stats.mean
            out[f"median_{metric}_ms"] = stats.median
            out[f"std_{metric}_ms"] = stats.std
            for key, value in stats.percentiles.items():
                out[f"{key}_{metric}_ms"] = value
            out[f"count_{metric}"] = stats.count
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Summary:
        stats = {}
        for metric in METRICS:
            suffix = f"_{metric}_ms"
            percentiles = {
                key[: -len(suffix)]: value
                for key, value in data.items()
                if key.startswith("p") and key.endswith(suffix)
            }
            stats[metric] = MetricStats(
                count=int(data.get(f"count_{metric}", 0)),
                mean=data.get(f"mean{suffix}"),
                median=data.get(f"median{suffix}"),
                std=data.get(f"std{suffix}"),
                percentiles=percentiles,
            )
        return cls(
            completed=int(data["completed"]),
            failed=int(data["failed"]),
            duration=float(data["duration"]),
            total_input_tokens=int(data["total_input_tokens"]),
            total_output_tokens=int(data["total_output_tokens"]),
            request_throughput=float(data["request_throughput"]),
            request_goodput=data.get("request_goodput"),
            output_throughput=float(data["output_throughput"]),
            total_token_throughput=float(data["total_token_throughput"]),
            max_concurrent_requests=int(data.get("max_concurrent_requests", 0)),
            goodput_slos=dict(data.get("goodput_slos") or {}),
            stats=stats,
            errors=dict(data.get("errors") or {}),
        )


def meets_slos(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """A successful request whose every measured metric named in ``slos`` is within it (vLLM's goodput test)."""
    if not record.success:
        return False
    for metric, limit in slos.items():
        if metric == "ttft":
            value = record.ttft_ms
        elif metric == "tpot":
            # vLLM counts TPOT as 0 for one-token outputs (its all_tpots list).
            value = record.tpot_ms if record.tpot_ms is not None else (
                0.0 if record.ttft_ms is not None and (record.completion_tokens or 0) <= 1 else None
            )
        elif metric == "e2el":
            value = record.e2e_ms
        else:
            raise ValueError(f"unknown goodput metric {metric!r}")
        if value is None or value > limit:
            return False
    return True


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    """The most requests in flight at once (from send and end times)."""
    events = []
    for record in records:
        if record.sent_ms is not None and record.e2e_ms is not None:
            events.append((record.sent_ms, 1))
            events.append((record.sent_ms + record.e2e_ms, -1))
    events.sort(key=lambda event: (event[0], event[1]))  # an end before a start at the same instant
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def summarize(
    records: Sequence[RequestRecord],
    duration: float,
    *,
    goodput: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = (90.0, 99.0),
) -> Summary:
    """The summary of a run that lasted ``duration`` seconds."""
    ok = [r for r in records if r.success]
    failed = len(records) - len(ok)
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.completion_tokens or 0 for r in ok)
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    slos = dict(goodput or {})
    good = sum(1 for r in ok if meets_slos(r, slos)) if slos else None
    errors: dict[str, int] = {}
    for record in records:
        if not record.success:
            key = record.error_type or "_OTHER"
            errors[key] = errors.get(key, 0) + 1
    stats = {
        "ttft": MetricStats.of((r.ttft_ms for r in ok if r.ttft_ms is not None), percentiles),
        "tpot": MetricStats.of((r.tpot_ms for r in ok if r.tpot_ms is not None), percentiles),
        "itl": MetricStats.of((gap for r in ok for gap in r.itl_ms), percentiles),
        "e2el": MetricStats.of((r.e2e_ms for r in ok if r.e2e_ms is not None), percentiles),
    }
    return Summary(
        completed=len(ok),
        failed=failed,
        duration=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=per_second(len(ok)),
        request_goodput=per_second(good) if good is not None else None,
        output_throughput=per_second(output_tokens),
        total_token_throughput=per_second(input_tokens + output_tokens),
        max_concurrent_requests=peak_concurrency(records),
        goodput_slos=slos,
        stats=stats,
        errors=errors,
    )
