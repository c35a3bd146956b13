"""The caches in the rollups (ch_migrations/0013, traces/rollups.CACHE_SUMS) and GET /api/v1/caches' figures
(traces/cache_queries): the same answer from the rows as from the hourly rollups and their totals; the engine's own
latency readable without the requests served from a cache."""
from __future__ import annotations

import datetime as dt
import time
import uuid

import pytest
from ingest.rows import CALL_COLUMNS, call_row
from test_decomposition import call, engine
from traces import cache_queries, ch_migrate, queries, rollups
from traces.request_builder import rebuild_traces
from traces.row_encoding import encode_rows
from traces.store import ClickHouseStore

from collectors.base import LLMCall

PROJECT = 5
HOUR_NS = 3_600 * 10**9
HOUR = (time.time_ns() // HOUR_NS - 3) * HOUR_NS  # a closed hour, three hours ago


def engine_request(trace: str, prompt: int, cached: int | None, e2e_ms: float, model: str = "llama") -> list[LLMCall]:
    g = call("g" + trace[:15], "", "gateway", 0, e2e_ms + 20, model=model, service="gw")
    e = engine("e" + trace[:15], g.span_id, 10, 10 + e2e_ms, engine_e2e_ms=e2e_ms, queue_ms=1.0,
               prefill_ms=e2e_ms / 10, decode_ms=e2e_ms / 2, prompt_tokens=prompt, cached_prompt_tokens=cached,
               model=model, service="vllm")
    return _in_trace(trace, [g, e])


def cache_hit(trace: str, served_from: str, e2e_ms: float, model: str = "llama") -> list[LLMCall]:
    return _in_trace(trace, [call("g" + trace[:15], "", "gateway", 0, e2e_ms, served_from=served_from,
                                  lookup_ms=1.5, model=model, prompt_tokens=900, service="gw")])


def _in_trace(trace: str, calls: list[LLMCall]) -> list[LLMCall]:
    for c in calls:
        c.trace_id = trace
        c.start_ns += HOUR + 60 * 10**9
        c.end_ns += HOUR + 60 * 10**9
    return calls


@pytest.fixture(scope="module")
def store(chdb_session_path):
    store = ClickHouseStore(url=None, chdb_path=chdb_session_path, database=f"cache_rollups_{uuid.uuid4().hex[:8]}")
    ch_migrate.apply(store, log=lambda *_: None)
    calls = (engine_request("a" * 32, 1000, 768, 800.0) + engine_request("b" * 32, 1000, 0, 1000.0)
             + engine_request("c" * 32, 400, None, 900.0) + engine_request("d" * 32, 300, 300, 500.0, model="qwen")
             + cache_hit("e" * 32, "exact_cache", 30.0) + cache_hit("f" * 32, "semantic_cache", 50.0))
    store.insert_encoded("llm_calls", CALL_COLUMNS, encode_rows([call_row(PROJECT, 30, c) for c in calls]),
                         "JSONCompactEachRow")
    assert rebuild_traces(store, PROJECT, sorted({c.trace_id for c in calls})) == 6
    yield store
    store.command(f"DROP DATABASE IF EXISTS `{store.database}` SYNC")
    store.close()


def series(store, **kwargs):
    since = dt.datetime.fromtimestamp(HOUR // 10**9, dt.timezone.utc)
    kwargs.setdefault("filters", {})
    kwargs.setdefault("by", None)
    return cache_queries.cache_series(store, PROJECT, since=since, until=since + dt.timedelta(hours=1),
                                      step=3600, **kwargs)


def by_key(buckets) -> dict:
    [bucket] = buckets
    return {tuple(group["key"].values()): group for group in bucket["groups"]}


def test_figures_from_the_rows_then_the_same_from_the_rollups(store):
    from_rows = {by: by_key(series(store, by=by)) for by in (None, "model", "replica_group")}
    overall = from_rows[None][()]
    assert overall["requests"] == 6
    assert overall["prompt_tokens"] == 1000 + 1000 + 400 + 300 + 900 + 900
    assert (overall["reported_prompt_tokens"], overall["cached_prompt_tokens"]) == (2300, 1068)
    assert overall["token_hit_ratio"] == pytest.approx(1068 / 2300)
    assert (overall["requests_reporting_cached"], overall["requests_with_hit"]) == (3, 2)
    assert overall["request_hit_ratio"] == pytest.approx(2 / 3)
    # prefill 80 + 100 + 50 ms over the prompt tokens computed: 232 + 1000 + 0 (the unreported request is left out)
    assert overall["prefill_ms_per_uncached_token"] == pytest.approx(230.0 / 1232)
    assert overall["engine"]["requests"] == 4
    exact, semantic = overall["response_cache"]["exact_cache"], overall["response_cache"]["semantic_cache"]
    assert (exact["requests"], exact["share"], exact["e2e_ms_p50"]) == (1, pytest.approx(1 / 6), pytest.approx(30.0))
    assert semantic["e2e_ms_p50"] == pytest.approx(50.0)
    assert exact["latency_saved_ms"] == pytest.approx(overall["engine"]["e2e_ms_p50"] - 30.0)
    assert set(from_rows["model"]) == {("llama",), ("qwen",)}
    assert from_rows["model"][("qwen",)]["token_hit_ratio"] == 1.0
    assert from_rows["model"][("qwen",)]["response_cache"]["exact_cache"] == {
        "requests": 0, "share": 0.0, "e2e_ms_p50": None, "latency_saved_ms": None}

    assert rollups.build_dirty_hours(store, PROJECT, settle_seconds=0) >= 1
    assert rollups.clean_hours(store, PROJECT, *(dt.datetime.fromtimestamp(t // 10**9, dt.timezone.utc)
                                                 for t in (HOUR, HOUR + 3600 * 10**9)))
    for by, expected in from_rows.items():
        assert by_key(series(store, by=by)) == expected, by  # totals (None, replica_group), hourly (model)


def test_the_engine_s_own_latency_leaves_the_cache_served_requests_out(store):
    rollups.build_dirty_hours(store, PROJECT, settle_seconds=0)
    since = dt.datetime.fromtimestamp(HOUR // 10**9 - 3600, dt.timezone.utc)
    for exact in (False, True):
        everything = queries.latency_summary(store, PROJECT, since=since, until=since + dt.timedelta(hours=3),
                                             group_by=["served_from"], filters={}, exact=exact)
        assert {g["key"]["served_from"]: g["count"] for g in everything} == {
            "engine": 4, "exact_cache": 1, "semantic_cache": 1}
        [engine_only] = queries.latency_summary(store, PROJECT, since=since, until=since + dt.timedelta(hours=3),
                                                group_by=[], filters={"served_from": "engine"}, exact=exact)
        assert engine_only["count"] == 4 and engine_only["queue_ms"]["p50"] == pytest.approx(1.0)


def test_bad_groups_and_filters_are_refused(store):
    with pytest.raises(ValueError):
        series(store, by="gateway")
    with pytest.raises(ValueError):
        series(store, filters={"gateway": "x"})


def test_migration_0013_backwards_restores_the_rollups_of_0012(make_store):
    """Forwards then backwards leaves the rollup tables as migrations 0001-0012 made them."""
    def shape(store):
        return store.system_query(
            "SELECT table, name, type, is_in_sorting_key FROM system.columns WHERE database = {db:String} "
            "AND table LIKE 'request_rollup%' ORDER BY table, position", parameters={"db": store.database})

    migrations = ch_migrate.discover()
    before, after = make_store("before"), make_store("after")
    for migration in migrations:
        if migration.number < 13:
            for statement in migration.forwards(ch_migrate.context_for(before)):
                before.command(statement)
        for statement in migration.forwards(ch_migrate.context_for(after)):
            after.command(statement)
    [m13] = [m for m in migrations if m.number == 13]
    for statement in m13.backwards(ch_migrate.context_for(after)):
        after.command(statement)
    assert shape(after) == shape(before)


def test_a_day_merges_the_hours_cache_sums_per_class(store):
    rollups.build_dirty_hours(store, PROJECT, settle_seconds=0)
    day = dt.datetime.fromtimestamp(HOUR // 10**9 // 86400 * 86400, dt.timezone.utc)
    rollups.build_day(store, PROJECT, day, source_version=1)
    sums = ", ".join(f"sum({c})" for c in rollups.CACHE_SUMS)
    rows = {table: store.query(
        f"SELECT served_from, sum(requests), {sums} FROM {store.table(table)} FINAL "
        "WHERE project_id = {project_id:UInt32} GROUP BY served_from ORDER BY served_from", project_id=PROJECT)
        for table in ("request_rollup_hourly", "request_rollup_daily", "request_rollup_hourly_totals")}
    assert rows["request_rollup_daily"] == rows["request_rollup_hourly"] == rows["request_rollup_hourly_totals"]
    assert [r[:3] for r in rows["request_rollup_daily"]] == [
        ("engine", 4, 2700), ("exact_cache", 1, 900), ("semantic_cache", 1, 900)]
