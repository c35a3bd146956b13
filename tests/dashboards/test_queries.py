"""The dashboard's queries against a real (embedded) ClickHouse: the breakdowns of the overview in one pass equal
one summary per dimension; the explorer's keyset pages cover every row once, in order."""
from __future__ import annotations

import datetime as dt

import pytest
from observatory.bench.seed import seed_requests
from traces import ch_migrate, rollups
from traces import queries as tq

from dashboards import queries as dq

PROJECT = 3


@pytest.fixture(scope="module")
def seeded(chdb_session_path):
    from traces.store import ClickHouseStore

    store = ClickHouseStore(url=None, chdb_path=chdb_session_path, database="t_dashboard_queries")
    ch_migrate.apply(store, log=lambda *_: None)
    end = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    seed_requests(store, PROJECT, rows=20_000, start=end - dt.timedelta(hours=30), end=end)
    while rollups.build_dirty_hours(store, PROJECT, settle_seconds=0):
        pass
    yield store, end
    store.command(f"DROP DATABASE IF EXISTS `{store.database}` SYNC")
    store.close()


def test_breakdowns_in_one_pass_equal_one_summary_per_dimension(seeded):
    store, end = seeded
    since, until = end - dt.timedelta(hours=26, minutes=30), end + dt.timedelta(minutes=5)
    together = tq.latency_summary(store, PROJECT, since=since, until=until, group_by=list(dq.BREAKDOWNS), filters={},
                                  separately=True)
    for dimension in dq.BREAKDOWNS:
        alone = tq.latency_summary(store, PROJECT, since=since, until=until, group_by=[dimension], filters={})
        mine = sorted((g for g in together if list(g["key"]) == [dimension]), key=lambda g: g["key"][dimension])
        alone.sort(key=lambda g: g["key"][dimension])
        assert [(g["key"], g["count"], g["errors"]) for g in mine] == [(g["key"], g["count"], g["errors"])
                                                                       for g in alone], dimension
        for a, b in zip(mine, alone):
            for metric in ("e2e_ms", "ttft_ms", "decode_ms"):
                for q in a[metric]:
                    assert a[metric][q] == pytest.approx(b[metric][q], rel=0.02), (dimension, metric, q)
    assert sum(g["count"] for g in together if "model" in g["key"]) == sum(
        g["count"] for g in together if "service" in g["key"]) > 0


@pytest.mark.parametrize("sort,descending", [("start_time", True), ("e2e_ms", True), ("ttft_ms", False)])
def test_keyset_pages_cover_every_row_once_in_order(seeded, sort, descending):
    store, end = seeded
    since, until = end - dt.timedelta(hours=2), end
    seen, cursor, values = [], None, []
    while True:
        rows, cursor = dq.explore(store, PROJECT, since=since, until=until, filters={"replica_group": "canary"},
                                  min_e2e=None, min_ttft=None, sort=sort, descending=descending, after=cursor)
        seen.extend((r["trace_id"], r["request_key"]) for r in rows)
        values.extend(r["_sort"] for r in rows)
        if cursor is None:
            break
        assert dq.Cursor.decode(cursor.encode()) == cursor
    assert len(seen) == len(set(seen)) > dq.PAGE_SIZE
    assert values == sorted(values, reverse=descending)
    [[total]] = store.query(
        f"SELECT count() FROM {store.table('llm_requests')} FINAL WHERE project_id = {{project_id:UInt32}} "
        "AND replica_group = 'canary' AND start_time >= {since:DateTime64(6)} AND start_time < {until:DateTime64(6)}",
        project_id=PROJECT, parameters={"since": since.replace(tzinfo=None), "until": until.replace(tzinfo=None)})
    assert len(seen) == total


@pytest.mark.parametrize("text", ["", "1~x~y", "12~" + "g" * 32 + "~ab", "1.5~" + "a" * 31 + "~k", "x" * 300])
def test_a_cursor_that_is_not_ours_is_refused(text):
    with pytest.raises(ValueError):
        dq.Cursor.decode(text)


def test_hour_aligned_charts_from_the_rollups_equal_the_rows(seeded):
    """7/30-day charts merge the clean hours' rollup states with the raw rows of the rest: the counts and means
    equal those of the rows, the percentiles within t-digest error."""
    store, end = seeded
    since, until = end - dt.timedelta(hours=26, minutes=30), end + dt.timedelta(minutes=20)
    step = 7200
    series = dq.overview_series(store, PROJECT, since, until, step)
    rows = store.query(
        "SELECT toUnixTimestamp(toStartOfInterval(start_time, INTERVAL 7200 SECOND)) AS b, count(), avg(decode_ms), "
        "avg(queue_ms), quantileExact(0.95)(e2e_ms) "
        f"FROM {store.table('llm_requests')} FINAL WHERE project_id = {{project_id:UInt32}} "
        "AND start_time >= {since:DateTime64(6)} AND start_time < {until:DateTime64(6)} GROUP BY b",
        project_id=PROJECT, parameters={"since": since.replace(tzinfo=None), "until": until.replace(tzinfo=None)})
    expected = {int(b): (n, decode, queue, p95) for b, n, decode, queue, p95 in rows}
    assert len(expected) >= 12
    for i, t in enumerate(series["t"]):
        n, decode, queue, p95 = expected.get(t, (0, None, None, None))
        assert round(series["rate"][i] * step) == n, t
        if n:
            assert series["decode_ms_mean"][i] == pytest.approx(decode, rel=1e-9)
            assert series["queue_ms_mean"][i] == pytest.approx(queue, rel=1e-9)
            assert series["e2e_ms_p95"][i] == pytest.approx(p95, rel=0.05)
    groups = dq.group_series(store, PROJECT, since, until, step, ["baseline", "canary"])
    assert len(groups["e2e_p95"]) == 2 and any(v is not None for v in groups["e2e_p95"][1])
