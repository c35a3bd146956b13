"""Burn-rate maths against hand-computed golden cases (slo/burn.py: pure, no Django, no ClickHouse)."""
from __future__ import annotations

import datetime as dt

import pytest
from slo import burn
from slo.burn import DEFAULT_TIERS, WindowCounts

AT = dt.datetime(2026, 11, 20, 12, 0, tzinfo=dt.timezone.utc)
DAYS30 = dt.timedelta(days=30)


def evaluate(objective, counts, **kwargs):
    kwargs.setdefault("tiers", DEFAULT_TIERS)
    kwargs.setdefault("period", DAYS30)
    return burn.evaluate(slo_id=1, at=AT, objective=objective, counts=counts, **kwargs)


def uniform(total: int, bad: int) -> dict[str, WindowCounts]:
    """The same bad ratio in every window of the default tiers and the period (counts scale with the window)."""
    labels = ("5m", "30m", "1h", "2h", "6h", "1d", "3d", "30d")
    minutes = {"5m": 5, "30m": 30, "1h": 60, "2h": 120, "6h": 360, "1d": 1440, "3d": 4320, "30d": 43200}
    return {label: WindowCounts(total * minutes[label] // 5, bad * minutes[label] // 5) for label in labels}


def test_burn_rate_definition():
    # 99.9%: budget 0.1%; 20 bad of 10,000 = 0.2% → burn 2.0
    assert burn.burn_rate(WindowCounts(10_000, 20), 0.999) == pytest.approx(2.0)
    assert burn.burn_rate(WindowCounts(0, 0), 0.999) is None
    assert burn.budget_remaining(WindowCounts(10_000, 5), 0.999) == pytest.approx(0.5)
    # overspent: 0.3% bad of a 0.1% budget
    assert burn.budget_remaining(WindowCounts(10_000, 30), 0.999) == pytest.approx(-2.0)


def test_99_9_slo_burning_exactly_14_4x_pages():
    # 144 bad of 10,000 in both the 1 h and the 5 min window: 1.44% / 0.1% = 14.4× exactly.
    counts = {"5m": WindowCounts(10_000, 144), "1h": WindowCounts(10_000, 144), "30m": WindowCounts(10_000, 0),
              "6h": WindowCounts(60_000, 144), "2h": WindowCounts(20_000, 144), "1d": WindowCounts(240_000, 144),
              "3d": WindowCounts(720_000, 144), "30d": WindowCounts(7_200_000, 144)}
    result = evaluate(0.999, counts)
    assert result.burn_rates["1h"] == pytest.approx(14.4)
    assert result.burn_rates["5m"] == pytest.approx(14.4)
    assert result.state == "burning"
    assert result.firing is not None and result.firing.tier.name == "page-1h"
    assert result.firing.tier.severity == "page"
    # 144 bad over 30 days of 7.2 M requests: 0.002% of a 0.1% budget spent
    assert result.budget_remaining == pytest.approx(1 - 0.02)


def test_99_9_slo_just_under_14_4x_does_not_page():
    counts = {"5m": WindowCounts(10_000, 143), "1h": WindowCounts(10_000, 143)}
    result = evaluate(0.999, counts)
    assert result.burn_rates["1h"] == pytest.approx(14.3)
    assert result.firing is None
    assert result.state == "ok"
    page = next(t for t in result.tiers if t.tier.name == "page-1h")
    assert not page.burning and "not both at or above 14.4" in page.reason


def test_long_window_alone_does_not_fire_the_short_window_must_confirm():
    # The burn happened 40 minutes ago and stopped: 1 h still at 20×, the last 5 min clean.
    counts = {"1h": WindowCounts(12_000, 240), "5m": WindowCounts(1_000, 0)}
    result = evaluate(0.999, counts)
    assert result.burn_rates["1h"] == pytest.approx(20.0)
    assert result.burn_rates["5m"] == 0.0
    assert result.firing is None


def test_faster_tiers_suppress_slower_ones():
    # 2% bad everywhere at 99.9%: 20× burn, so all four tiers burn; only page-1h is reported.
    result = evaluate(0.999, uniform(10_000, 200))
    assert [t.burning for t in result.tiers] == [True, True, True, True]
    assert result.firing.tier.name == "page-1h"
    assert [t.suppressed for t in result.tiers] == [False, True, True, True]
    assert all("suppressed by the faster tier page-1h" in t.reason for t in result.tiers[1:])


def test_ticket_fires_when_no_page_tier_burns():
    # 0.4% bad at 99.9%: 4× burn → ticket-1d (3×) and ticket-3d (1×); the 6× and 14.4× pages do not.
    result = evaluate(0.999, uniform(10_000, 40))
    assert result.firing.tier.name == "ticket-1d"
    assert result.firing.tier.severity == "ticket"
    by_name = {t.tier.name: t for t in result.tiers}
    assert not by_name["page-1h"].burning and not by_name["page-6h"].burning
    assert by_name["ticket-3d"].burning and by_name["ticket-3d"].suppressed


def test_tier_order_puts_pages_first_then_short_windows():
    shuffled = [DEFAULT_TIERS[3], DEFAULT_TIERS[1], DEFAULT_TIERS[2], DEFAULT_TIERS[0]]
    assert sorted(shuffled, key=burn.tier_order) == list(DEFAULT_TIERS)


def test_90_percent_slo_cannot_burn_14_4x():
    # A 90% SLO has a 10% budget: 14.4× needs 144% of requests to be bad (2% of the 30-day budget in 1 h).
    page_1h, page_6h = DEFAULT_TIERS[0], DEFAULT_TIERS[1]
    assert not burn.can_fire(page_1h, 0.90)
    assert burn.can_fire(page_6h, 0.90)  # 6 × 10% = 60%
    assert page_1h.budget_share(DAYS30) == pytest.approx(0.02)
    # Even when every request fails, the burn is 10×, below 14.4: the tier never fires.
    result = evaluate(0.90, {"1h": WindowCounts(1000, 1000), "5m": WindowCounts(100, 100),
                             "6h": WindowCounts(6000, 4000), "30m": WindowCounts(600, 600)})
    assert result.burn_rates["1h"] == pytest.approx(10.0)
    by_name = {t.tier.name: t for t in result.tiers}
    assert not by_name["page-1h"].burning
    # 4000 of 6000 bad over 6 h is 66.7% / 10% = 6.67×, and the 30 min window is at 10×: page-6h fires.
    assert by_name["page-6h"].long_burn == pytest.approx(6.0 + 2 / 3)
    assert result.firing.tier.name == "page-6h"


def test_objective_at_the_edge_of_feasibility():
    # factor × budget = 1 exactly: fires only when every request fails (burn = factor).
    tier = burn.BurnTier("all-bad", "page", dt.timedelta(hours=1), dt.timedelta(minutes=5), 10.0)
    assert burn.can_fire(tier, 0.9)
    result = evaluate(0.9, {"1h": WindowCounts(50, 50), "5m": WindowCounts(5, 5)}, tiers=[tier])
    assert result.firing is not None


def test_low_traffic_one_bad_request_of_three_does_not_page():
    # 1 bad of 3 at 99.9% is a 333× burn, but 3 requests < min_requests (20) and 1 bad < min_bad (3).
    counts = {"5m": WindowCounts(3, 1), "1h": WindowCounts(3, 1), "30m": WindowCounts(3, 1), "6h": WindowCounts(3, 1),
              "2h": WindowCounts(3, 1), "1d": WindowCounts(3, 1), "3d": WindowCounts(3, 1), "30d": WindowCounts(3, 1)}
    result = evaluate(0.999, counts, min_requests=20, min_bad=3)
    assert result.burn_rates["1h"] == pytest.approx(1000 / 3)
    assert result.firing is None
    assert result.state == "low_traffic"
    assert all(not t.burning for t in result.tiers)
    assert "low traffic: 3 requests in 1h < min_requests 20" in result.tiers[0].reason


def test_min_bad_guard_alone():
    # Enough requests, but only 2 bad ones: min_bad 3 keeps the page quiet.
    counts = {"5m": WindowCounts(30, 2), "1h": WindowCounts(100, 2)}
    result = evaluate(0.99, counts, min_requests=20, min_bad=3)
    assert result.burn_rates["1h"] == pytest.approx(2.0)  # 2% / 1%
    assert result.firing is None
    counts = {"5m": WindowCounts(30, 5), "1h": WindowCounts(100, 20)}
    result = evaluate(0.99, counts, min_requests=20, min_bad=3)
    assert result.firing.tier.name == "page-1h"


@pytest.mark.parametrize(("policy", "previous", "expected_firing"), [
    ("ok", "page-1h", None),
    ("keep", "page-1h", "page-1h"),
    ("keep", None, None),
    ("alert", None, "no_data"),
])
def test_no_data_policies(policy, previous, expected_firing):
    # Nothing in the fastest tier's long window (1 h); older windows may still hold requests.
    counts = {"1d": WindowCounts(500, 1), "3d": WindowCounts(1500, 2), "30d": WindowCounts(9000, 4)}
    result = evaluate(0.99, counts, no_data=policy, previous_firing=previous)
    assert result.state == "no_data"
    assert result.burn_rates["1h"] is None and result.burn_rates["5m"] is None
    assert (result.firing.tier.name if result.firing else None) == expected_firing
    if expected_firing == "no_data":
        assert result.firing.tier.severity == "ticket"
    assert result.budget_remaining == pytest.approx(1 - (4 / 9000) / 0.01)


def test_no_data_at_all_has_no_budget_figure():
    result = evaluate(0.99, {})
    assert result.state == "no_data"
    assert result.budget_remaining is None
    assert result.firing is None
    assert set(result.burn_rates) == {"5m", "30m", "1h", "2h", "6h", "1d", "3d", "30d"}


def test_window_labels_round_trip():
    for text in ("5m", "30m", "90m", "1h", "6h", "1d", "3d", "28d"):
        assert burn.window_label(burn.parse_window(text)) == text
    assert burn.window_label(dt.timedelta(minutes=60)) == "1h"
    for bad in ("0m", "5s", "1w", "", "h", 5, None):
        with pytest.raises(ValueError):
            burn.parse_window(bad)


def test_evaluation_as_dict_is_json_ready():
    import json

    result = evaluate(0.999, uniform(10_000, 200))
    data = json.loads(json.dumps(result.as_dict()))
    assert data["state"] == "burning"
    assert data["firing"]["name"] == "page-1h"
    assert data["counts"]["1h"] == {"total": 120_000, "bad": 2_400}
    assert data["at"] == "2026-11-20T12:00:00Z"
