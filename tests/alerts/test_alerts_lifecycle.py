"""The alert state machine on real SLO rows, real Evaluations (slo.burn.evaluate) and notify's real enqueue:
pending → firing → resolved, one notification per transition, races, crash recovery, repeats, inhibition,
the no-data policies and orphaned alerts. Diagnosis reads a real (empty or seeded) scratch ClickHouse store."""
from __future__ import annotations

import datetime as dt
import hashlib

import pytest
from alerts import lifecycle
from alerts.models import Alert, AlertState, AlertTransition
from alerts_support import insert_requests, spread
from django.utils import timezone
from notify.models import Channel, Delivery
from slo import burn, services
from tenancy.models import Project

# Recent enough for the request rows' retention (30 days), hour-aligned for readable expectations.
T0 = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
MIN = dt.timedelta(minutes=1)
LABELS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d", "30d")


@pytest.fixture(autouse=True)
def pending_periods(settings):
    """The state machine with a page pending period (the default, 0, fires a page at its first burning evaluation:
    test_evaluation_time_drives_pending_period)."""
    settings.ALERTS = {**settings.ALERTS, "PAGE_FOR_SECONDS": 50.0, "TICKET_FOR_SECONDS": 290.0}


@pytest.fixture
def project(db):
    return Project.objects.create(name="alpha")


@pytest.fixture
def slo(project):
    return services.create(project.id, {"name": "chat-ttft", "sli": "ttft_ms", "threshold_ms": 200,
                                        "objective": "99%", "filters": {"service": ["chat"]},
                                        "labels": {"team": "serving"}})


@pytest.fixture
def channel(project):
    return Channel.objects.create(project=project, name="hook", kind="webhook", url="http://127.0.0.1:9/hook")


def counts(**bad_ratio) -> dict:
    """1000 requests per window; `bad_ratio` per window label (default 0)."""
    return {label: burn.WindowCounts(1000, int(1000 * bad_ratio.get(f"w{label}", 0))) for label in LABELS}


PAGE = counts(w5m=0.2, w1h=0.2)  # 20× over 1h and 5m: the 14.4× page tier
TICKET = counts(w2h=0.04, w1d=0.04)  # 4× over 1d and 2h: the 3× ticket tier only
BOTH = counts(**{f"w{label}": 0.2 for label in LABELS})  # every tier burns: the page suppresses the rest
OK = counts()
NO_DATA = {label: burn.WindowCounts(0, 0) for label in LABELS}


def evaluate(slo, at, window_counts):
    slo.refresh_from_db()
    return burn.evaluate(slo_id=slo.id, at=at, objective=slo.objective, period=slo.period, tiers=slo.burn_tiers,
                         counts=window_counts, min_requests=slo.min_requests, min_bad=slo.min_bad,
                         no_data=slo.no_data, previous_firing=slo.last_firing_tier or None)


def apply(slo, at, window_counts):
    evaluation = evaluate(slo, at, window_counts)
    slo.last_firing_tier = evaluation.firing.tier.name if evaluation.firing else ""
    slo.save(update_fields=["last_firing_tier"])
    return lifecycle.apply_evaluation(slo, evaluation)


def page_alert(slo) -> Alert:
    return Alert.objects.get(slo=slo, severity="page")


def events(status=None) -> list[dict]:
    rows = [d.event for d in Delivery.objects.order_by("id")]
    return [e for e in rows if status is None or e["status"] == status]


