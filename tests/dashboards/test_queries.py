"""The dashboard's queries against a real (embedded) ClickHouse: the breakdowns of the overview in one pass equal
one summary per dimension; the explorer's keyset pages cover every row once, in order; the charts' and breakdowns'
cache figures (engine-served percentiles, response-cache classes, prefix-cache hit ratios) equal the rows'."""
from __future__ import annotations

import datetime as dt

import pytest
from traces import ch_migrate, rollups
from traces import queries as tq
from traces.seed import seed_requests

from dashboards import queries as dq

PROJECT = 3
# Rows the seeding adds to the synthetic fleet (traces.seed): engine rows that report prefix-cache hits (half their
# prompt cached before the collapse, none after) and rows the gateway answered from its response cache. Their
# latencies spread a little and two thirds are the engine's: a median that falls between two point masses of equal
# weight (half at 4 ms, half at 900 ms) is any value between them, and two t-digest merge orders then disagree.
_CACHE_ROWS = (
    "INSERT INTO {table} (project_id, trace_id, request_key, request_id, start_time, service, model, engine_config, "
    "replica_group, prompt_tokens, completion_tokens, prompt_bucket, e2e_ms, ttft_ms, tpot_ms, network_ms, "
    "overhead_ms, queue_ms, prefill_ms, decode_ms, hops, status, version, is_deleted, retention_days, "
    "cached_prompt_tokens, served_from, lookup_ms) "
    "SELECT {{project_id:UInt32}}, lower(hex(sipHash128(number, 'cache'))), lower(hex(sipHash64(number, 'cache'))), '', "
    "fromUnixTimestamp64Micro(toInt64({{start_us:Int64}} + number * {{step_us:Int64}})), 'chat-app', "
    "'meta-llama/Llama-3.1-8B-Instruct', 'stable', 'baseline', 1000, 50, '<1k', "
    "if(cls = 'engine', 880 + number % 41, 4 + number % 5 * 0.01), if(cls = 'engine', 200, 3), "
    "if(cls = 'engine', 14, NULL), 1, "
    "if(cls = 'engine', 9, 2), if(cls = 'engine', 10, 0), if(cls = 'engine', 200, 0), if(cls = 'engine', 680, 0), "
    "'[]', 'ok', {{version:UInt64}}, 0, 30, "
    "if(cls = 'engine', if(start_time < {{collapse:DateTime64(6)}}, 500, 0), NULL), cls, if(cls = 'engine', NULL, 1) "
    "FROM (SELECT number, ['engine', 'engine', 'exact_cache', 'engine', 'engine', 'semantic_cache'][number % 6 + 1] AS cls, "
    "      fromUnixTimestamp64Micro(toInt64({{start_us:Int64}} + number * {{step_us:Int64}})) AS start_time "
    "      FROM numbers({{rows:UInt64}}))"
)


@pytest.fixture(scope="module")
def seeded(chdb_session_path):
    from traces.store import ClickHouseStore

    store = ClickHouseStore(url=None, chdb_path=chdb_session_path, database="t_dashboard_queries")
    ch_migrate.apply(store, log=lambda *_: None)
    end = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    start = end - dt.timedelta(hours=30)
    version = seed_requests(store, PROJECT, rows=20_000, start=start, end=end)
    store.tenant_command(_CACHE_ROWS.format(table=store.table("llm_requests")), project_id=PROJECT, parameters={
        "start_us": int(start.timestamp() * 1e6), "step_us": 30 * 3600 * 1_000_000 // 4000, "rows": 4000,
        "version": version, "collapse": (end - dt.timedelta(hours=10)).replace(tzinfo=None)})
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


