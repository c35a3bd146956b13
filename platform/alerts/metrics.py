"""Prometheus metrics of alerts, on /metrics beside the SLO metrics (slo/metrics.py).

``observatory_alert_transitions_total`` counts the transitions this process claimed (lifecycle.py), once their
transaction commits (a claim rolled back is no transition): the platform's in-process worker, or a standalone
worker's own /metrics. Repeat notifications (firing → firing) are not transitions; notify counts the deliveries.
``observatory_alerts`` is read from the database at scrape time (one grouped count on the alerts' state index),
so every process reports the same number; it names no project or SLO.
"""
from __future__ import annotations

import logging

from django.db import transaction
from django.db.models import Count
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from .models import Alert, AlertKind, AlertState, Severity

log = logging.getLogger(__name__)

KINDS = tuple(AlertKind.values)
SEVERITIES = tuple(Severity.values)
TO_STATES = (AlertState.PENDING.value, AlertState.FIRING.value, AlertState.RESOLVED.value, AlertState.INACTIVE.value)
ACTIVE_STATES = (AlertState.PENDING.value, AlertState.FIRING.value)

TRANSITIONS = Counter(
    "observatory_alert_transitions", "Alert state transitions claimed by this process, by kind, severity and new state",
    ["kind", "severity", "to"])
for _kind in KINDS:
    for _severity in SEVERITIES:
        for _to in TO_STATES:
            TRANSITIONS.labels(_kind, _severity, _to)


def transition_claimed(kind: str, severity: str, to_state: str) -> None:
    """Count a transition when the transaction that wrote it commits (call inside that transaction)."""
    transaction.on_commit(lambda: TRANSITIONS.labels(kind, severity, to_state).inc())


class AlertsCollector:
    """``observatory_alerts{kind, severity, state}``: pending and firing alerts now, every combination present (0
    when none). A database error leaves the family out of this scrape rather than failing /metrics."""

    def describe(self):  # registering must not touch the database (AppConfig.ready)
        return [GaugeMetricFamily("observatory_alerts", "", labels=["kind", "severity", "state"])]

    def collect(self):
        try:
            counts = {(kind, severity, state): n for kind, severity, state, n in
                      Alert.objects.filter(state__in=ACTIVE_STATES).order_by()
                      .values_list("kind", "severity", "state").annotate(n=Count("id"))}
        except Exception:  # no database (not migrated, unreachable): the rest of /metrics still works
            log.warning("alert metrics unavailable", exc_info=True)
            return
        family = GaugeMetricFamily("observatory_alerts", "Alerts pending or firing now, by kind and severity",
                                   labels=["kind", "severity", "state"])
        keys = {(k, s, st) for k in KINDS for s in SEVERITIES for st in ACTIVE_STATES} | set(counts)
        for key in sorted(keys):
            family.add_metric(list(key), counts.get(key, 0))
        yield family
