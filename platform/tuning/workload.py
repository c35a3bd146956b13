"""The workload a tuning study scores configs on: arrivals, joint prompt/output lengths, prefix sharing.

A ``Workload`` is plain data kept on the study (so a trial on any worker rebuilds the same
requests without reading ClickHouse) and shown to the user:

- ``rate`` (mean requests/s over the window) and ``peak_rate`` (the busiest minute's rate);
- ``burstiness``: vLLM's ``--burstiness``, the shape of gamma-distributed gaps between arrivals
  (1 = Poisson; below 1 burstier), estimated as 1/CV² of the observed gaps;
- ``samples``: (prompt tokens, output tokens) pairs drawn from the rows, so lengths keep their
  joint distribution, with each pair's prompt bucket; ``buckets`` summarises them;
- ``prefix_hit_rate``: the share of prompt tokens the prefix cache served, and ``prefix_hit_basis``
  where it comes from: measured on the window's requests that report cached prompt tokens (cached
  ÷ prompt tokens over them), else the group's replicas' ``vllm:prefix_cache_hits``/``queries``
  counters when they answer, else 0 assumed (a synthetic workload's is its own assumption).

A traffic workload is built from engine-served requests only: a request the gateway answered from
its response cache never reached the engine, so it is neither an arrival nor a length sample.

``requests(rate, count, seed)`` draws the simulated requests: gaps scaled to ``rate`` (the
same seed gives the same requests at every rate, so a goodput search compares rates on
common random numbers), pairs drawn with replacement, and a shared prefix of
``prefix_hit_rate`` × prompt tokens from a few system prompts.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

from fleet import replica_metrics
from traces.decomposition import prompt_bucket

from engine.loadgen.workload import LogNormalLength
from engine.loadgen.workload import Workload as ShareGPT
from engine.sim.request import SimRequest

from . import queries

SAMPLE_LIMIT = 2000  # (prompt, output) pairs kept on a study
SYNTHETIC = ("chat", "rag", "code")
PREFIX_POOLS = 4  # distinct shared prefixes (system prompts, repository contexts)


class WorkloadError(ValueError):
    """A workload that cannot be built; the message says why and what to do instead."""


@dataclasses.dataclass
class Workload:
    source: str  # traffic | dataset:NAME | synthetic:KIND
    rate: float
    peak_rate: float
    burstiness: float
    samples: list[tuple[int, int]]
    sample_buckets: list[str]
    prefix_hit_rate: float = 0.0
    window: dict[str, Any] | None = None  # traffic: since, until, requests
    notes: list[str] = dataclasses.field(default_factory=list)
    prefix_hit_basis: str = ""  # "measured on 1,204 requests", "assumed; no request reported cached tokens", ...

    # ------------------------------------------------------------------ serialisation
    def to_dict(self, *, with_samples: bool = True) -> dict[str, Any]:
        data = {
            "source": self.source, "rate": round(self.rate, 4), "peak_rate": round(self.peak_rate, 4),
            "burstiness": round(self.burstiness, 4), "prefix_hit_rate": round(self.prefix_hit_rate, 4),
            "prefix_hit_basis": self.prefix_hit_basis, "window": self.window, "notes": list(self.notes), "buckets": self.buckets(),
            "prompt_tokens": _quantiles([p for p, _ in self.samples]),
            "output_tokens": _quantiles([o for _, o in self.samples]),
            "sample_count": len(self.samples),
        }
        if with_samples:
            data["samples"] = [[p, o] for p, o in self.samples]
            data["sample_buckets"] = list(self.sample_buckets)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        samples = [(int(p), int(o)) for p, o in data["samples"]]
        return cls(source=data["source"], rate=float(data["rate"]), peak_rate=float(data["peak_rate"]),
                   burstiness=float(data["burstiness"]), samples=samples,
                   sample_buckets=list(data.get("sample_buckets") or [""] * len(samples)),
                   prefix_hit_rate=float(data.get("prefix_hit_rate") or 0.0), window=data.get("window"),
                   notes=list(data.get("notes") or []), prefix_hit_basis=str(data.get("prefix_hit_basis") or ""))

    def buckets(self) -> list[dict[str, Any]]:
        groups: dict[str, list[tuple[int, int]]] = {}
        for bucket, pair in zip(self.sample_buckets, self.samples):
            groups.setdefault(bucket or "all", []).append(pair)
        total = len(self.samples) or 1
        return [{"bucket": name, "share": round(len(pairs) / total, 4),
                 "prompt_tokens": _quantiles([p for p, _ in pairs]),
                 "output_tokens": _quantiles([o for _, o in pairs])}
                for name, pairs in sorted(groups.items(), key=lambda kv: -len(kv[1]))]

    # ------------------------------------------------------------------ simulated requests
    def requests(self, rate: float, count: int, seed: int = 0, max_len: int | None = None) -> list[SimRequest]:
        """``count`` requests arriving at ``rate``/s (gamma gaps of shape ``burstiness``), seeded."""
        if not self.samples:
            raise WorkloadError("the workload has no requests")
        rng = random.Random(seed)
        shape = self.burstiness
        offsets, now = [], 0.0
        for _ in range(count):
            now += rng.gammavariate(shape, 1.0 / shape)  # mean 1: scaled to the rate below
            offsets.append(now)
        base = offsets[0]
        out: list[SimRequest] = []
        hit = self.prefix_hit_rate
        for index in range(count):
            prompt, output = self.samples[rng.randrange(len(self.samples))]
            if max_len is not None and prompt + output > max_len:
                prompt = max(1, min(prompt, max_len - output))
                output = max(1, min(output, max_len - prompt))
            token_ids = None
            if hit > 0:
                shared = int(prompt * hit)
                pool = rng.randrange(PREFIX_POOLS)
                unique_base = (index + 1) * 1_000_003 + seed * 7_919
                token_ids = [pool * 100_000 + j for j in range(shared)] + \
                            [unique_base + j for j in range(prompt - shared)]
            out.append(SimRequest(f"req-{index}", prompt, max(1, output), (offsets[index] - base) / rate,
                                  prompt_token_ids=token_ids))
        return out


# ---------------------------------------------------------------------------------------------- builders
def synthetic(kind: str, seed: int = 0) -> Workload:
    """Three reference workloads: ShareGPT-like chat, long-prompt RAG, code completion with shared prefixes."""
    rng = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    if kind == "chat":
        lengths = ShareGPT(seed=seed)
        pairs = [lengths.lengths(i) for i in range(SAMPLE_LIMIT)]
        rate, burst, hit, note = 10.0, 1.0, 0.05, "ShareGPT-like chat: vLLM's ShareGPT length model"
    elif kind == "rag":
        for _ in range(SAMPLE_LIMIT):
            prompt = _lognormal(rng, 3000, 0.45, 800, 12000)
            pairs.append((prompt, _lognormal(rng, 200, 0.6, 16, 1024)))
        rate, burst, hit, note = 4.0, 1.0, 0.15, "long-prompt RAG: ~3k-token retrieved context, ~200-token answers"
    elif kind == "code":
        for _ in range(SAMPLE_LIMIT):
            prompt = _lognormal(rng, 1500, 0.5, 256, 6000)
            pairs.append((prompt, _lognormal(rng, 48, 0.7, 4, 512)))
        rate, burst, hit, note = 20.0, 0.5, 0.6, ("code completion: ~1.5k-token file context, short completions, "
                                                  "60% of prompt tokens a shared repository prefix, bursty")
    else:
        raise WorkloadError(f"unknown synthetic workload {kind!r}: use one of {', '.join(SYNTHETIC)}")
    return Workload(source=f"synthetic:{kind}", rate=rate, peak_rate=rate * 1.5, burstiness=burst,
                    samples=pairs, sample_buckets=[prompt_bucket(p) for p, _ in pairs], prefix_hit_rate=hit,
                    notes=[note + " (synthetic)"], prefix_hit_basis=f"assumed by the synthetic {kind} workload")


def from_pairs(source: str, pairs: Sequence[tuple[int, int]], rate: float, *, seed: int = 0,
               notes: Sequence[str] = ()) -> Workload:
    """A workload of given (prompt, output) lengths (a dataset's items), Poisson arrivals at ``rate``."""
    if not pairs:
        raise WorkloadError(f"{source} has no items with a prompt and max_tokens")
    rng = random.Random(seed)
    chosen = list(pairs) if len(pairs) <= SAMPLE_LIMIT else rng.sample(list(pairs), SAMPLE_LIMIT)
    return Workload(source=source, rate=rate, peak_rate=rate, burstiness=1.0, samples=chosen,
                    sample_buckets=[prompt_bucket(p) for p, _ in chosen], notes=list(notes),
                    prefix_hit_basis="assumed; a dataset's items carry no cached-token measurements")


def from_traffic(store, project_id: int, *, group: str | None, since, until, seed: int = 0,
                 replica_hit_rate: Callable[[], float | None] | None = None) -> Workload:
    """The project's completed engine-served requests in [since, until) (of ``group`` when it has any rows of its
    own). ``replica_hit_rate`` (the group's replicas' own prefix-cache counters) is asked only when no request
    reports cached prompt tokens."""
    notes: list[str] = []
    # The group's rows when some of them are engine-served, else the whole project's.
    own = False
    if group:
        engine_served, cache_served = queries.served_counts(store, project_id, group=group, since=since, until=until)
        own = engine_served > 0
        if not own:
            notes.append(f"no rows carry replica group {group!r}: the project's whole traffic is used")
    if not own:
        _, cache_served = queries.served_counts(store, project_id, group=None, since=since, until=until)
    scope = group if own else None
    rows = queries.request_rows(store, project_id, group=scope, since=since, until=until)
    if cache_served:
        notes.append(f"{cache_served:,} requests answered from the gateway's response cache left out: they never "
                     "reached the engine")
    if not rows:
        raise WorkloadError(
            f"no requests in the window {since:%Y-%m-%d %H:%M}–{until:%Y-%m-%d %H:%M} UTC"
            + (f" for group {group!r}" if group else "")
            + ": widen the window (window_hours, --window-hours), or score on a dataset (dataset:NAME) or a "
              "synthetic workload (synthetic:chat, synthetic:rag or synthetic:code)")
    times = [float(r[0]) for r in rows]
    complete = [(int(r[1]), int(r[2]), r[3] or "") for r in rows
                if r[4] == "ok" and r[1] is not None and r[2] is not None and r[2] > 0]
    if not complete:
        raise WorkloadError("the window's requests carry no token counts (prompt and completion tokens): score "
                            "on a dataset (--workload dataset:NAME) or a synthetic workload instead")
    span = max(times[-1] - times[0], 1.0)
    rate = len(times) / span
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= a]
    burstiness = 1.0
    if len(gaps) >= 20:
        mean = sum(gaps) / len(gaps)
        var = sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1)
        if mean > 0 and var > 0:
            burstiness = min(max(mean * mean / var, 0.05), 20.0)  # shape = 1 / CV²
    per_minute: dict[int, int] = {}
    for t in times:
        per_minute[int(t // 60)] = per_minute.get(int(t // 60), 0) + 1
    peak = max(per_minute.values()) / 60.0 if span >= 120 else rate
    rng = random.Random(seed)
    chosen = complete if len(complete) <= SAMPLE_LIMIT else rng.sample(complete, SAMPLE_LIMIT)
    hit_rate, basis, reporting = measured_hit_rate(rows, replica_hit_rate)
    return Workload(source="traffic", rate=rate, peak_rate=max(peak, rate), burstiness=burstiness,
                    samples=[(p, o) for p, o, _ in chosen], sample_buckets=[b for _, _, b in chosen],
                    prefix_hit_rate=hit_rate, prefix_hit_basis=basis,
                    window={"since": since.isoformat(), "until": until.isoformat(), "requests": len(rows),
                            "completed_with_tokens": len(complete), "cached_tokens_reported": reporting,
                            "cache_served": cache_served},
                    notes=notes)


def measured_hit_rate(rows: Sequence[tuple], replica_hit_rate: Callable[[], float | None] | None = None
                      ) -> tuple[float, str, int]:
    """(prefix-cache hit rate, where it comes from, how many requests reported cached tokens) of request rows
    (queries.request_rows): cached ÷ prompt tokens over the rows that report cached tokens (a count above the
    prompt counts as the whole prompt); without any, the replicas' counters when given and answering; else 0."""
    prompt = cached = reporting = 0
    for row in rows:
        tokens, hits = row[1], row[5]
        if hits is None or not tokens:
            continue
        reporting += 1
        prompt += tokens
        cached += min(hits, tokens)
    if reporting:
        return cached / prompt, f"measured on {reporting:,} requests", reporting
    measured = replica_hit_rate() if replica_hit_rate is not None else None
    if measured is not None:
        return measured, ("from the replicas' vllm:prefix_cache_hits / prefix_cache_queries counters; no request "
                          "reported cached tokens"), 0
    return 0.0, "assumed; no request reported cached tokens", 0


def prefix_hit_rate_of(urls: Sequence[str], timeout: float = 2.0) -> float | None:
    """The prefix-cache hit rate the group's vLLM replicas measured (fleet.replica_metrics)."""
    return replica_metrics.prefix_hit_rate(list(urls), timeout)


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return LogNormalLength(median, sigma, low, high).sample(rng)


def _quantiles(values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])  # noqa: E731
    return {"mean": round(sum(ordered) / len(ordered), 1), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}