def test_pending_firing_resolved_one_notification_per_transition(store, slo, channel):
    assert [t.to_state for t in apply(slo, T0, PAGE)] == ["pending"]
    alert = page_alert(slo)
    expected = hashlib.sha256(f"{slo.project_id}\x1fslo_burn\x1f{slo.id}\x1fpage".encode()).hexdigest()
    assert alert.fingerprint == expected and alert.state == "pending"
    assert Delivery.objects.count() == 0, "pending sends nothing"

    assert apply(slo, T0 + 30 * dt.timedelta(seconds=1), PAGE) == [], "not yet held for the pending period"
    [fired] = apply(slo, T0 + MIN, PAGE)
    assert (fired.from_state, fired.to_state, fired.notified) == ("pending", "firing", True)
    [event] = events()
    assert event["status"] == "firing" and event["severity"] == "page" and event["kind"] == "slo_burn"
    assert event["fingerprint"] == expected and event["event_id"] == str(fired.event_id)
    assert event["labels"] == {"alertname": "SLOErrorBudgetBurn", "project": "alpha", "slo": "chat-ttft",
                               "sli": "ttft_ms", "severity": "page", "service": "chat", "team": "serving"}
    assert event["slo"]["tier"]["name"] == "page-1h" and event["slo"]["burn_rates"]["1h"] == pytest.approx(20)
    assert "20.0×" in event["title"] and event["starts_at"] == lifecycle._iso(T0)
    assert event["diagnosis"] is not None and "error" not in event["diagnosis"]

    assert apply(slo, T0 + 2 * MIN, PAGE) == [], "still firing: nothing new"
    [resolved] = apply(slo, T0 + 3 * MIN, OK)
    assert (resolved.from_state, resolved.to_state, resolved.notified) == ("firing", "resolved", True)
    assert [e["status"] for e in events()] == ["firing", "resolved"]
    resolved_event = events("resolved")[0]
    assert resolved_event["ends_at"] == lifecycle._iso(T0 + 3 * MIN) and resolved_event["fingerprint"] == expected
    alert.refresh_from_db()
    assert alert.state == "resolved" and alert.fired_at == T0 + MIN and alert.resolved_at == T0 + 3 * MIN
    assert list(alert.transitions.values_list("to_state", flat=True)) == ["pending", "firing", "resolved"]

    # A new episode reuses the fingerprint and starts over.
    apply(slo, T0 + 10 * MIN, PAGE)
    apply(slo, T0 + 11 * MIN, PAGE)
    alert.refresh_from_db()
    assert alert.state == "firing" and alert.episode == 2 and alert.started_at == T0 + 10 * MIN
    assert [e["status"] for e in events()] == ["firing", "resolved", "firing"]
    assert len({e["event_id"] for e in events()}) == 3


def test_pending_that_clears_never_notifies(store, slo, channel):
    apply(slo, T0, PAGE)
    [t] = apply(slo, T0 + MIN, OK)
    assert (t.from_state, t.to_state, t.notified) == ("pending", "inactive", False)
    assert Delivery.objects.count() == 0


def test_doubled_beat_and_stale_evaluations_claim_once(store, slo, channel):
    apply(slo, T0, PAGE)
    # Two workers evaluate the same minute: both read the pending row, both try to fire it.
    snapshot_a, snapshot_b = page_alert(slo), page_alert(slo)
    evaluation = evaluate(slo, T0 + MIN, PAGE)
    spec = lifecycle.slo_alert_spec(slo, evaluation, "page", evaluation.firing)
    first = lifecycle.drive(spec, True, T0 + MIN, alert=snapshot_a)
    second = lifecycle.drive(spec, True, T0 + MIN, alert=snapshot_b)  # loses the claim, re-reads, nothing to do
    assert [t.to_state for t in first] == ["firing"] and second == []
    assert len(events("firing")) == 1
    # The same evaluation applied again, and an older one arriving late, change nothing.
    assert lifecycle.apply_evaluation(slo, evaluation) == []
    assert apply(slo, T0 + 30 * dt.timedelta(seconds=1), OK) == [], "older than the last evaluation: ignored"
    assert page_alert(slo).state == "firing" and Delivery.objects.count() == 1


def test_crash_between_claim_and_enqueue_is_recovered_next_cycle(store, slo, channel, monkeypatch):
    apply(slo, T0, PAGE)
    apply(slo, T0 + MIN, PAGE)

    def crash(*args, **kwargs):
        raise RuntimeError("worker died after the claim")

    monkeypatch.setattr(lifecycle, "_enqueue", crash)
    with pytest.raises(RuntimeError):
        apply(slo, T0 + 2 * MIN, OK)
    assert page_alert(slo).state == "firing", "the claim rolled back with the failed enqueue"
    assert not AlertTransition.objects.filter(to_state="resolved").exists()
    monkeypatch.undo()
    [t] = apply(slo, T0 + 3 * MIN, OK)
    assert t.to_state == "resolved" and [e["status"] for e in events()] == ["firing", "resolved"]


def test_repeat_interval_and_fresh_diagnosis(store, slo, channel):
    slo.repeat_interval_seconds = 3600
    slo.save()
    apply(slo, T0, PAGE)
    apply(slo, T0 + MIN, PAGE)
    assert lifecycle.check_repeats(T0 + 30 * MIN) == 0
    # Traffic that the diagnosis can see by the time of the repeat.
    now = T0 + 2 * 60 * MIN
    insert_requests(store, spread(slo.project_id, now - 60 * MIN, now, 40, service="chat", queue=800.0))
    assert lifecycle.check_repeats(now) == 1
    assert lifecycle.check_repeats(now) == 0, "claimed once"
    firing = events("firing")
    assert len(firing) == 2 and firing[1]["repeat"] is True
    assert firing[1]["diagnosis"]["burning"]["requests"] == 40
    assert firing[1]["diagnosis"]["dominant_component"] == "queue"
    assert page_alert(slo).last_notified_at == now
    assert lifecycle.check_repeats(now + 30 * MIN) == 0
    assert lifecycle.check_repeats(now + 61 * MIN) == 1


