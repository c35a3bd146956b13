"""Delivery machinery against real HTTP receivers: rows before sending, retries with backoff (driven by a controllable
clock), Retry-After, 410 Gone, permanent vs transient errors, test sends, timeouts, leases, and isolation between
a failing channel and a healthy one."""
from __future__ import annotations

import datetime as dt
import email.utils
import json
import random

import pytest
from django.db import transaction
from django.utils import timezone
from notify import services, signing
from notify.models import Channel, Delivery, DeliveryStatus
from notify_receivers import SECRET, Receiver, Reply, event, make_channel
from tenancy.models import Project

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("local_receivers")]


def run_until_settled(delivery_ids, start, rounds=40):
    """Drive deliver_due with a clock that jumps to the next due attempt each round."""
    now = start
    for _ in range(rounds):
        services.deliver_due(now=now)
        pending = list(Delivery.objects.filter(id__in=delivery_ids, status=DeliveryStatus.PENDING))
        if not pending:
            return now
        now = max(now, min(d.next_attempt_at for d in pending))
    return now


def test_fails_five_times_then_exactly_one_successful_delivery(project):
    with Receiver([Reply(500, body=b"boom")] * 5) as receiver:
        make_channel(project, receiver.url)
        [delivery_id] = services.enqueue(project.id, event(), severity="page")
        row = Delivery.objects.get(id=delivery_id)
        assert row.status == "pending" and row.attempts == 0  # written before any sending
        start = timezone.now()
        delays, now = [], start
        for _ in range(6):
            assert services.deliver_due(now=now) == 1
            row.refresh_from_db()
            if row.status != "pending":
                break
            assert services.deliver_due(now=now + dt.timedelta(seconds=1)) == 0  # not due yet: nothing sent
            delays.append((row.next_attempt_at - now).total_seconds())
            now = row.next_attempt_at
        assert services.deliver_due(now=now + dt.timedelta(days=3)) == 0
    assert row.status == "succeeded" and row.attempts == 6 and row.last_status_code == 200
    assert [a.outcome for a in row.attempt_log.all()] == ["transient"] * 5 + ["succeeded"]
    assert "HTTP 500: boom" in row.attempt_log.first().error
    assert len(receiver.requests) == 6
    # every attempt is the same message: same webhook-id (the idempotency key), same body, valid signature
    assert {r.headers["webhook-id"] for r in receiver.requests} == {row.webhook_id}
    assert len({r.body for r in receiver.requests}) == 1
    for received in receiver.requests:
        assert signing.verify(received.body, received.headers, SECRET)
    # exponential backoff: 30 s doubling, plus at most 25% jitter
    for n, delay in enumerate(delays):
        assert 30 * 2**n <= delay <= 30 * 2**n * 1.25 + 1


def test_an_http_1_0_receiver_that_closes_the_connection_gets_one_delivery(project):
    """http.client forgets its socket once a "Connection: close" answer starts; that must not look like a failure."""
    with Receiver(protocol="HTTP/1.0") as receiver:
        make_channel(project, receiver.url)
        [delivery_id] = services.enqueue(project.id, event(), severity="page")
        assert services.deliver_due() == 1
        assert services.deliver_due(now=timezone.now() + dt.timedelta(days=3)) == 0
    row = Delivery.objects.get(id=delivery_id)
    assert row.status == "succeeded" and row.attempts == 1, row.last_error
    assert len(receiver.requests) == 1


