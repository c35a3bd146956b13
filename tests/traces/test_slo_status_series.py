"""The SLO status series (slo/queries.py, ClickHouse table slo_status): the point of the current minute is in a
series that ends now, also during the first second after the minute turns (points are stamped on the minute)."""
from __future__ import annotations

import datetime as dt

from slo import queries
from traces import ch_migrate

PROJECT = 3


def point(slo_id: int, at: dt.datetime, state: str) -> dict:
    return {"slo_id": slo_id, "at": at, "state": state, "firing_tier": "", "severity": "", "budget_remaining": 0.5,
            "burn_rates": {"5m": 1.0}, "totals": {"5m": 10}, "bads": {"5m": 1}}


def test_the_current_minute_is_in_a_series_ending_now(make_store):
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    minute = dt.datetime(2026, 11, 21, 12, 1, tzinfo=dt.timezone.utc)
    queries.insert_status(store, PROJECT, [point(7, minute - dt.timedelta(minutes=1), "ok"),
                                           point(7, minute, "burning")], 30)
    for until in (minute + dt.timedelta(milliseconds=400), minute + dt.timedelta(seconds=30)):
        series = queries.status_series(store, PROJECT, 7, until - dt.timedelta(hours=1), until, 100)
        assert [p["state"] for p in series] == ["ok", "burning"], until
    # the end stays exclusive: a series ending exactly on the minute does not hold that minute's point
    series = queries.status_series(store, PROJECT, 7, minute - dt.timedelta(hours=1), minute, 100)
    assert [p["state"] for p in series] == ["ok"]
    assert queries.status_series(store, PROJECT + 1, 7, minute - dt.timedelta(hours=1), minute, 100) == []
