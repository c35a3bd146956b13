"""Reliable delivery of alert events to channels: enqueue in the caller's transaction, claim due deliveries with a
conditional UPDATE and a lease, send concurrently over the SSRF-checked client, classify the answer, retry with
exponential backoff and jitter, disable a channel on 410 Gone.

A new event is sent at once: once the transaction that enqueued it commits, a delivery round is asked of a worker
(the task notify.deliver_due); the beat's round every DELIVER_INTERVAL_SECONDS takes retries, and whatever that
request missed (the broker away).

Exactly-once towards the database: one Delivery row per (channel, event_id), created in the same transaction as
the alert transition that produced the event. At-least-once towards the receiver: a worker that dies after
sending but before recording leaves an expired lease and the delivery is sent again with the same
``webhook-id`` (PagerDuty: the same ``dedup_key``), so receivers can deduplicate.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import email.utils
import logging
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone
from jobs import dispatch

from . import http_client, metrics, renderers, signing
from .channels import channel_accepts, redact_url
from .models import Channel, ChannelKind, Delivery, DeliveryAttempt, DeliveryStatus

log = logging.getLogger(__name__)
Outcome = DeliveryAttempt.Outcome
_TRANSIENT_4XX = {408, 409, 425, 429}
_EVENT_STATUSES = ("firing", "resolved")
# A delivery's final status as the deliveries metric names it (bulk endings count as superseded/channel_disabled).
_ENDED_AS = {DeliveryStatus.SUCCEEDED: "succeeded", DeliveryStatus.FAILED: "failed", DeliveryStatus.DEAD: "dead"}


def _cfg(name: str, default):
    return getattr(settings, "NOTIFY", {}).get(name, default)


# -- enqueue ----------------------------------------------------------------------------------------------------
def _check_event(event: dict, severity: str) -> None:
    if not isinstance(event, dict):
        raise ValueError("event must be a dict")
    if not isinstance(event.get("event_id"), str) or not 0 < len(event["event_id"]) <= 64:
        raise ValueError("event['event_id'] must be a string of 1..64 characters (unique per transition)")
    if event.get("status") not in _EVENT_STATUSES:
        raise ValueError(f"event['status'] must be one of {', '.join(_EVENT_STATUSES)}")
    if not isinstance(event.get("fingerprint"), str) or not event["fingerprint"]:
        raise ValueError("event['fingerprint'] must be a non-empty string")
    if not isinstance(severity, str) or not severity:
        raise ValueError("severity must be a non-empty string such as 'page' or 'ticket'")


def enqueue(project_id: int, event: dict, *, severity: str, now: dt.datetime | None = None) -> list[int]:
    """One pending Delivery per enabled channel of the project that accepts the event (severity filter, label
    matchers, send_resolved). Runs in the caller's transaction, so an alert transition and its deliveries commit
    together or not at all. Enqueuing the same event_id twice creates nothing new. A newer event for the same
    fingerprint supersedes that channel's still-pending older ones (a receiver only needs the latest state, and a
    late "firing" must never arrive after its "resolved"). Returns the ids of this event's deliveries."""
    _check_event(event, severity)
    now = now or timezone.now()
    channels = [c for c in Channel.objects.filter(project_id=project_id, enabled=True)
                if channel_accepts(c, event, severity)]
    if not channels:
        return []
    by_kind: dict[str, list[Channel]] = {}
    for channel in channels:
        by_kind.setdefault(channel.kind, []).append(channel)
    with transaction.atomic():
        for kind, group in by_kind.items():  # one UPDATE per channel kind (the metric's label), usually one
            superseded = Delivery.objects.filter(
                channel__in=group, fingerprint=event["fingerprint"], status=DeliveryStatus.PENDING, is_test=False,
            ).exclude(event_id=event["event_id"]).update(
                status=DeliveryStatus.DEAD, next_attempt_at=None, updated_at=now,
                last_error=f"superseded by event {event['event_id']} ({event['status']})",
            )
            _count_on_commit(kind, "superseded", superseded)
        Delivery.objects.bulk_create(
            [Delivery(channel=c, event=event, event_id=event["event_id"], fingerprint=event["fingerprint"][:128],
                      severity=severity[:16], status=DeliveryStatus.PENDING, next_attempt_at=now, created_at=now,
                      updated_at=now) for c in channels],
            ignore_conflicts=True,
        )
        transaction.on_commit(deliver_soon)
        return list(Delivery.objects.filter(channel__in=channels, event_id=event["event_id"])
                    .order_by("id").values_list("id", flat=True))