def test_a_failing_receiver_never_duplicates_or_delays_a_healthy_one(project, settings):
    settings.NOTIFY = {**settings.NOTIFY, "READ_TIMEOUT_SECONDS": 1.0}
    with Receiver(default=Reply(503)) as failing, Receiver(default=Reply(200, delay=2.5)) as slow, \
            Receiver() as healthy:
        make_channel(project, failing.url, name="failing")
        make_channel(project, slow.url, name="slow")
        make_channel(project, healthy.url, name="healthy")
        ids = []
        for _ in range(3):
            ids += services.enqueue(project.id, event(), severity="page")
        assert len(ids) == 9
        run_until_settled([d for d in ids if Delivery.objects.get(id=d).channel.name == "healthy"],
                          timezone.now(), rounds=3)
        # more rounds: the failing and slow channels keep retrying
        now = timezone.now()
        for _ in range(3):
            now += dt.timedelta(hours=2)
            services.deliver_due(now=now)
    event_ids = [json.loads(r.body)["event_id"] for r in healthy.requests]
    assert sorted(event_ids) == sorted(set(event_ids)) and len(event_ids) == 3  # each once
    assert len(failing.requests) > 3  # it was retried meanwhile
    # the healthy receiver got its requests while the slow one was still being waited for
    first_slow = min(r.at for r in slow.requests)
    assert max(r.at for r in healthy.requests[:3]) < first_slow + 1.0
    healthy_rows = Delivery.objects.filter(channel__name="healthy")
    assert {d.status for d in healthy_rows} == {"succeeded"} and {d.attempts for d in healthy_rows} == {1}
    slow_row = Delivery.objects.filter(channel__name="slow").first()
    assert slow_row.status == "pending" and "timed out" in slow_row.last_error


def test_retry_after_seconds_and_http_date_are_honoured_and_capped(project, settings):
    settings.NOTIFY = {**settings.NOTIFY, "RETRY_AFTER_MAX_SECONDS": 6 * 3600}
    now = timezone.now()
    in_three_hours = email.utils.format_datetime(dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=3),
                                                 usegmt=True)
    cases = [("7200", 7200), (in_three_hours, 3 * 3600), ("864000", 6 * 3600)]
    for n, (header, expected) in enumerate(cases):
        with Receiver(default=Reply(429, {"Retry-After": header})) as receiver:
            make_channel(project, receiver.url, name=f"limited-{n}")
            [delivery_id] = services.enqueue(project.id, event(), severity="page", now=now)
            services.deliver_due(now=now)
        row = Delivery.objects.get(id=delivery_id)
        assert row.status == "pending" and row.last_status_code == 429
        assert expected - 5 <= (row.next_attempt_at - now).total_seconds() <= expected + 5, header
        Channel.objects.filter(name=f"limited-{n}").update(enabled=False)


def test_410_gone_disables_the_channel_and_ends_its_pending_deliveries(project):
    with Receiver(default=Reply(410)) as receiver:
        channel = make_channel(project, receiver.url)
        now = timezone.now()
        [first] = services.enqueue(project.id, event(), severity="page", now=now)
        [later] = services.enqueue(project.id, event(), severity="page", now=now + dt.timedelta(minutes=5))
        services.deliver_due(now=now)
    channel.refresh_from_db()
    assert not channel.enabled and "410" in channel.disabled_reason
    first_row, later_row = Delivery.objects.get(id=first), Delivery.objects.get(id=later)
    assert first_row.status == "failed" and first_row.attempts == 1 and "410 Gone" in first_row.last_error
    assert later_row.status == "dead" and later_row.attempts == 0 and "channel disabled" in later_row.last_error
    assert services.enqueue(project.id, event(), severity="page") == []  # a disabled channel gets nothing new
    assert services.deliver_due(now=now + dt.timedelta(days=1)) == 0
    assert len(receiver.requests) == 1


@pytest.mark.parametrize("status, outcome", [(400, "failed"), (401, "failed"), (404, "failed"), (422, "failed"),
                                             (408, "pending"), (409, "pending"), (425, "pending"),
                                             (429, "pending"), (500, "pending"), (502, "pending")])
def test_permanent_and_transient_answers(project, status, outcome):
    with Receiver(default=Reply(status)) as receiver:
        make_channel(project, receiver.url)
        [delivery_id] = services.enqueue(project.id, event(), severity="page")
        services.deliver_due()
    row = Delivery.objects.get(id=delivery_id)
    assert row.status == outcome and row.last_status_code == status and row.attempts == 1
    assert (row.next_attempt_at is not None) == (outcome == "pending")


def test_timeouts_are_transient_and_logged(project, settings):
    settings.NOTIFY = {**settings.NOTIFY, "READ_TIMEOUT_SECONDS": 0.3}
    with Receiver(default=Reply(200, delay=2.0)) as receiver:
        make_channel(project, receiver.url)
        [delivery_id] = services.enqueue(project.id, event(), severity="page")
        services.deliver_due()
    row = Delivery.objects.get(id=delivery_id)
    assert row.status == "pending" and row.last_status_code is None and "timed out" in row.last_error
    assert row.last_duration_ms >= 250
    [attempt] = row.attempt_log.all()
    assert attempt.outcome == "transient" and attempt.duration_ms >= 250


