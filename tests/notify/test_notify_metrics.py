"""Delivery metrics on the platform's /metrics, scraped through Django's test client after real deliveries to local
receivers: deliveries by channel kind and outcome, attempts by outcome, attempt durations, and the backlog read
from the database at scrape time (with two cheap queries)."""
from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from notify import services
from notify.models import Delivery
from notify_receivers import Receiver, Reply, event, make_channel
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def quick_timeouts(local_receivers, settings):
    settings.NOTIFY = {**settings.NOTIFY, "READ_TIMEOUT_SECONDS": 0.5}


def scrape(client) -> dict:
    """GET /metrics → {(sample name, frozenset of labels): value}."""
    response = client.get("/metrics")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain")
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(response.content.decode())
            for sample in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def deltas(before: dict, after: dict, name: str) -> dict:
    """The samples of ``name`` that changed, as {sorted label items: increase}."""
    return {tuple(sorted(labels)): after[(n, labels)] - before.get((n, labels), 0.0)
            for (n, labels) in after if n == name and after[(n, labels)] != before.get((n, labels), 0.0)}


def test_every_series_is_there_before_the_first_delivery(client):
    samples = scrape(client)
    for kind in ("webhook", "alertmanager", "slack", "pagerduty"):
        for outcome in ("succeeded", "failed", "dead", "superseded", "channel_disabled"):
            assert ("observatory_notify_deliveries_total",
                    frozenset({"kind": kind, "outcome": outcome}.items())) in samples
        for outcome in ("success", "transient", "permanent", "timeout"):
            assert ("observatory_notify_delivery_attempts_total",
                    frozenset({"kind": kind, "outcome": outcome}.items())) in samples
        assert ("observatory_notify_delivery_attempt_seconds_count", frozenset({"kind": kind}.items())) in samples
    assert value(samples, "observatory_notify_backlog_deliveries", status="pending") == 0
    assert value(samples, "observatory_notify_backlog_deliveries", status="sending") == 0
    assert ("observatory_notify_backlog_oldest_due_seconds", frozenset()) in samples
    assert ("observatory_notify_pruned_deliveries_total", frozenset()) in samples


@pytest.mark.django_db(transaction=True)  # real commits: deliveries are counted once their result is committed
def test_deliveries_attempts_and_durations_after_real_deliveries(client, project):
    with Receiver([Reply(500)], default=Reply(200)) as flaky, Receiver(default=Reply(404)) as wrong, \
            Receiver(default=Reply(200, delay=1.5)) as slow, Receiver() as chat:
        make_channel(project, flaky.url, name="flaky", matchers=[{"name": "to", "op": "=", "value": "flaky"}])
        make_channel(project, wrong.url, name="wrong", kind="alertmanager",
                     matchers=[{"name": "to", "op": "=", "value": "wrong"}])
        make_channel(project, slow.url, name="slow", matchers=[{"name": "to", "op": "=", "value": "slow"}])
        slack = make_channel(project, chat.url, name="chat", kind="slack",
                             matchers=[{"name": "to", "op": "=", "value": "chat"}])
        for to in ("flaky", "wrong", "slow", "chat"):
            services.enqueue(project.id, event(to=to), severity="page")
        before = scrape(client)
        now = timezone.now()
        assert services.deliver_due(now=now) == 4  # flaky: 500; wrong: 404; slow: timed out; chat: 200
        middle = scrape(client)
        assert services.deliver_due(now=now + dt.timedelta(hours=1)) == 2  # flaky and slow again: 200, timeout
        services.send_test(slack)  # test sends are not counted
        after = scrape(client)

    assert deltas(before, middle, "observatory_notify_delivery_attempts_total") == {
        (("kind", "webhook"), ("outcome", "transient")): 1,
        (("kind", "alertmanager"), ("outcome", "permanent")): 1,
        (("kind", "webhook"), ("outcome", "timeout")): 1,
        (("kind", "slack"), ("outcome", "success")): 1,
    }
    assert deltas(middle, after, "observatory_notify_delivery_attempts_total") == {  # the retries; not the test
        (("kind", "webhook"), ("outcome", "success")): 1, (("kind", "webhook"), ("outcome", "timeout")): 1}
    # ended deliveries: the flaky one succeeded on its retry, the slow one is still pending
    assert deltas(before, after, "observatory_notify_deliveries_total") == {
        (("kind", "webhook"), ("outcome", "succeeded")): 1,
        (("kind", "alertmanager"), ("outcome", "failed")): 1,
        (("kind", "slack"), ("outcome", "succeeded")): 1,
    }
    durations = deltas(before, after, "observatory_notify_delivery_attempt_seconds_count")
    assert durations == {(("kind", "webhook"),): 4, (("kind", "alertmanager"),): 1, (("kind", "slack"),): 1}
    webhook_seconds = deltas(before, after, "observatory_notify_delivery_attempt_seconds_sum")[(("kind", "webhook"),)]
    assert 1.0 <= webhook_seconds < 10  # two timeouts at the 0.5 s read timeout, two quick answers
    slow_bucket = deltas(before, after, "observatory_notify_delivery_attempt_seconds_bucket")
    # The quick ones lie under the 0.5 s read timeout (even on a loaded machine: a local 200), the timeouts over it.
    assert slow_bucket[(("kind", "webhook"), ("le", "0.5"))] == 2
    assert slow_bucket[(("kind", "webhook"), ("le", "2.5"))] == 4
    assert value(after, "observatory_notify_backlog_deliveries", status="pending") == 1  # the slow one


