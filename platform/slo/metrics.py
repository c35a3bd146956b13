"""Prometheus metrics of SLOs, on the platform's /metrics (prometheus_client's default registry, like
ingest/metrics.py and notify/metrics.py) and on a standalone worker's own /metrics.

Two kinds:

- What this process did, counted where the work happens: evaluation cycles (``evaluation.evaluate_all``), their
  duration and failures, and ``slo.evaluate_all`` ticks skipped (``tasks.py``). They live in the process that runs
  the task: the platform with its in-process worker, else each standalone worker (OBSERVATORY_WORKER_METRICS_BIND).
- Per SLO, read from the metadata database when /metrics is scraped: the latest evaluation that
  ``evaluation.record`` keeps on the SLO row (objective, state, budget remaining, burn rate per window, time of
  the evaluation), with one query for every enabled SLO of every project. Every process that serves /metrics
  reports the same values. /metrics has no token, so these series name projects and SLOs to whoever can reach
  it: ``OBSERVATORY_METRICS_SLO_SERIES=false`` leaves them out (and the query with them).
"""
from __future__ import annotations

import contextlib
import logging
import time

from django.conf import settings
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from .models import SLO

log = logging.getLogger(__name__)

# Why a cycle did not evaluate every project: ClickHouse unreachable, or anything else (logged).
FAILURE_REASONS = ("clickhouse_unavailable", "error")
# Why a slo.evaluate_all tick did nothing: the previous cycle still ran in this process, or ClickHouse is chdb and
# this process is not the platform that owns it.
SKIP_REASONS = ("busy", "not_owner")

EVALUATIONS = Counter("observatory_slo_evaluations", "SLO evaluation cycles run (evaluate_all, every project)")
EVALUATION_FAILURES = Counter(
    "observatory_slo_evaluation_failures",
    "SLO evaluation cycles in which some project could not be evaluated, by reason (once per reason and cycle)",
    ["reason"])
EVALUATION_SECONDS = Histogram(
    "observatory_slo_evaluation_seconds", "Duration of one SLO evaluation cycle (buckets, windows, status, alerts)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120),
)
EVALUATIONS_SKIPPED = Counter(
    "observatory_slo_evaluation_skipped", "slo.evaluate_all ticks that did not run a cycle, by reason", ["reason"])

for _reason in FAILURE_REASONS:
    EVALUATION_FAILURES.labels(_reason)
for _reason in SKIP_REASONS:
    EVALUATIONS_SKIPPED.labels(_reason)


class _Cycle:
    def __init__(self) -> None:
        self.reasons: set[str] = set()

    def failed(self, reason: str) -> None:
        self.reasons.add(reason)


@contextlib.contextmanager
def evaluation_cycle():
    """Times and counts one evaluate_all cycle; ``cycle.failed(reason)`` marks a project that was skipped. An
    exception out of the cycle counts as a failure ("error") and propagates."""
    cycle = _Cycle()
    started = time.perf_counter()
    try:
        yield cycle
    except Exception:
        cycle.failed("error")
        raise
    finally:
        EVALUATION_SECONDS.observe(time.perf_counter() - started)
        EVALUATIONS.inc()
        for reason in cycle.reasons:
            EVALUATION_FAILURES.labels(reason).inc()


def evaluation_skipped(reason: str) -> None:
    EVALUATIONS_SKIPPED.labels(reason).inc()


def slo_series_enabled() -> bool:
    return bool(getattr(settings, "OBSERVATORY_METRICS_SLO_SERIES", True))


# -- per SLO, at scrape time ----------------------------------------------------------------------------------------
SLO_LABELS = ["project", "slo", "sli"]
_FAMILIES = {
    "observatory_slo_objective_ratio": (
        "Share of requests that must be good over the SLO's period (0.99 = 99%)", []),
    "observatory_slo_error_budget_remaining_ratio": (
        "Error budget left over the period at the latest evaluation: 1 untouched, 0 spent, negative overspent "
        "(absent without requests in the period)", []),
    "observatory_slo_burn_rate": (
        "Burn rate per window at the latest evaluation: (bad / total) / (1 - objective); 1 spends exactly the budget "
        "over the period (absent for a window without requests)", ["window"]),
    "observatory_slo_state": (
        "1 for the SLO's state at the latest evaluation (ok, burning, low_traffic, no_data; pending before the first), "
        "with the firing tier and its severity when one fires", ["state", "firing_tier", "severity"]),
    "observatory_slo_last_evaluation_timestamp_seconds": (
        "Unix time of the minute the latest evaluation evaluated (absent before the first)", []),
}


def _family(name: str) -> GaugeMetricFamily:
    documentation, extra = _FAMILIES[name]
    return GaugeMetricFamily(name, documentation, labels=[*SLO_LABELS, *extra])


class SloCollector:
    """The per-SLO gauges of some projects, read at scrape time with one query (the SLO rows joined with their
    project's name; of the stored status only the burn rates, budget and firing severity). A database error
    leaves the families out of this scrape rather than failing /metrics.

    Not on the default registry: these series name projects and SLOs, so /metrics serves them only to an API
    token, for that token's projects (observatory.views.prometheus_metrics)."""

    def __init__(self, project_ids):
        self.project_ids = list(project_ids)

    def describe(self):
        return [_family(name) for name in _FAMILIES]

    def collect(self):
        if not slo_series_enabled() or not self.project_ids:
            return
        try:
            rows = list(
                SLO.objects.filter(enabled=True, project_id__in=self.project_ids).order_by("project__name", "name")
                .values_list(
                    "project__name", "name", "sli", "objective", "last_state", "last_firing_tier", "last_evaluated_at",
                    "last_status__burn_rates", "last_status__budget_remaining", "last_status__firing__severity"))
        except Exception:  # no database (not migrated, unreachable): the rest of /metrics still works
            log.warning("SLO metrics unavailable", exc_info=True)
            return
        families = {name: _family(name) for name in _FAMILIES}
        for project, name, sli, objective, state, tier, evaluated_at, burn_rates, budget, severity in rows:
            labels = [project, name, sli]
            families["observatory_slo_objective_ratio"].add_metric(labels, objective)
            families["observatory_slo_state"].add_metric(
                [*labels, state or "pending", tier or "", severity if isinstance(severity, str) else ""], 1)
            if evaluated_at is None:
                continue
            families["observatory_slo_last_evaluation_timestamp_seconds"].add_metric(labels, evaluated_at.timestamp())
            if isinstance(budget, (int, float)):
                families["observatory_slo_error_budget_remaining_ratio"].add_metric(labels, budget)
            for window, rate in (burn_rates if isinstance(burn_rates, dict) else {}).items():
                if isinstance(rate, (int, float)):
                    families["observatory_slo_burn_rate"].add_metric([*labels, window], rate)
        yield from families.values()


_registered: set[type] = set()


def register_collector(collector_class: type) -> None:
    """Register a scrape-time collector on the default registry once per process (AppConfig.ready)."""
    if collector_class not in _registered:
        _registered.add(collector_class)
        REGISTRY.register(collector_class())