def test_test_sends_are_never_retried(project):
    with Receiver([Reply(500)]) as receiver:
        channel = make_channel(project, receiver.url)
        delivery = services.send_test(channel)
        assert delivery.status == "failed" and delivery.is_test and delivery.attempts == 1
        assert services.deliver_due(now=timezone.now() + dt.timedelta(days=2)) == 0
        ok = services.send_test(channel)
    assert ok.status == "succeeded" and ok.last_status_code == 200
    assert len(receiver.requests) == 2
    body = json.loads(receiver.requests[1].body)
    assert body["version"] == "1" and body["kind"] == "test"
    assert signing.verify(receiver.requests[1].body, receiver.requests[1].headers, SECRET)


def test_gives_up_after_max_attempts(project, settings):
    settings.NOTIFY = {**settings.NOTIFY, "MAX_ATTEMPTS": 3}
    with Receiver(default=Reply(503)) as receiver:
        make_channel(project, receiver.url)
        [delivery_id] = services.enqueue(project.id, event(), severity="page")
        run_until_settled([delivery_id], timezone.now())
    row = Delivery.objects.get(id=delivery_id)
    assert row.status == "dead" and row.attempts == 3 and "gave up after 3 attempts" in row.last_error
    assert len(receiver.requests) == 3


def test_default_retry_schedule_spans_at_least_a_day():
    assert services.backoff_seconds(1) == 30 and services.backoff_seconds(2) == 60
    assert services.backoff_seconds(20) == 3600
    assert services.retry_span_seconds() >= 24 * 3600
    rng = random.Random(7)
    assert all(3600 <= services.retry_delay(25, rng=rng) <= 4500 for _ in range(100))


def test_a_crashed_worker_s_delivery_is_reclaimed_after_its_lease(project, settings):
    settings.NOTIFY = {**settings.NOTIFY, "LEASE_SECONDS": 120}
    with Receiver() as receiver:
        make_channel(project, receiver.url)
        [delivery_id] = services.enqueue(project.id, event(), severity="page")
        now = timezone.now()
        crashed_token, claimed = services.claim_due(now, 10)  # claimed, then the worker dies before sending
        assert [d.id for d in claimed] == [delivery_id]
        assert services.deliver_due(now=now + dt.timedelta(seconds=60)) == 0  # lease still valid
        later = now + dt.timedelta(seconds=200)
        assert services.deliver_due(now=later) == 1
    row = Delivery.objects.get(id=delivery_id)
    assert row.status == "succeeded" and row.attempts == 2 and len(receiver.requests) == 1
    # the crashed worker coming back late changes nothing
    late = services.SendResult("transient", 500, "late", 1.0, None, receiver.url, "")
    assert services.record(claimed[0], claimed[0].channel, late, crashed_token, now) == "sending"
    row.refresh_from_db()
    assert row.status == "succeeded"


def test_one_channel_s_backlog_is_claimed_a_few_at_a_time(project, settings):
    settings.NOTIFY = {**settings.NOTIFY, "PER_CHANNEL_BATCH": 4}
    with Receiver() as busy, Receiver() as other:
        make_channel(project, busy.url, name="busy", matchers=[{"name": "team", "op": "=", "value": "busy"}])
        make_channel(project, other.url, name="other", matchers=[{"name": "team", "op": "=", "value": "other"}])
        for _ in range(10):
            services.enqueue(project.id, event(team="busy"), severity="page")
        services.enqueue(project.id, event(team="other"), severity="page")
        assert services.deliver_due() == 5  # 4 of the backlog, and the other channel is not left waiting
        assert len(other.requests) == 1
        while services.deliver_due():
            pass
    assert len(busy.requests) == 10


# -- enqueue --------------------------------------------------------------------------------------------------
def test_enqueue_is_part_of_the_caller_s_transaction(project):
    make_channel(project, "http://127.0.0.1:9/hook")
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            assert len(services.enqueue(project.id, event(), severity="page")) == 1
            raise RuntimeError("the alert transition failed")
    assert Delivery.objects.count() == 0