def deliver_soon() -> None:
    """Ask a worker for a delivery round now instead of at the beat's next one (up to DELIVER_INTERVAL_SECONDS
    later): a page goes out within the broker's hand-over. Unrun after 30 s, the message is dropped; the beat's
    rounds go on either way."""
    dispatch.send("notify.deliver_due", what="delivery round", expires=30.0)


def _count_on_commit(kind: str, outcome: str, count: int) -> None:
    """Count ended deliveries once the transaction that ended them commits (an alert transition rolled back
    supersedes nothing)."""
    if count > 0:
        transaction.on_commit(lambda: metrics.delivery_ended(kind, outcome, count))


# -- retry policy -----------------------------------------------------------------------------------------------
def backoff_seconds(attempts: int) -> float:
    """The delay before attempt ``attempts + 1`` without jitter: base doubling per attempt, capped."""
    base = float(_cfg("BACKOFF_BASE_SECONDS", 30.0))
    cap = float(_cfg("BACKOFF_MAX_SECONDS", 3600.0))
    return min(cap, base * (2 ** max(0, attempts - 1)))


def retry_delay(attempts: int, retry_after: float | None = None, rng: random.Random | None = None) -> float:
    """Backoff plus up to JITTER (a fraction) more, so retries of many deliveries spread out; never earlier
    than the receiver's Retry-After (capped at RETRY_AFTER_MAX_SECONDS)."""
    rng = rng or random
    delay = backoff_seconds(attempts) * (1.0 + rng.uniform(0.0, float(_cfg("BACKOFF_JITTER", 0.25))))
    if retry_after is not None:
        delay = max(delay, min(retry_after, float(_cfg("RETRY_AFTER_MAX_SECONDS", 6 * 3600))))
    return delay


def retry_span_seconds() -> float:
    """The shortest time between the first and the last attempt (no jitter, no Retry-After)."""
    return sum(backoff_seconds(n) for n in range(1, int(_cfg("MAX_ATTEMPTS", 31))))


def parse_retry_after(value: str | None, now: dt.datetime) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date. None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return max(0.0, (when - now).total_seconds())


def classify(status_code: int) -> str:
    if 200 <= status_code < 300:
        return Outcome.SUCCEEDED
    if status_code == 410:
        return Outcome.GONE
    if status_code in _TRANSIENT_4XX or status_code >= 500 or status_code < 200:
        return Outcome.TRANSIENT
    return Outcome.PERMANENT  # other 4xx, and a 3xx that was not (or could not be) followed


# -- sending ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Prepared:
    delivery_id: int
    url: str
    body: bytes
    headers: dict
    kind: str = ""  # the channel's, for the metrics
    is_test: bool = False  # test sends are left out of the metrics


@dataclasses.dataclass
class SendResult:
    outcome: str
    status_code: int | None
    error: str
    duration_ms: float
    retry_after: float | None
    url: str
    excerpt: str
    timed_out: bool = False  # a transient outcome because no answer came in time


def prepare(delivery: Delivery, channel: Channel) -> Prepared:
    """The request for one attempt: rendered from the event snapshot and the channel as it is now (so a rotated
    secret or a fixed URL applies to retries), signed at this moment."""
    document = renderers.render(
        channel.kind, delivery.event, receiver=channel.name, routing_key=channel.routing_key,
        external_url=str(_cfg("EXTERNAL_URL", "")),
    )
    body = renderers.encode(document)
    headers = {"Content-Type": "application/json"}
    secrets = channel.secrets if channel.kind in (ChannelKind.WEBHOOK, ChannelKind.ALERTMANAGER) else []
    headers.update(signing.signature_headers(delivery.webhook_id, body, secrets))
    return Prepared(delivery.id, channel.url, body, headers, channel.kind, delivery.is_test)


