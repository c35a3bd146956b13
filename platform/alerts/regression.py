"""Latency regression detector: p50 of e2e (and TTFT) per (service, model) up ≥ 50% on the previous 30 minutes.

Every minute (task `alerts.detect_regressions`), per project and per (service, model): the p50 of each metric
in the current window (ALERTS["REGRESSION_WINDOW_SECONDS"], 5 min) against the baseline window before it
(REGRESSION_BASELINE_SECONDS, 30 min). A pair regresses when both windows hold at least REGRESSION_MIN_REQUESTS
observed values (the traffic guard) and current p50 ≥ REGRESSION_RATIO (1.5) × baseline p50. The baseline is
frozen when an episode begins: while the alert is pending or firing, the current p50 is compared with the p50
that was normal before the regression (otherwise the rolling baseline would absorb the regression within 30
minutes and resolve it while latency is still high). Too little current traffic reads as "not regressing".
Alerts go through alerts.lifecycle like SLO alerts (kind latency_regression, severity REGRESSION_SEVERITY).
"""
from __future__ import annotations

import datetime as dt
import logging

from django.utils import timezone
from tenancy.models import Project
from traces.store import StoreUnavailable, get_store

from . import queries
from .lifecycle import REGRESSION_ALERTNAME, AlertSpec, cfg, drive
from .models import Alert, AlertKind, AlertState

log = logging.getLogger(__name__)


def detect_regressions(now: dt.datetime | None = None, *, store=None, project_ids=None) -> int:
    """Run the detector for every project (or `project_ids`); returns the number of transitions claimed."""
    if not cfg("REGRESSION_ENABLED", True):
        return 0
    now = now or timezone.now()
    store = store or get_store()
    projects = Project.objects.all() if project_ids is None else Project.objects.filter(id__in=project_ids)
    claimed = 0
    for project in projects:
        try:
            claimed += detect_for_project(project, now, store=store)
        except StoreUnavailable as exc:
            log.warning("regression detector: trace store unavailable (%s)", exc)
            return claimed
        except Exception:
            log.exception("regression detector failed for project %s", project.name)
    return claimed


def detect_for_project(project, now: dt.datetime, *, store) -> int:
    window = dt.timedelta(seconds=cfg("REGRESSION_WINDOW_SECONDS", 300))
    baseline_len = dt.timedelta(seconds=cfg("REGRESSION_BASELINE_SECONDS", 1800))
    ratio = float(cfg("REGRESSION_RATIO", 1.5))
    min_requests = int(cfg("REGRESSION_MIN_REQUESTS", 30))
    metrics = tuple(cfg("REGRESSION_METRICS", ("e2e_ms", "ttft_ms")))
    severity = cfg("REGRESSION_SEVERITY", "ticket")
    current = (now - window, now)
    rolling_baseline = (now - window - baseline_len, now - window)
    open_alerts = {
        a.fingerprint: a for a in Alert.objects.filter(
            project_id=project.id, kind=AlertKind.LATENCY_REGRESSION, state__in=(AlertState.PENDING, AlertState.FIRING))
    }
    rows = queries.regression_candidates(store, project.id, current=current, baseline=rolling_baseline,
                                         metrics=metrics)
    claimed = 0
    seen = set()
    for row in rows:
        for metric in metrics:
            figures = row["metrics"][metric]
            spec = regression_spec(project, row["service"], row["model"], metric, severity, figures, now, window,
                                   baseline_len)
            seen.add(spec.fingerprint)
            alert = open_alerts.get(spec.fingerprint)
            baseline_p50, baseline_count = figures["baseline_p50"], figures["baseline_count"]
            if alert is not None and "baseline_p50" in (alert.context or {}):
                baseline_p50, baseline_count = alert.context["baseline_p50"], alert.context["baseline_count"]
            active = (
                figures["current_count"] >= min_requests and baseline_count >= min_requests
                and baseline_p50 is not None and baseline_p50 > 0 and figures["current_p50"] is not None
                and figures["current_p50"] >= ratio * baseline_p50
            )
            spec.values["baseline_p50_used"] = baseline_p50
            spec.values["ratio"] = (figures["current_p50"] / baseline_p50
                                    if figures["current_p50"] is not None and baseline_p50 else None)
            known = {"alert": alert} if alert is not None else {}  # else drive() reads the row (maybe resolved)
            claimed += len(drive(spec, active, now, **known))
    # Open alerts of pairs without any traffic in the last 35 minutes: nothing regresses any more.
    for fp, alert in open_alerts.items():
        if fp in seen:
            continue
        spec = _spec_from_alert(alert)
        claimed += len(drive(spec, False, now, alert=alert))
    return claimed


def regression_spec(project, service: str, model: str, metric: str, severity: str, figures: dict,
                    now: dt.datetime, window: dt.timedelta, baseline_len: dt.timedelta) -> AlertSpec:
    label = {"e2e_ms": "e2e", "ttft_ms": "TTFT"}.get(metric, metric)
    current, base = figures["current_p50"], figures["baseline_p50"]
    change = f"{current:.0f} ms vs {base:.0f} ms" if current is not None and base else "n/a"
    title = f"Latency regression: p50 {label} of {service or '-'} / {model or '-'} up ({change})"
    summary = (f"p50 {label} of service {service or '-'} model {model or '-'} over the last "
               f"{window.total_seconds() / 60:g} min is {change} over the {baseline_len.total_seconds() / 60:g} min "
               f"before (threshold ×{cfg('REGRESSION_RATIO', 1.5):g}).")
    labels = {"alertname": REGRESSION_ALERTNAME, "project": project.name, "severity": severity,
              "service": service, "model": model, "metric": metric}
    context = {
        "kind": "regression", "filters": {k: v for k, v in (("service", service), ("model", model)) if v},
        "sli": metric, "threshold_ms": None, "window_seconds": window.total_seconds(),
        "baseline_seconds": baseline_len.total_seconds(), "baseline_until": (now - window).isoformat(),
        "baseline_p50": base, "baseline_count": figures["baseline_count"],
    }
    return AlertSpec(
        project_id=project.id, project_name=project.name, kind=AlertKind.LATENCY_REGRESSION,
        key=f"{service}\x1f{model}\x1f{metric}", severity=severity, labels=labels,
        annotations={"title": title, "summary": summary, "metric": metric},
        values={"current_p50": current, "baseline_p50": base, "current_count": figures["current_count"],
                "baseline_count": figures["baseline_count"]},
        context=context, title=title, summary=summary,
        reason=f"p50 {label} {change}"[:300],
        resolved_title=f"Resolved: latency regression of {service or '-'} / {model or '-'} ({label})",
        keep_context_keys=("baseline_until", "baseline_p50", "baseline_count"),
    )


def _spec_from_alert(alert: Alert) -> AlertSpec:
    labels = alert.labels or {}
    return AlertSpec(
        project_id=alert.project_id, project_name=labels.get("project", ""), kind=alert.kind,
        key=f"{labels.get('service', '')}\x1f{labels.get('model', '')}\x1f{labels.get('metric', '')}",
        severity=alert.severity, labels=labels, annotations=alert.annotations or {},
        values={"current_count": 0}, context=alert.context or {}, title=(alert.annotations or {}).get("title", ""),
        summary=(alert.annotations or {}).get("summary", ""), reason="no traffic in the current window",
        keep_context_keys=("baseline_until", "baseline_p50", "baseline_count"),
    )
