"""Engine SLOs count engine-served requests only: the gateway's response-cache hits (a millisecond lookup, no engine)
do not improve their SLI, while an SLO with include_cached counts them (docs/slo.md, "Response-cache hits"). Real SLOs
evaluated by slo.evaluation over request rows in a scratch ClickHouse, from built buckets (closed hours) and raw rows
(the open hour) alike."""
from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import pytest
from slo import evaluation, services
from slo.burn import WindowCounts
from tenancy.models import Project

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "alerts"))
from alerts_support import insert_touched, installed_store, spread  # noqa: E402

MIN = dt.timedelta(minutes=1)


@pytest.fixture(scope="module")
def store():
    with installed_store() as scratch:
        yield scratch


def test_cache_hits_do_not_improve_an_engine_slo_and_count_for_one_that_includes_them(db, store):
    project = Project.objects.create(name="cached-traffic")
    ttft = {"sli": "ttft_ms", "threshold_ms": 200, "objective": "99%"}
    engine = services.create(project.id, {"name": "ttft", **ttft})
    seen = services.create(project.id, {"name": "ttft-seen", **ttft, "include_cached": True})
    errors = services.create(project.id, {"name": "errors", "sli": "error_ratio", "objective": "99%"})
    now = dt.datetime.now(dt.timezone.utc).replace(second=0, microsecond=0)  # a whole minute: windows end there
    since = now - 150 * MIN  # two closed hours built into buckets, and the open one read raw
    rows = spread(project.id, since, now, 150, prefill=40.0)  # TTFT 58 ms: good
    rows += spread(project.id, since, now, 150, seed=2, prefill=400.0, status="error")  # TTFT 418 ms: bad
    # Four times as many answered from the gateway's exact cache in about 2 ms: none of them reached the engine.
    rows += spread(project.id, since, now, 1200, seed=3, served_from="exact_cache", lookup_ms=1.0, network=0.5,
                   overhead=0.5, queue=0.0, prefill=0.0, decode=0.0)
    insert_touched(store, rows)

    counted = {e.slo_id: e.counts for e in evaluation.evaluate_project(store, project.id, [engine, seen, errors], now)}
    for window in ("1h", "6h"):  # 1h: raw rows and buckets; 6h: every row
        within = now - (dt.timedelta(hours=1) if window == "1h" else dt.timedelta(hours=6))
        mine = [r for r in rows if r["start_time"] >= within.strftime("%Y-%m-%d %H:%M:%S.%f")]
        engine_rows = [r for r in mine if r["served_from"] == "engine"]
        bad = sum(1 for r in engine_rows if r["ttft_ms"] > 200)
        assert bad and counted[engine.id][window] == WindowCounts(len(engine_rows), bad), window
        assert counted[seen.id][window] == WindowCounts(len(mine), bad), window
        assert counted[errors.id][window] == WindowCounts(len(engine_rows), bad), window
    for slo, burn_rate in ((engine, 50.0), (seen, 10.0)):  # half the engine's requests are bad; a tenth of all
        slo.refresh_from_db()
        assert slo.last_status["burn_rates"]["6h"] == pytest.approx(burn_rate)
