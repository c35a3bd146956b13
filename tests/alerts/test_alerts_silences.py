"""Silences: Alertmanager's matcher semantics, and a silenced alert that changes state but sends nothing until the
silence ends (then check_repeats notifies it once)."""
from __future__ import annotations

import datetime as dt

import pytest
from alerts import lifecycle
from alerts.matchers import MatcherError, matches_all, parse_matcher, parse_matchers
from alerts.models import Alert, Silence
from notify.models import Channel, Delivery
from slo import burn, services
from tenancy.models import Project

T0 = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
MIN = dt.timedelta(minutes=1)
LABELS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d", "30d")
PAGE = {label: burn.WindowCounts(1000, 200 if label in ("5m", "1h") else 0) for label in LABELS}
OK = {label: burn.WindowCounts(1000, 0) for label in LABELS}
ALERT_LABELS = {"alertname": "SLOErrorBudgetBurn", "slo": "chat-ttft", "severity": "page", "service": "chat"}


@pytest.mark.parametrize("text, labels, expected", [
    ('slo="chat-ttft"', ALERT_LABELS, True),
    ("slo=chat-ttft", ALERT_LABELS, True),
    ('slo!="chat-ttft"', ALERT_LABELS, False),
    ('slo=~"chat-.*"', ALERT_LABELS, True),
    ('slo=~"chat"', ALERT_LABELS, False),  # anchored at both ends, as Alertmanager
    ('slo!~"batch-.*"', ALERT_LABELS, True),
    ('team=""', ALERT_LABELS, True),  # a missing label reads as ""
    ('team!=""', ALERT_LABELS, False),
    ('severity=~"page|ticket"', ALERT_LABELS, True),
])
def test_matcher_semantics(text, labels, expected):
    assert parse_matcher(text).matches(labels) is expected


def test_matcher_forms_and_errors():
    assert parse_matcher({"name": "slo", "op": "=~", "value": "a.*"}).to_dict() == {"name": "slo", "op": "=~",
                                                                                     "value": "a.*"}
    # Alertmanager's API form.
    assert parse_matcher({"name": "slo", "value": "x", "isRegex": False, "isEqual": False}).op == "!="
    for bad, message in [
        ({"name": "1bad", "op": "=", "value": "x"}, "label name"),
        ({"name": "slo", "op": "==", "value": "x"}, "op must be"),
        ({"name": "slo", "op": "=~", "value": "("}, "invalid regular expression"),
        ({"name": "slo", "op": "=", "value": 3}, "value must be a string"),
        ({"name": "slo", "value": "x", "extra": 1}, "unknown field"),
        ("no operator", "is not of the form"),
    ]:
        with pytest.raises(MatcherError, match=message):
            parse_matcher(bad)
    with pytest.raises(MatcherError, match="non-empty list"):
        parse_matchers([])
    with pytest.raises(MatcherError, match="silence every alert"):
        parse_matchers(['team=""', 'slo=~".*"'])
    assert matches_all(parse_matchers(['slo="chat-ttft"', 'severity!="ticket"']), ALERT_LABELS)


@pytest.fixture
def slo(db):
    project = Project.objects.create(name="alpha")
    Channel.objects.create(project=project, name="hook", kind="webhook", url="http://127.0.0.1:9/hook")
    return services.create(project.id, {"name": "chat-ttft", "sli": "ttft_ms", "threshold_ms": 200,
                                        "objective": "99%", "filters": {"service": ["chat"]}})


def apply(slo, at, counts):
    evaluation = burn.evaluate(slo_id=slo.id, at=at, objective=slo.objective, period=slo.period,
                               tiers=slo.burn_tiers, counts=counts, min_requests=20, min_bad=3)
    return lifecycle.apply_evaluation(slo, evaluation)


def silence(slo, matchers, starts_at, ends_at) -> Silence:
    return Silence.objects.create(project_id=slo.project_id, matchers=matchers, starts_at=starts_at,
                                  ends_at=ends_at, created_by_name="alice", comment="maintenance")


def statuses() -> list[str]:
    return [d.event["status"] for d in Delivery.objects.order_by("id")]


def test_silenced_alert_changes_state_sends_nothing_then_notifies_after_expiry(store, slo):
    muted = silence(slo, [{"name": "slo", "op": "=", "value": "chat-ttft"}], T0 - MIN, T0 + 10 * MIN)
    apply(slo, T0, PAGE)
    apply(slo, T0 + MIN, PAGE)
    alert = Alert.objects.get(slo=slo, severity="page")
    assert alert.state == "firing", "a silenced alert still changes state"
    assert alert.transitions.get(to_state="firing").muted == {"silences": [muted.id]}
    assert statuses() == []
    assert lifecycle.check_repeats(T0 + 5 * MIN) == 0, "still silenced"
    assert lifecycle.check_repeats(T0 + 10 * MIN) == 1, "the silence ended: first notification"
    assert statuses() == ["firing"]
    apply(slo, T0 + 11 * MIN, OK)
    assert statuses() == ["firing", "resolved"]


def test_silence_that_does_not_match_or_has_not_started_mutes_nothing(store, slo):
    silence(slo, [{"name": "slo", "op": "!=", "value": "chat-ttft"}], T0 - MIN, T0 + 60 * MIN)
    silence(slo, ['severity="page"'], T0 + 30 * MIN, T0 + 60 * MIN)
    apply(slo, T0, PAGE)
    apply(slo, T0 + MIN, PAGE)
    assert statuses() == ["firing"]


def test_resolution_of_a_notified_alert_is_sent_even_under_a_new_silence(store, slo):
    apply(slo, T0, PAGE)
    apply(slo, T0 + MIN, PAGE)
    silence(slo, ['alertname="SLOErrorBudgetBurn"'], T0 + MIN, T0 + 60 * MIN)
    apply(slo, T0 + 2 * MIN, OK)
    assert statuses() == ["firing", "resolved"], "the receiver's incident must close"