def attempt_outcome(result: SendResult) -> str:
    """The attempt as the metrics name it: success, transient, permanent (410 and refusals too) or timeout."""
    if result.outcome == Outcome.SUCCEEDED:
        return "success"
    if result.outcome == Outcome.TRANSIENT:
        return "timeout" if result.timed_out else "transient"
    return "permanent"


def send(prepared: Prepared, policy: http_client.Policy) -> SendResult:
    """One HTTP attempt; never raises. No database access here: this runs on worker threads."""
    result = _send(prepared, policy)
    if not prepared.is_test:
        metrics.attempt_made(prepared.kind, attempt_outcome(result), result.duration_ms / 1000)
    return result


def _send(prepared: Prepared, policy: http_client.Policy) -> SendResult:
    started = time.monotonic()
    try:
        response = http_client.request(prepared.url, prepared.body, prepared.headers, policy)
    except http_client.RequestRefused as exc:
        return SendResult(Outcome.REFUSED, None, str(exc), (time.monotonic() - started) * 1000, None,
                          prepared.url, "")
    except http_client.TransportError as exc:
        return SendResult(Outcome.TRANSIENT, None, str(exc), (time.monotonic() - started) * 1000, None,
                          prepared.url, "", timed_out=isinstance(exc, http_client.RequestTimeout))
    except Exception as exc:  # a bug must not leave the delivery claimed until its lease runs out
        log.exception("unexpected error sending delivery %s", prepared.delivery_id)
        return SendResult(Outcome.TRANSIENT, None, f"internal error: {type(exc).__name__}: {exc}",
                          (time.monotonic() - started) * 1000, None, prepared.url, "")
    duration = (time.monotonic() - started) * 1000
    outcome = classify(response.status)
    retry_after = parse_retry_after(response.headers.get("retry-after"), timezone.now())
    excerpt = response.body[:300].decode("utf-8", "replace")
    error = "" if outcome == Outcome.SUCCEEDED else f"HTTP {response.status}" + (f": {excerpt[:200]}" if excerpt else "")
    if outcome == Outcome.GONE:
        error = "HTTP 410 Gone: the receiver says this endpoint no longer exists"
    return SendResult(outcome, response.status, error, duration, retry_after, response.url, excerpt)


def _refused(error: str) -> SendResult:
    return SendResult(Outcome.REFUSED, None, error, 0.0, None, "", "")


def disable_channel(channel: Channel, reason: str, now: dt.datetime | None = None) -> int:
    """Disable a channel and end its pending deliveries (they would otherwise fire stale when re-enabled).
    Returns how many deliveries were ended."""
    now = now or timezone.now()
    with transaction.atomic():
        Channel.objects.filter(id=channel.id).update(enabled=False, disabled_reason=reason[:500], updated_at=now)
        channel.enabled, channel.disabled_reason = False, reason[:500]
        ended = Delivery.objects.filter(channel_id=channel.id, status=DeliveryStatus.PENDING).update(
            status=DeliveryStatus.DEAD, next_attempt_at=None, updated_at=now,
            last_error=f"channel disabled: {reason}"[:1000],
        )
        _count_on_commit(channel.kind, "channel_disabled", ended)
        return ended