def test_ticket_is_inhibited_while_the_page_fires(store, slo, channel):
    apply(slo, T0, BOTH)
    apply(slo, T0 + MIN, BOTH)
    assert page_alert(slo).state == "firing"
    ticket = Alert.objects.get(slo=slo, severity="ticket")
    assert ticket.state == "pending"
    apply(slo, T0 + 6 * MIN, BOTH)  # the ticket's pending period (290 s) has passed
    ticket.refresh_from_db()
    assert ticket.state == "firing" and ticket.last_notified_at is None
    fired = ticket.transitions.get(to_state="firing")
    assert fired.muted == {"inhibited_by": page_alert(slo).fingerprint} and not fired.notified
    assert [e["severity"] for e in events()] == ["page"]
    # The page resolves while the ticket still burns: the ticket is notified on the next check.
    apply(slo, T0 + 7 * MIN, TICKET)
    assert page_alert(slo).state == "resolved"
    assert lifecycle.check_repeats(T0 + 7 * MIN) == 1
    assert [(e["severity"], e["status"]) for e in events()] == [("page", "firing"), ("page", "resolved"),
                                                               ("ticket", "firing")]


def test_no_data_policies(store, project, channel):
    keep = services.create(project.id, {"name": "keep", "sli": "e2e_ms", "threshold_ms": 1000, "objective": "99%",
                                        "no_data": "keep"})
    alert = services.create(project.id, {"name": "nodata", "sli": "e2e_ms", "threshold_ms": 1000,
                                         "objective": "99%", "no_data": "alert"})
    ok = services.create(project.id, {"name": "ok", "sli": "e2e_ms", "threshold_ms": 1000, "objective": "99%"})
    for slo in (keep, alert, ok):
        apply(slo, T0, PAGE)
        apply(slo, T0 + MIN, PAGE)
        assert page_alert(slo).state == "firing"
    for minute in (2, 8):
        for slo in (keep, alert, ok):
            apply(slo, T0 + minute * MIN, NO_DATA)
    assert page_alert(keep).state == "firing", "keep: no data holds the firing page"
    assert page_alert(ok).state == "resolved"
    assert page_alert(alert).state == "resolved"
    no_data = Alert.objects.get(slo=alert, severity="ticket")
    assert no_data.state == "firing" and no_data.annotations["tier"] == "no_data"
    assert "no data" in [e for e in events() if e["fingerprint"] == no_data.fingerprint][0]["title"]


def test_disabled_slo_resolves_its_alerts(store, slo, channel):
    apply(slo, T0, PAGE)
    apply(slo, T0 + MIN, PAGE)
    slo.enabled = False
    slo.save()
    assert lifecycle.check_repeats(T0 + 2 * MIN) == 1
    alert = page_alert(slo)
    assert alert.state == "resolved" and alert.transitions.last().reason == "SLO disabled"
    assert [e["status"] for e in events()] == ["firing", "resolved"]
    slo.delete()
    assert Alert.objects.filter(pk=alert.pk, slo__isnull=True).exists(), "alerts outlive their SLO"


def test_evaluation_time_drives_pending_period(store, slo, channel, settings):
    settings.ALERTS = {**settings.ALERTS, "PAGE_FOR_SECONDS": 0}
    states = [t.to_state for t in apply(slo, T0, PAGE)]
    assert states == ["pending", "firing"], "for = 0: fires at the first burning evaluation"
    assert len(events("firing")) == 1
    assert timezone.is_aware(page_alert(slo).fired_at)
    assert AlertState.FIRING == page_alert(slo).state


def test_the_diagnosis_reads_what_the_slo_counts(slo):
    """An SLO alert's context says whether the SLO counts response-cache hits, and its diagnosis reads the same."""
    asked = []

    def diagnose(*args, **kwargs):
        asked.append(kwargs["include_cached"])
        return {}

    for include_cached in (False, True):
        type(slo).objects.filter(pk=slo.pk).update(include_cached=include_cached)
        evaluation = evaluate(slo, T0, PAGE)  # re-reads the row
        spec = lifecycle.slo_alert_spec(slo, evaluation, "page", evaluation.firing)
        assert spec.context["include_cached"] is include_cached
        lifecycle.run_diagnosis(slo.project_id, spec.context, T0, T0 + MIN, diagnose)
    assert asked == [False, True]