def test_superseded_and_disabled_deliveries_count_once_committed(client, project,
                                                                 django_capture_on_commit_callbacks):
    am = make_channel(project, "https://am.example/hook", name="am", kind="alertmanager")
    before = scrape(client)
    with django_capture_on_commit_callbacks(execute=True):
        services.enqueue(project.id, event(fingerprint="fp-a"), severity="page")
        services.enqueue(project.id, event(fingerprint="fp-a", status="resolved"), severity="page")
        services.enqueue(project.id, event(fingerprint="fp-b"), severity="page")
    with django_capture_on_commit_callbacks(execute=True):
        services.disable_channel(am, "disabled by carol")
    with django_capture_on_commit_callbacks(execute=False) as uncommitted:  # a transaction that never commits
        make_channel(project, "https://am.example/other", name="other", kind="pagerduty")
        services.enqueue(project.id, event(fingerprint="fp-c"), severity="page")
        services.enqueue(project.id, event(fingerprint="fp-c", status="resolved"), severity="page")
    # the counting of fp-c's superseded delivery waits for the commit (beside the delivery rounds enqueue asks for)
    assert len([c for c in uncommitted if c is not services.deliver_soon]) == 1
    after = scrape(client)
    assert deltas(before, after, "observatory_notify_deliveries_total") == {
        (("kind", "alertmanager"), ("outcome", "superseded")): 1,  # fp-a firing, replaced by its resolution
        (("kind", "alertmanager"), ("outcome", "channel_disabled")): 2,  # fp-a resolved and fp-b
    }
    assert set(Delivery.objects.filter(channel=am).values_list("status", flat=True)) == {"dead"}


def test_the_backlog_is_read_from_the_database_at_scrape_time_cheaply(client, project):
    with Receiver() as receiver:
        make_channel(project, receiver.url)
        ids = [services.enqueue(project.id, event(), severity="page")[0] for _ in range(3)]
        now = timezone.now()
        Delivery.objects.filter(id=ids[0]).update(next_attempt_at=now - dt.timedelta(seconds=120))
        Delivery.objects.filter(id=ids[1]).update(next_attempt_at=now + dt.timedelta(hours=1))  # a retry, not due
        Delivery.objects.filter(id=ids[2]).update(status="sending", lease_expires_at=now + dt.timedelta(minutes=2))
        with CaptureQueriesContext(connection) as queries:
            samples = scrape(client)
        assert value(samples, "observatory_notify_backlog_deliveries", status="pending") == 2
        assert value(samples, "observatory_notify_backlog_deliveries", status="sending") == 1
        assert 120 <= value(samples, "observatory_notify_backlog_oldest_due_seconds") < 180
        backlog_queries = [q["sql"] for q in queries.captured_queries if "notify_delivery" in q["sql"]]
        assert len(backlog_queries) == 2 and not any("JOIN" in sql for sql in backlog_queries), backlog_queries

        Delivery.objects.filter(id=ids[2]).update(status="pending", next_attempt_at=now)
        services.deliver_due(now=now)  # the two due ones go out
    samples = scrape(client)
    assert value(samples, "observatory_notify_backlog_deliveries", status="pending") == 1
    assert value(samples, "observatory_notify_backlog_deliveries", status="sending") == 0
    assert value(samples, "observatory_notify_backlog_oldest_due_seconds") == 0
