"""One evaluation cycle: bring the SLI buckets up to date, count every window of every enabled SLO, decide
each SLO's state, keep it (SLO row + ClickHouse status series) and hand it to the alert lifecycle.

A cycle evaluates the second it runs at: each window is [now − window, now), the current minute's requests
included, so a page tier trips on the first evaluation after enough bad requests arrived rather than after
their minute closed. The status series keeps one point per SLO and minute, the minute's latest evaluation.

Per project: one query for the dirty hours, one INSERT … SELECT per batch of hours to build, one query over
the buckets and one over the raw rows for every SLO and window at once, one insert of status points; with
engine_model_error SLOs, one more query over the engine model checks for all of them and every window.
"""
from __future__ import annotations

import datetime as dt
import logging
import time
from collections import defaultdict
from collections.abc import Callable

from django.conf import settings
from django.db import close_old_connections
from traces.store import ClickHouseStore, StoreUnavailable, get_store

from . import burn, metrics, queries
from .models import SLO

log = logging.getLogger(__name__)
HOURS_PER_BUILD = 24  # hours of raw rows one bucket-building statement reads at most


# What acts on each SLO's evaluation (the alerts app registers its lifecycle when it is installed): the SLO app
# knows nothing of alerts, and an error in one listener neither stops the others nor the cycle.
_listeners: list[Callable] = []


def on_evaluated(listener: Callable) -> None:
    """Call ``listener(slo, evaluation)`` after every evaluation of an SLO (once per listener)."""
    if listener not in _listeners:
        _listeners.append(listener)


def evaluate_all(now: dt.datetime | None = None, *, store: ClickHouseStore | None = None) -> int:
    """Evaluate every enabled SLO of every project at `now` (default: the current time); returns how many.
    Timed and counted on /metrics (slo/metrics.py), with the projects that could not be evaluated."""
    close_old_connections()
    now = now or dt.datetime.now(dt.timezone.utc)
    with metrics.evaluation_cycle() as cycle:
        store = store or get_store()
        by_project: dict[int, list[SLO]] = defaultdict(list)
        for slo in SLO.objects.filter(enabled=True).select_related("project").order_by("project_id", "id"):
            by_project[slo.project_id].append(slo)
        done = 0
        for project_id, slos in by_project.items():
            try:
                done += len(evaluate_project(store, project_id, slos, now))
            except StoreUnavailable as exc:
                cycle.failed("clickhouse_unavailable")
                log.warning("SLO evaluation of project %s skipped: ClickHouse unavailable (%s)", project_id, exc)
            except Exception:
                cycle.failed("error")
                log.exception("SLO evaluation of project %s failed", project_id)
        return done


def evaluate_project(store: ClickHouseStore, project_id: int, slos: list[SLO], now: dt.datetime) -> list[burn.Evaluation]:
    config = settings.SLO
    at = now.astimezone(dt.timezone.utc).replace(microsecond=0)
    minute = queries.floor_time(at, queries.MINUTE)
    definitions = list({d.key: d for d in (queries.SliDefinition.of(s) for s in slos)}.values())
    # Request SLIs are counted from buckets and raw request rows; engine_model_error from the model checks' rows.
    requests = [d for d in definitions if not d.counts_model_checks]
    checks = [d for d in definitions if d.counts_model_checks]
    windows = sorted({w for s in slos for w in burn.windows_of(s.burn_tiers, s.period)})
    longest = max(windows)
    settled = now - dt.timedelta(seconds=config["SETTLE_SECONDS"])
    open_from = queries.floor_time(settled.astimezone(dt.timezone.utc), queries.HOUR)
    since = queries.floor_time(at - longest, queries.HOUR)
    dirty = refresh_buckets(store, project_id, requests, since=since, settled=settled,
                            budget_seconds=config["BUILD_BUDGET_SECONDS"])
    counts = queries.window_counts(store, project_id, requests, windows, at, open_from=open_from,
                                   dirty={(k, h) for k, h, _ in dirty})
    counts.update(queries.model_check_counts(store, project_id, checks, windows, at))
    evaluations = []
    points = []
    for slo in slos:
        per_window = counts.get(slo.sli_key, {})
        evaluation = burn.evaluate(
            slo_id=slo.id, at=at, objective=slo.objective, period=slo.period, tiers=slo.burn_tiers,
            counts={burn.window_label(w): c for w, c in per_window.items()},
            min_requests=slo.min_requests, min_bad=slo.min_bad, no_data=slo.no_data,
            previous_firing=slo.last_firing_tier or None,
            events="checks" if slo.sli == queries.MODEL_ERROR_SLI else "requests",
        )
        evaluations.append(evaluation)
        points.append({
            "slo_id": slo.id, "at": minute, "state": evaluation.state,
            "firing_tier": evaluation.firing.tier.name if evaluation.firing else "",
            "severity": evaluation.firing.tier.severity if evaluation.firing else "",
            "budget_remaining": evaluation.budget_remaining, "burn_rates": evaluation.burn_rates,
            "totals": {label: c.total for label, c in evaluation.counts.items()},
            "bads": {label: c.bad for label, c in evaluation.counts.items()},
        })
    queries.insert_status(store, project_id, points, config["STATUS_RETENTION_DAYS"])
    for slo, evaluation in zip(slos, evaluations):
        record(slo, evaluation)
        for listener in _listeners:
            try:
                listener(slo, evaluation)
            except Exception:
                log.exception("%s failed for SLO %s", getattr(listener, "__qualname__", listener), slo)
    return evaluations


def refresh_buckets(store: ClickHouseStore, project_id: int, definitions: list[queries.SliDefinition], *,
                    since: dt.datetime, settled: dt.datetime, budget_seconds: float) -> list[tuple[int, dt.datetime, int]]:
    """Build the dirty closed hours, newest first, for up to `budget_seconds`; returns those still dirty."""
    dirty = queries.dirty_hours(store, project_id, [d.key for d in definitions], since, settled)
    if not dirty:
        return []
    started = time.monotonic()
    by_hour: dict[dt.datetime, list[tuple[int, dt.datetime, int]]] = defaultdict(list)
    for pair in dirty:
        by_hour[pair[1]].append(pair)
    hours = sorted(by_hour, reverse=True)
    remaining: list[tuple[int, dt.datetime, int]] = []
    for i in range(0, len(hours), HOURS_PER_BUILD):
        batch = hours[i:i + HOURS_PER_BUILD]
        # The first batch always: every cycle makes progress, however small the budget.
        if i and time.monotonic() - started > budget_seconds:
            remaining.extend(p for h in batch for p in by_hour[h])
            continue
        queries.build_buckets(store, project_id, definitions, [p for h in batch for p in by_hour[h]])
    if remaining:
        log.info("SLO buckets of project %s: %d hour(s) left for the next cycle", project_id,
                 len({h for _, h, _ in remaining}))
    return remaining


def record(slo: SLO, evaluation: burn.Evaluation) -> None:
    """Keep the latest evaluation on the SLO row (without touching its definition)."""
    firing = evaluation.firing
    SLO.objects.filter(pk=slo.pk).update(
        last_evaluated_at=evaluation.at,
        last_state=evaluation.state,
        last_firing_tier=firing.tier.name if firing else "",
        last_status=evaluation.as_dict(),
    )
    slo.last_evaluated_at = evaluation.at
    slo.last_state = evaluation.state
    slo.last_firing_tier = firing.tier.name if firing else ""
    slo.last_status = evaluation.as_dict()