def test_enqueue_twice_creates_one_delivery(project):
    make_channel(project, "http://127.0.0.1:9/hook")
    same = event()
    first = services.enqueue(project.id, same, severity="page")
    assert services.enqueue(project.id, same, severity="page") == first
    assert Delivery.objects.count() == 1


def test_enqueue_routes_by_severity_matchers_resolved_and_project(project):
    other_project = Project.objects.create(name="beta")
    pages = make_channel(project, "http://127.0.0.1:9/a", name="pages", severities=["page"])
    chat = make_channel(project, "http://127.0.0.1:9/b", name="chat", send_resolved=False, matchers=[
        {"name": "service", "op": "=~", "value": "chat-.*"}, {"name": "model", "op": "!=", "value": "tiny"}])
    not_llama = make_channel(project, "http://127.0.0.1:9/c", name="not-llama",
                             matchers=[{"name": "model", "op": "!~", "value": "llama.*"}])
    make_channel(project, "http://127.0.0.1:9/d", name="off", enabled=False)
    make_channel(other_project, "http://127.0.0.1:9/e", name="theirs")

    def targets(ev, severity):
        ids = services.enqueue(project.id, ev, severity=severity)
        return {d.channel.name for d in Delivery.objects.filter(id__in=ids)}

    assert targets(event(service="chat-eu", model="llama-3"), "page") == {pages.name, chat.name}
    assert targets(event(service="chat-eu", model="tiny"), "ticket") == {not_llama.name}
    assert targets(event(service="search", model="mistral"), "ticket") == {not_llama.name}
    assert targets(event("resolved", service="chat-eu", model="qwen"), "page") == {pages.name, not_llama.name}
    assert not Delivery.objects.filter(channel__project=other_project).exists()


def test_a_newer_event_supersedes_a_pending_older_one_of_the_same_alert(project):
    make_channel(project, "http://127.0.0.1:9/hook")
    [fired] = services.enqueue(project.id, event(fingerprint="alert-1"), severity="page")
    [resolved] = services.enqueue(project.id, event("resolved", fingerprint="alert-1"), severity="page")
    old = Delivery.objects.get(id=fired)
    assert old.status == "dead" and "superseded by event" in old.last_error
    assert Delivery.objects.get(id=resolved).status == "pending"


@pytest.mark.parametrize("bad, message", [({"fingerprint": "f", "status": "firing"}, "event_id"),
                                          ({"event_id": "e", "fingerprint": "f", "status": "open"}, "status"),
                                          ({"event_id": "e", "status": "firing"}, "fingerprint")])
def test_enqueue_rejects_malformed_events(project, bad, message):
    with pytest.raises(ValueError, match=message):
        services.enqueue(project.id, bad, severity="page")


def test_rotation_signs_with_every_secret(project):
    new_secret = signing.generate_secret()
    with Receiver() as receiver:
        make_channel(project, receiver.url, secrets=[SECRET, new_secret])
        services.enqueue(project.id, event(), severity="page")
        services.deliver_due()
    [received] = receiver.requests
    assert received.headers["webhook-signature"].count("v1,") == 2
    assert signing.verify(received.body, received.headers, SECRET)
    assert signing.verify(received.body, received.headers, new_secret)
    assert received.headers["content-type"] == "application/json"


def test_a_new_event_is_sent_once_its_transaction_commits_not_at_the_next_beat(project, monkeypatch,
                                                                                django_capture_on_commit_callbacks):
    """enqueue asks a worker for a delivery round on commit (here the worker is Celery's eager mode): the receiver
    has the event when the transaction that created it ends, without a beat's deliver_due; a rolled-back one is
    neither kept nor sent."""
    from celery import current_app

    monkeypatch.setitem(current_app.conf, "task_always_eager", True)
    with Receiver() as receiver:
        make_channel(project, receiver.url)
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            with transaction.atomic():
                [delivery_id] = services.enqueue(project.id, event(), severity="page")
                assert receiver.requests == [], "nothing is sent before the commit"
        assert services.deliver_soon in callbacks
        assert len(receiver.requests) == 1 and Delivery.objects.get(id=delivery_id).status == "succeeded"
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            with pytest.raises(RuntimeError), transaction.atomic():
                services.enqueue(project.id, event(), severity="page")
                raise RuntimeError("the alert transition failed")
        assert callbacks == [] and len(receiver.requests) == 1 and Delivery.objects.count() == 1