def record(delivery: Delivery, channel: Channel, result: SendResult, token: uuid.UUID, started_at: dt.datetime,
           now: dt.datetime | None = None) -> str:
    """Store the attempt and the delivery's new state; returns the new status. The update is conditional on this
    worker's claim token, so a worker whose lease expired (and whose delivery was claimed again) changes nothing."""
    now = now or timezone.now()
    max_attempts = int(_cfg("MAX_ATTEMPTS", 31))
    fields: dict = {"last_status_code": result.status_code, "last_error": result.error[:1000],
                    "last_duration_ms": round(result.duration_ms, 3), "updated_at": now,
                    "lease_expires_at": None, "claim_token": None}
    if result.outcome == Outcome.SUCCEEDED:
        fields.update(status=DeliveryStatus.SUCCEEDED, delivered_at=now, next_attempt_at=None)
    elif result.outcome in (Outcome.PERMANENT, Outcome.REFUSED, Outcome.GONE):
        fields.update(status=DeliveryStatus.FAILED, next_attempt_at=None)
    elif delivery.is_test:
        fields.update(status=DeliveryStatus.FAILED, next_attempt_at=None)  # test sends are never retried
    elif delivery.attempts >= max_attempts:
        fields.update(status=DeliveryStatus.DEAD, next_attempt_at=None,
                      last_error=f"gave up after {delivery.attempts} attempts; last: {result.error}"[:1000])
    else:
        delay = retry_delay(delivery.attempts, result.retry_after)
        fields.update(status=DeliveryStatus.PENDING, next_attempt_at=now + dt.timedelta(seconds=delay))
    with transaction.atomic():
        DeliveryAttempt.objects.create(
            delivery_id=delivery.id, number=delivery.attempts, started_at=started_at,
            duration_ms=round(result.duration_ms, 3), outcome=result.outcome, status_code=result.status_code,
            error=result.error[:1000], url=redact_url(result.url, channel.kind)[:2048] if result.url else "",
            response_excerpt=result.excerpt[:500],
        )
        claimed = Delivery.objects.filter(id=delivery.id, claim_token=token, status=DeliveryStatus.SENDING)
        if not claimed.update(**fields):
            log.warning("delivery %s: lease lost before the result was recorded (%s)", delivery.id, result.outcome)
            return DeliveryStatus.SENDING
        if fields["status"] != DeliveryStatus.PENDING and not delivery.is_test:
            _count_on_commit(channel.kind, _ENDED_AS[fields["status"]], 1)
        if result.outcome == Outcome.SUCCEEDED:
            Channel.objects.filter(id=channel.id).update(last_success_at=now)
        else:
            Channel.objects.filter(id=channel.id).update(last_error=fields["last_error"][:1000], last_error_at=now)
        if result.outcome == Outcome.GONE:
            disable_channel(channel, f"the receiver answered 410 Gone at {now.isoformat()}", now)
    for name, value in fields.items():
        setattr(delivery, name, value)
    return fields["status"]


def _due(now: dt.datetime) -> Q:
    return (Q(status=DeliveryStatus.PENDING, next_attempt_at__lte=now)
            | Q(status=DeliveryStatus.SENDING, lease_expires_at__lte=now))


