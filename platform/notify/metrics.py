"""Prometheus metrics of webhook delivery, on the platform's /metrics (prometheus_client's default registry, like
the ingest metrics in ingest/metrics.py).

Counters and the histogram count what this process did (the platform's in-process worker, or a standalone
Celery worker); test sends (``POST /api/v1/channels/{id}/test``) are left out. The backlog gauges are read from
the database when /metrics is scraped, with two index-only queries on ``notify_due_idx``, so every process
reports the same backlog.
"""
from __future__ import annotations

import logging

from django.db.models import Count, Min
from django.utils import timezone
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from .models import ChannelKind, Delivery, DeliveryStatus

log = logging.getLogger(__name__)

KINDS = tuple(ChannelKind.values)
# How a delivery ended. All but succeeded and failed are status "dead" in the delivery log.
DELIVERY_OUTCOMES = ("succeeded", "failed", "dead", "superseded", "channel_disabled")
# How one HTTP attempt went: 2xx; retried later (408/409/425/429/5xx/1xx, connection, TLS, DNS errors);
# not retried (other 4xx, a final 3xx, 410, refused by the SSRF rules or the redirect limit); no answer in time.
ATTEMPT_OUTCOMES = ("success", "transient", "permanent", "timeout")

DELIVERIES = Counter(
    "observatory_notify_deliveries", "Alert deliveries that ended, by channel kind and outcome", ["kind", "outcome"])
ATTEMPTS = Counter(
    "observatory_notify_delivery_attempts", "HTTP attempts to deliver an alert, by channel kind and outcome",
    ["kind", "outcome"])
ATTEMPT_SECONDS = Histogram(
    "observatory_notify_delivery_attempt_seconds", "Duration of one delivery attempt (redirects included)", ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60),
)
PRUNED = Counter("observatory_notify_pruned_deliveries", "Finished deliveries deleted by the retention task")

# Every series exists from the start (at 0), so rate() and absent-series alerts work before the first delivery.
for _kind in KINDS:
    ATTEMPT_SECONDS.labels(_kind)
    for _outcome in DELIVERY_OUTCOMES:
        DELIVERIES.labels(_kind, _outcome)
    for _outcome in ATTEMPT_OUTCOMES:
        ATTEMPTS.labels(_kind, _outcome)


def delivery_ended(kind: str, outcome: str, count: int = 1) -> None:
    if count > 0:
        DELIVERIES.labels(kind, outcome).inc(count)


def attempt_made(kind: str, outcome: str, seconds: float) -> None:
    ATTEMPTS.labels(kind, outcome).inc()
    ATTEMPT_SECONDS.labels(kind).observe(max(0.0, seconds))


class BacklogCollector:
    """``observatory_notify_backlog_deliveries{status}``, and how long the most overdue delivery has been due,
    read at scrape time. Both queries are bounded by the ``(status, next_attempt_at)`` index; a database error
    leaves the two families out of this scrape rather than failing /metrics."""

    def describe(self):  # registering must not touch the database (AppConfig.ready)
        yield GaugeMetricFamily("observatory_notify_backlog_deliveries", "", labels=["status"])
        yield GaugeMetricFamily("observatory_notify_backlog_oldest_due_seconds", "")

    def collect(self):
        now = timezone.now()
        try:
            counts = dict(Delivery.objects.filter(status__in=(DeliveryStatus.PENDING, DeliveryStatus.SENDING))
                          .order_by().values_list("status").annotate(n=Count("id")))
            oldest = (Delivery.objects.filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=now)
                      .aggregate(oldest=Min("next_attempt_at"))["oldest"])
        except Exception:  # no database (not migrated, unreachable): the rest of /metrics still works
            log.warning("notify backlog metrics unavailable", exc_info=True)
            return
        backlog = GaugeMetricFamily(
            "observatory_notify_backlog_deliveries",
            "Deliveries not finished yet: pending (waiting for their first attempt or a retry) or sending (claimed)",
            labels=["status"])
        for status in (DeliveryStatus.PENDING, DeliveryStatus.SENDING):
            backlog.add_metric([status.value], counts.get(status, 0))
        yield backlog
        yield GaugeMetricFamily(
            "observatory_notify_backlog_oldest_due_seconds",
            "How long the most overdue pending delivery has been due (0 when none is): the delivery worker's lag",
            value=max(0.0, (now - oldest).total_seconds()) if oldest else 0.0)


_collector: BacklogCollector | None = None


def register_backlog_collector() -> None:
    """Called by NotifyConfig.ready(); registering twice is a no-op."""
    global _collector
    if _collector is None:
        _collector = BacklogCollector()
        REGISTRY.register(_collector)
