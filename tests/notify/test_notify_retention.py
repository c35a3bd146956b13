"""Retention of the delivery log against the real database (SQLite, or PostgreSQL with DATABASE_URL): finished
deliveries older than NOTIFY_DELIVERY_RETENTION_DAYS go with their attempts, in bounded batches; pending and
sending ones stay however old they are."""
from __future__ import annotations

import datetime as dt
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from notify import services, tasks
from notify.models import Delivery, DeliveryAttempt
from notify_receivers import Receiver, Reply, event, make_channel

pytestmark = pytest.mark.django_db
DAY = dt.timedelta(days=1)


@pytest.fixture(autouse=True)
def thirty_days(local_receivers, settings):
    settings.NOTIFY = {**settings.NOTIFY, "DELIVERY_RETENTION_DAYS": 30.0}


def age(delivery_id: int, days: float) -> None:
    """Make a delivery's last change ``days`` old (its finish time is what retention measures)."""
    Delivery.objects.filter(id=delivery_id).update(updated_at=timezone.now() - dt.timedelta(days=days))


def test_old_finished_deliveries_go_with_their_attempts_and_unfinished_ones_stay(project):
    with Receiver([Reply(500)], default=Reply(200)) as ok, Receiver(default=Reply(404)) as gone_wrong, \
            Receiver(default=Reply(503)) as down:
        make_channel(project, ok.url, name="ok", matchers=[{"name": "to", "op": "=", "value": "ok"}])
        make_channel(project, gone_wrong.url, name="404", matchers=[{"name": "to", "op": "=", "value": "404"}])
        retrying = make_channel(project, down.url, name="down", matchers=[{"name": "to", "op": "=", "value": "down"}])
        [succeeded] = services.enqueue(project.id, event(to="ok"), severity="page")
        [failed] = services.enqueue(project.id, event(to="404"), severity="page")
        [pending] = services.enqueue(project.id, event(to="down"), severity="page")
        now = timezone.now()
        services.deliver_due(now=now)
        services.deliver_due(now=now + dt.timedelta(hours=1))  # the retry of "ok" succeeds; "down" fails again
        test_send = services.send_test(retrying).id  # a test send: failed (503), never retried
        [superseded] = services.enqueue(project.id, event(to="down", fingerprint="fp-s"), severity="page")
        [resolved] = services.enqueue(project.id, event(to="down", fingerprint="fp-s", status="resolved"),
                                      severity="page")
        [never_due] = services.enqueue(project.id, event(to="down"), severity="page")
    statuses = dict(Delivery.objects.values_list("id", "status"))
    assert statuses[succeeded] == "succeeded" and statuses[failed] == "failed" and statuses[test_send] == "failed"
    assert statuses[pending] == "pending" and statuses[superseded] == "dead" and statuses[never_due] == "pending"
    sending = Delivery.objects.create(channel=retrying, event=event(), event_id="in-flight", status="sending",
                                      attempts=1, lease_expires_at=now + dt.timedelta(minutes=2))
    old = [succeeded, failed, test_send, superseded, pending, never_due, sending.id]
    for delivery_id in old:
        age(delivery_id, 31)
    [recent] = services.enqueue(project.id, event(to="ok"), severity="page")
    Delivery.objects.filter(id=recent).update(status="succeeded", updated_at=timezone.now() - dt.timedelta(days=29))
    attempts_before = DeliveryAttempt.objects.count()
    old_attempts = DeliveryAttempt.objects.filter(delivery_id__in=[succeeded, failed, test_send]).count()
    assert old_attempts == 4  # 500 then 200, 404, the test's 503

    assert services.prune_deliveries() == 4
    assert set(Delivery.objects.values_list("id", flat=True)) == {pending, never_due, sending.id, recent, resolved}
    assert DeliveryAttempt.objects.count() == attempts_before - old_attempts
    assert DeliveryAttempt.objects.filter(delivery_id=pending).count() == 2  # the survivor keeps its log
    assert services.prune_deliveries() == 0  # nothing left to do


def test_batches_are_bounded_and_the_oldest_go_first(project):
    channel = make_channel(project, "https://hooks.example.com/x")
    now = timezone.now()
    ids = []
    for n in range(10):
        delivery = Delivery.objects.create(channel=channel, event=event(), event_id=f"e{n}", status="succeeded",
                                           updated_at=now - dt.timedelta(days=40 - n))
        DeliveryAttempt.objects.create(delivery=delivery, number=1, started_at=now, outcome="succeeded")
        ids.append(delivery.id)
    Delivery.objects.create(channel=channel, event=event(), event_id="waiting", status="pending",
                            updated_at=now - dt.timedelta(days=90), next_attempt_at=now + DAY)

    # max_seconds=0: one batch per run, and the next run carries on where this one stopped
    assert services.prune_deliveries(batch_size=4, max_seconds=0) == 4
    assert sorted(Delivery.objects.filter(status="succeeded").values_list("id", flat=True)) == ids[4:]
    assert services.prune_deliveries(batch_size=4, max_seconds=0) == 4
    assert sorted(Delivery.objects.filter(status="succeeded").values_list("id", flat=True)) == ids[8:]

    # one run with time to spare: one DELETE per batch, each of at most batch_size deliveries
    for n in range(10, 17):
        Delivery.objects.create(channel=channel, event=event(), event_id=f"e{n}", status="dead",
                                updated_at=now - 35 * DAY)
    with CaptureQueriesContext(connection) as queries:
        assert services.prune_deliveries(batch_size=3) == 9  # 2 succeeded, then 7 dead: 3 + 3 + 1
    deletes = [q["sql"] for q in queries.captured_queries
               if q["sql"].startswith('DELETE FROM "notify_delivery"')]
    assert [len(re.search(r"IN \(([^)]*)\)", sql).group(1).split(",")) for sql in deletes] == [2, 3, 3, 1]
    assert list(Delivery.objects.values_list("event_id", flat=True)) == ["waiting"]
    assert not DeliveryAttempt.objects.exists()


def test_retention_comes_from_the_settings_and_zero_keeps_everything(project, settings):
    channel = make_channel(project, "https://hooks.example.com/x")
    now = timezone.now()
    for days in (3, 8, 400):
        Delivery.objects.create(channel=channel, event=event(), event_id=f"d{days}", status="failed",
                                updated_at=now - days * DAY)
    settings.NOTIFY = {**settings.NOTIFY, "DELIVERY_RETENTION_DAYS": 0}
    assert tasks.prune_deliveries_task.run() == 0 and Delivery.objects.count() == 3
    settings.NOTIFY = {**settings.NOTIFY, "DELIVERY_RETENTION_DAYS": 7}
    assert tasks.prune_deliveries_task.run() == 2  # the Celery task the beat sends
    assert list(Delivery.objects.values_list("event_id", flat=True)) == ["d3"]


def test_the_beat_prunes_every_prune_interval(settings):
    from observatory.celery_app import app, beat_schedule, queue_name

    settings.NOTIFY = {**settings.NOTIFY, "PRUNE_INTERVAL_SECONDS": 900.0}
    entry = beat_schedule()["notify-prune-deliveries"]
    assert entry["task"] == "notify.prune_deliveries" and entry["schedule"] == 900.0
    assert entry["options"]["queue"] == queue_name("notify")
    app.loader.import_default_modules()
    assert "notify.prune_deliveries" in app.tasks