@pytest.mark.parametrize("step", [7200, 900])
def test_charts_equal_the_rows_with_caches_as_their_own_class(seeded, step):
    """7/30-day charts (2 h buckets) merge the clean hours' rollup states with the raw rows of the rest, shorter ones
    read the rows: the counts, means and cache figures equal those of the rows, the percentiles within t-digest or
    bfloat16 error; percentiles and components are the engine-served requests' (a cache hit is no fast engine)."""
    store, end = seeded
    since, until = end - dt.timedelta(hours=26, minutes=30), end + dt.timedelta(minutes=20)
    series = dq.overview_series(store, PROJECT, since, until, step)
    rows = store.query(
        f"SELECT toUnixTimestamp(toStartOfInterval(start_time, INTERVAL {step} SECOND)) AS b, count(), "
        "avgIf(decode_ms, served_from = 'engine'), avgIf(queue_ms, served_from = 'engine'), "
        "quantileExactIf(0.95)(e2e_ms, served_from = 'engine'), countIf(served_from = 'exact_cache'), "
        "quantileExactIf(0.5)(e2e_ms, served_from = 'semantic_cache'), "
        "sum(cached_prompt_tokens) / sumIf(prompt_tokens, cached_prompt_tokens IS NOT NULL), "
        "countIf(cached_prompt_tokens > 0) / countIf(cached_prompt_tokens IS NOT NULL) "
        f"FROM {store.table('llm_requests')} FINAL WHERE project_id = {{project_id:UInt32}} "
        "AND start_time >= {since:DateTime64(6)} AND start_time < {until:DateTime64(6)} GROUP BY b",
        project_id=PROJECT, parameters={"since": since.replace(tzinfo=None), "until": until.replace(tzinfo=None)})
    expected = {int(row[0]): row[1:] for row in rows}
    assert len(expected) >= 12
    ratios = set()
    for i, t in enumerate(series["t"]):
        n, decode, queue, p95, exact, semantic_p50, token_ratio, request_ratio = expected.get(t, (0,) + (None,) * 7)
        assert round(series["rate"][i] * step) == n, t
        if n:
            assert series["decode_ms_mean"][i] == pytest.approx(decode, rel=1e-9)
            assert series["queue_ms_mean"][i] == pytest.approx(queue, rel=1e-9)
            assert series["e2e_ms_p95"][i] == pytest.approx(p95, rel=0.05)
            assert round(series["exact_cache_rate"][i] * step) == exact
            assert series["exact_cache_share"][i] == pytest.approx(exact / n, rel=1e-9)
            assert series["semantic_cache_e2e_p50"][i] == pytest.approx(semantic_p50, rel=0.05)
            assert series["prefix_token_hit_ratio"][i] == pytest.approx(token_ratio, rel=1e-9)
            assert series["prefix_request_hit_ratio"][i] == pytest.approx(request_ratio, rel=1e-9)
            ratios.add(round(series["prefix_token_hit_ratio"][i], 1))
    assert ratios >= {0.0, 0.5}  # before the collapse, and after it
    engine_prefill = series["prefill_ms_per_uncached_token"]
    assert {round(v, 6) for v in engine_prefill if v is not None} >= {round(200 / 500, 6), round(200 / 1000, 6)}
    groups = dq.group_series(store, PROJECT, since, until, step, ["baseline", "canary"])
    assert len(groups["e2e_p95"]) == 2 and any(v is not None for v in groups["e2e_p95"][1])


def test_breakdown_cache_figures_equal_the_rows(seeded):
    store, end = seeded
    since, until = end - dt.timedelta(hours=26, minutes=30), end + dt.timedelta(minutes=5)
    figures = dq.breakdown_caches(store, PROJECT, since, until)
    for dimension in (*dq.BREAKDOWNS, "all"):
        rows = store.query(
            f"SELECT {dimension if dimension != 'all' else chr(39) * 2} AS v, count(), countIf(served_from != 'engine'), "
            "sum(cached_prompt_tokens) / sumIf(prompt_tokens, cached_prompt_tokens IS NOT NULL), "
            "countIf(cached_prompt_tokens > 0) / countIf(cached_prompt_tokens IS NOT NULL), "
            "sumIf(prefill_ms, cached_prompt_tokens IS NOT NULL AND served_from = 'engine') "
            "/ sumIf(prompt_tokens - cached_prompt_tokens, cached_prompt_tokens IS NOT NULL AND served_from = 'engine') "
            f"FROM {store.table('llm_requests')} FINAL WHERE project_id = {{project_id:UInt32}} "
            "AND start_time >= {since:DateTime64(6)} AND start_time < {until:DateTime64(6)} GROUP BY v",
            project_id=PROJECT, parameters={"since": since.replace(tzinfo=None), "until": until.replace(tzinfo=None)})
        assert sorted(figures[dimension]) == sorted(row[0] for row in rows), dimension
        for value, n, cached, token_ratio, request_ratio, prefill in rows:
            got = figures[dimension][value]
            assert (got["requests"], got["cache_served"]) == (n, cached), (dimension, value)
            for name, want in (("token_hit_ratio", token_ratio), ("request_hit_ratio", request_ratio),
                               ("prefill_ms_per_uncached_token", prefill)):
                if want is None or want != want:  # NULL or NaN: no row of the group reports cached tokens
                    assert got[name] is None, (dimension, value, name)
                else:
                    assert got[name] == pytest.approx(want, rel=1e-9), (dimension, value, name)
    assert 0 < figures["all"][""]["cache_share"] < 0.1
    assert figures["service"]["batch"]["token_hit_ratio"] is None  # reports no cached tokens: unknown, not 0
