"""An evaluation counts its windows up to the second it runs at, the current minute included (a page tier need not
wait for the minute to close), and the status series keeps one point per SLO and minute: the minute's latest
evaluation. Real SLO evaluations (slo.evaluation) over request rows in a scratch ClickHouse store."""
from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import pytest
from slo import evaluation, queries, services
from slo.burn import WindowCounts
from tenancy.models import Project

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "alerts"))
from alerts_support import insert_touched, installed_store, spread  # noqa: E402

SECOND = dt.timedelta(seconds=1)


@pytest.fixture(scope="module")
def store():
    with installed_store() as scratch:
        yield scratch


def test_windows_end_on_the_evaluated_second_and_the_minute_keeps_its_latest_point(db, store):
    project = Project.objects.create(name="seconds")
    slo = services.create(project.id, {"name": "ttft", "sli": "ttft_ms", "threshold_ms": 200, "objective": "99%"})
    minute = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=10)).replace(second=0, microsecond=0)
    rows = spread(project.id, minute - 240 * SECOND, minute, 20, prefill=40.0)  # TTFT 58 ms: good
    rows += spread(project.id, minute + 20 * SECOND, minute + 30 * SECOND, 5, seed=2, prefill=400.0)  # 418 ms: bad
    insert_touched(store, rows)

    [early] = evaluation.evaluate_project(store, project.id, [slo], minute + 15.7 * SECOND)
    assert early.at == minute + 15 * SECOND and early.counts["5m"] == WindowCounts(20, 0) and early.state == "ok"
    [late] = evaluation.evaluate_project(store, project.id, [slo], minute + 40 * SECOND)
    assert late.at == minute + 40 * SECOND and late.counts["5m"] == WindowCounts(25, 5)
    assert late.firing is not None and late.firing.tier.name == "page-1h"
    # 4 min 55 s after the last good request it has left the 5-minute window; the slow ones have not
    [after] = evaluation.evaluate_project(store, project.id, [slo], minute + 295 * SECOND)
    assert after.counts["5m"] == WindowCounts(5, 5) and after.counts["1h"] == WindowCounts(25, 5)

    points = queries.status_series(store, project.id, slo.id, minute - 60 * SECOND, minute + 600 * SECOND, 10)
    minute_iso = minute.isoformat().replace("+00:00", "Z")
    assert [p["at"] for p in points][:1] == [minute_iso] and len(points) == 2, points
    assert points[0]["counts"]["5m"] == {"total": 25, "bad": 5} and points[0]["firing_tier"] == "page-1h"
    slo.refresh_from_db()
    assert slo.last_evaluated_at == minute + 295 * SECOND