def claim_due(now: dt.datetime, limit: int, concurrency: int = 8) -> tuple[uuid.UUID, list[Delivery]]:
    """Claim up to ``limit`` due deliveries (pending and due, or sending with an expired lease) in one conditional
    UPDATE: a row another worker claimed in between no longer matches and is not taken. At most PER_CHANNEL_BATCH
    per channel, so a channel with a backlog cannot crowd out the others; a delivery is not claimed while another
    one of the same channel and fingerprint is in flight (order of firing/resolved). The lease covers the whole
    batch at the given concurrency, so no delivery's lease runs out while it waits for a sending thread."""
    per_channel = int(_cfg("PER_CHANNEL_BATCH", 4))
    candidates = list(
        Delivery.objects.filter(_due(now), channel__enabled=True, is_test=False)
        .order_by("next_attempt_at", "id").values_list("id", "channel_id", "fingerprint")[: limit * 4]
    )
    token = uuid.uuid4()
    if not candidates:
        return token, []
    busy = set(
        Delivery.objects.filter(status=DeliveryStatus.SENDING, lease_expires_at__gt=now,
                                channel_id__in={c[1] for c in candidates})
        .values_list("channel_id", "fingerprint")
    )
    chosen, per_count = [], {}
    for pk, channel_id, fingerprint in candidates:
        if per_count.get(channel_id, 0) >= per_channel or (channel_id, fingerprint) in busy:
            continue
        per_count[channel_id] = per_count.get(channel_id, 0) + 1
        busy.add((channel_id, fingerprint))
        chosen.append(pk)
        if len(chosen) >= limit:
            break
    rounds = -(-len(chosen) // max(1, concurrency))
    total_timeout = float(_cfg("TOTAL_TIMEOUT_SECONDS", 30.0))
    lease = dt.timedelta(seconds=max(float(_cfg("LEASE_SECONDS", 120.0)), rounds * total_timeout + 60.0))
    # Conditions on the delivery row itself only: PostgreSQL re-checks them on the row version a concurrent
    # claimer just committed and skips the row. A join or subquery (channel__enabled) would be judged on the
    # old snapshot, and two workers would both win the same delivery.
    Delivery.objects.filter(_due(now), id__in=chosen).update(
        status=DeliveryStatus.SENDING, claim_token=token, lease_expires_at=now + lease,
        attempts=F("attempts") + 1, updated_at=now,
    )
    claimed = list(Delivery.objects.filter(claim_token=token).select_related("channel", "channel__project"))
    # Fresh events first: a channel's retries never hold back a first attempt elsewhere.
    claimed.sort(key=lambda d: (d.attempts, d.next_attempt_at or now, d.id))
    return token, claimed


def deliver_due(now: dt.datetime | None = None, limit: int = 100) -> int:
    """Claim and send due deliveries concurrently (bounded by CONCURRENCY; every request bounded by the
    timeouts), record each result as it arrives. Returns how many deliveries were attempted."""
    now = now or timezone.now()
    max_attempts = int(_cfg("MAX_ATTEMPTS", 31))
    # Test sends are synchronous and never retried: one interrupted mid-send is simply over.
    Delivery.objects.filter(is_test=True, status=DeliveryStatus.SENDING, lease_expires_at__lte=now).update(
        status=DeliveryStatus.FAILED, last_error="the test send was interrupted", lease_expires_at=None,
        claim_token=None, updated_at=now)
    concurrency = max(1, int(_cfg("CONCURRENCY", 8)))
    token, claimed = claim_due(now, limit, concurrency)
    if not claimed:
        return 0
    policy = http_client.policy_from_settings()
    jobs: dict = {}
    started_at = timezone.now()
    with ThreadPoolExecutor(max_workers=min(concurrency, len(claimed)), thread_name_prefix="notify-send") as pool:
        for delivery in claimed:
            if not delivery.channel.enabled:  # disabled between selection and claim
                ended = Delivery.objects.filter(id=delivery.id, claim_token=token).update(
                    status=DeliveryStatus.DEAD, claim_token=None, lease_expires_at=None, next_attempt_at=None,
                    updated_at=now, last_error=f"channel disabled: {delivery.channel.disabled_reason}"[:1000])
                _count_on_commit(delivery.channel.kind, "channel_disabled", ended)
                continue
            if delivery.attempts > max_attempts:  # a worker died during the last allowed attempt
                lost = SendResult(Outcome.TRANSIENT, None, "worker lost during the last attempt", 0.0, None, "", "")
                record(delivery, delivery.channel, lost, token, started_at, now)
                continue
            try:
                prepared = prepare(delivery, delivery.channel)
            except Exception as exc:
                log.exception("delivery %s could not be rendered", delivery.id)
                record(delivery, delivery.channel, _refused(f"could not render the payload: {exc}"), token,
                       started_at, now)
                continue
            jobs[pool.submit(send, prepared, policy)] = delivery
        for future in as_completed(jobs):
            delivery = jobs[future]
            result = future.result()
            # The clock of record: the caller's "now" plus the time this batch has taken, so a test's
            # controllable clock stays consistent and a real batch stamps real times.
            record(delivery, delivery.channel, result, token, started_at, now + (timezone.now() - started_at))
    return len(claimed)


def send_test(channel: Channel, now: dt.datetime | None = None) -> Delivery:
    """Send a synthetic event to the channel right now and return its delivery (status succeeded or failed).
    Never retried; a 410 still disables the channel."""
    now = now or timezone.now()
    event_id = str(uuid.uuid4())
    event = {
        "event_id": event_id,
        "fingerprint": f"test-{channel.id}-{event_id[:8]}",
        "status": "firing",
        "severity": "info",
        "kind": "test",
        "project": channel.project.name,
        "title": f"Test notification for channel {channel.name}",
        "summary": "A test sent from the LLM latency observatory; no action is needed.",
        "description": "Sent by POST /api/v1/channels/{id}/test to check that this channel receives and verifies "
                       "notifications.",
        "labels": {"alertname": "ObservatoryTest", "project": channel.project.name, "severity": "info"},
        "annotations": {"summary": "test notification"},
        "starts_at": now.isoformat().replace("+00:00", "Z"),
        "ends_at": None,
        "url": None,
        "slo": None,
        "diagnosis": None,
    }
    token = uuid.uuid4()
    delivery = Delivery.objects.create(
        channel=channel, event=event, event_id=event_id, fingerprint=event["fingerprint"], severity="info",
        status=DeliveryStatus.SENDING, attempts=1, is_test=True, claim_token=token, next_attempt_at=None,
        lease_expires_at=now + dt.timedelta(seconds=float(_cfg("LEASE_SECONDS", 120.0))), created_at=now,
        updated_at=now,
    )
    started_at = timezone.now()
    try:
        result = send(prepare(delivery, channel), http_client.policy_from_settings())
    except Exception as exc:
        log.exception("test delivery %s could not be rendered", delivery.id)
        result = _refused(f"could not render the payload: {exc}")
    record(delivery, channel, result, token, started_at, now + (timezone.now() - started_at))
    delivery.refresh_from_db()
    return delivery


# -- retention --------------------------------------------------------------------------------------------------
FINISHED_STATUSES = (DeliveryStatus.SUCCEEDED, DeliveryStatus.FAILED, DeliveryStatus.DEAD)
_PRUNE_PAUSE_SECONDS = 0.02  # between batches: other writers (SQLite has one at a time) get their turn


def prune_deliveries(now: dt.datetime | None = None, *, retention_days: float | None = None,
                     batch_size: int | None = None, max_seconds: float | None = None) -> int:
    """Delete finished deliveries (succeeded, failed, dead; test sends included) whose last change is older than
    the retention, with their attempt log, oldest first. Pending and sending deliveries are never touched.

    Each batch of at most ``batch_size`` deliveries is its own short transaction, found through the
    ``(status, updated_at)`` index; after ``max_seconds`` (at least one batch) the run stops and the next one
    continues, so a large backlog never holds locks or a worker for long. Returns how many were deleted;
    a retention of 0 or less keeps everything."""
    retention_days = float(_cfg("DELIVERY_RETENTION_DAYS", 30.0) if retention_days is None else retention_days)
    if retention_days <= 0:
        return 0
    batch_size = max(1, int(_cfg("PRUNE_BATCH_SIZE", 1000) if batch_size is None else batch_size))
    max_seconds = float(_cfg("PRUNE_MAX_SECONDS", 30.0) if max_seconds is None else max_seconds)
    cutoff = (now or timezone.now()) - dt.timedelta(days=retention_days)
    started = time.monotonic()
    deleted = attempts = batches = 0
    for status in FINISHED_STATUSES:
        while True:
            if batches:
                if time.monotonic() - started >= max_seconds:
                    _log_pruned(deleted, attempts, retention_days, complete=False)
                    return deleted
                time.sleep(_PRUNE_PAUSE_SECONDS)
            ids = list(Delivery.objects.filter(status=status, updated_at__lt=cutoff)
                       .order_by("updated_at").values_list("id", flat=True)[:batch_size])
            if not ids:
                break
            with transaction.atomic():
                # Re-checked in the DELETE itself: a row never leaves a finished status, but the rule that
                # unfinished deliveries survive must not depend on that.
                _, per_model = (Delivery.objects.filter(id__in=ids, status__in=FINISHED_STATUSES,
                                                        updated_at__lt=cutoff).only("id").delete())
            batches += 1
            n = per_model.get(Delivery._meta.label, 0)
            deleted += n
            attempts += per_model.get(DeliveryAttempt._meta.label, 0)
            metrics.PRUNED.inc(n)
            if len(ids) < batch_size:
                break
    _log_pruned(deleted, attempts, retention_days, complete=True)
    return deleted


def _log_pruned(deleted: int, attempts: int, retention_days: float, *, complete: bool) -> None:
    if deleted:
        log.info("pruned %d finished deliveries (%d attempts) older than %g days%s", deleted, attempts,
                 retention_days, "" if complete else "; more remain for the next run")
