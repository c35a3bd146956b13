"""Hourly rollups of llm_requests, so summaries over long ranges merge a few states instead of scanning rows.

An hour is *clean* when its current build covers the newest request rows written for
it (request_rollup_builds.source_version >= request_hour_touches.version). Summaries
read clean whole hours from the rollup and everything else (range edges, the current
hour, hours touched by late spans) from llm_requests, merging t-digest states of both.
"""
from __future__ import annotations

import datetime as dt
import logging
import threading
import time

from .store import ClickHouseStore, StoreUnavailable

log = logging.getLogger(__name__)

ROLLUP_METRICS = ("e2e_ms", "ttft_ms", "tpot_ms", "network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms",
                  "gateway_ms")
# Means of the components (avg states, column mean_<metric>): the decomposition over time (ch_migrations/0011).
MEAN_METRICS = ("network_ms", "gateway_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")
MEAN_COLUMNS = tuple(f"mean_{m}" for m in MEAN_METRICS)
QUANTILES = "quantilesTDigest(0.5, 0.95, 0.99)"
DIMENSIONS = ("service", "model", "engine_config", "prompt_bucket", "replica_group", "served_from")
# The caches' sums (ch_migrations/0013): column -> its aggregate over request rows. A rollup of rollups sums them.
# Token hit ratio = sum_cached_prompt_tokens / sum_reported_prompt_tokens (the rows that report cached tokens);
# prefill time per computed prompt token = sum_prefill_ms / sum_uncached_prompt_tokens (engine rows knowing all three).
_PREFILL_KNOWN = ("served_from = 'engine' AND prefill_ms IS NOT NULL AND prompt_tokens IS NOT NULL "
                  "AND cached_prompt_tokens IS NOT NULL AND cached_prompt_tokens <= prompt_tokens")
CACHE_SUMS = {
    "sum_prompt_tokens": "sum(toUInt64(ifNull(prompt_tokens, 0)))",
    "sum_reported_prompt_tokens": "sumIf(toUInt64(ifNull(prompt_tokens, 0)), cached_prompt_tokens IS NOT NULL)",
    "sum_cached_prompt_tokens": "sum(toUInt64(ifNull(cached_prompt_tokens, 0)))",
    "cache_reported_requests": "countIf(cached_prompt_tokens IS NOT NULL)",
    "cache_hit_requests": "countIf(cached_prompt_tokens > 0)",
    "sum_prefill_ms": f"sumIf(ifNull(prefill_ms, 0), {_PREFILL_KNOWN})",
    "sum_uncached_prompt_tokens": f"sumIf(toUInt64(ifNull(prompt_tokens, 0) - ifNull(cached_prompt_tokens, 0)), "
                                  f"{_PREFILL_KNOWN})",
}
_CACHE_COLUMNS = ", ".join(CACHE_SUMS)


def ratio(part: float, whole: float) -> float | None:
    """part / whole; None when the whole is zero (nothing to divide)."""
    return part / whole if whole else None


def cache_figures(sums: dict[str, float]) -> dict[str, float | None]:
    """The prefix cache's ratios from CACHE_SUMS' sums: the token and request hit ratios (over the rows that report
    cached tokens) and the prefill time per prompt token the engine computed; None where a sum divided by is 0."""
    return {
        "token_hit_ratio": ratio(sums["sum_cached_prompt_tokens"], sums["sum_reported_prompt_tokens"]),
        "request_hit_ratio": ratio(sums["cache_hit_requests"], sums["cache_reported_requests"]),
        "prefill_ms_per_uncached_token": ratio(sums["sum_prefill_ms"], sums["sum_uncached_prompt_tokens"]),
    }


def _states(combinator: str) -> str:
    """Every rollup metric's quantile digest with this aggregate combinator (State, MergeState)."""
    digest = QUANTILES.replace("quantilesTDigest", "quantilesTDigest" + combinator)
    return ", ".join(f"{digest}({m})" for m in ROLLUP_METRICS)


def _columns(key: str, dims: str) -> str:
    """The column list of an INSERT into a rollup table: the project, its time ``key`` and ``dims``, the counts,
    the digests and means, the version and the retention."""
    return (f"(project_id, {key}, {dims}, requests, errors, {', '.join(ROLLUP_METRICS)}, {', '.join(MEAN_COLUMNS)}, "
            f"{_CACHE_COLUMNS}, version, retention_days) ")


def _summed() -> str:
    """The cache sums of a rollup merged from rollup rows."""
    return ", ".join(f"sum({column})" for column in CACHE_SUMS)


def _record_build(store: ClickHouseStore, table: str, key: str, project_id: int, start: dt.datetime, version: int,
                  source_version: int) -> None:
    """Note in ``table`` that the rollup of the hour or day ``start`` (``key``) is built at ``version`` from the
    rows of ``source_version``: the record that makes it clean."""
    store.insert_encoded(
        table,
        ("project_id", key, "version", "source_version"),
        f"[{project_id},{int(start.replace(tzinfo=dt.timezone.utc).timestamp())},{version},{source_version}]".encode(),
        "JSONCompactEachRow",
    )


def record_touches(store: ClickHouseStore, project_id: int, hours: set[int], version: int) -> None:
    """Note that request rows of these hours (epoch seconds, hour-aligned) changed at `version`."""
    if not hours:
        return
    rows = "\n".join(f"[{project_id},{hour},{version}]" for hour in sorted(hours))
    store.insert_encoded("request_hour_touches", ("project_id", "hour", "version"), rows.encode(), "JSONCompactEachRow")


def dirty_hours(store: ClickHouseStore, project_id: int, settled_before: dt.datetime, limit: int = 500) -> list[tuple[dt.datetime, int]]:
    """Closed hours whose rollup is missing or older than their rows: (hour, touch version)."""
    rows = store.query(
        f"SELECT t.hour, t.version FROM {store.table('request_hour_touches')} AS t FINAL "
        f"LEFT JOIN (SELECT hour, source_version FROM {store.table('request_rollup_builds')} FINAL "
        "            WHERE project_id = {project_id:UInt32}) AS b ON b.hour = t.hour "
        "WHERE t.project_id = {project_id:UInt32} AND t.hour + INTERVAL 1 HOUR <= {settled:DateTime} "
        "AND t.version > b.source_version ORDER BY t.hour LIMIT {limit:UInt32} "
        "SETTINGS join_use_nulls = 0",
        project_id=project_id,
        parameters={"settled": settled_before.replace(tzinfo=None), "limit": limit},
    )
    return [(hour, version) for hour, version in rows]


def build_hour(store: ClickHouseStore, project_id: int, hour: dt.datetime, source_version: int) -> None:
    version = time.time_ns()
    means = ", ".join(f"avgState({m})" for m in MEAN_METRICS)
    dims = ", ".join(DIMENSIONS)
    store.tenant_command(
        f"INSERT INTO {store.table('request_rollup_hourly')} {_columns('hour', dims)}"
        f"SELECT project_id, toStartOfHour(start_time), {dims}, count(), countIf(status = 'error'), {_states('State')}, "
        f"{means}, {', '.join(CACHE_SUMS.values())}, "
        "{version:UInt64}, max(retention_days) "
        f"FROM {store.table('llm_requests')} FINAL "
        "WHERE project_id = {project_id:UInt32} AND start_time >= {hour:DateTime64(6)} "
        "AND start_time < {hour:DateTime64(6)} + INTERVAL 1 HOUR "
        f"GROUP BY project_id, toStartOfHour(start_time), {dims}",
        project_id=project_id,
        parameters={"hour": hour.replace(tzinfo=None), "version": version},
    )
    # The hour per replica group and what served it, over the other dimensions (the dashboard's charts), merged
    # from the rows just written, before the build record that makes the hour clean.
    merged_means = ", ".join(f"avgMergeState({c})" for c in MEAN_COLUMNS)
    store.tenant_command(
        f"INSERT INTO {store.table('request_rollup_hourly_totals')} {_columns('hour', 'replica_group, served_from')}"
        f"SELECT project_id, hour, replica_group, served_from, sum(requests), sum(errors), {_states('MergeState')}, "
        f"{merged_means}, {_summed()}, "
        f"{{version:UInt64}}, max(retention_days) FROM {store.table('request_rollup_hourly')} "
        "WHERE project_id = {project_id:UInt32} AND hour = {hour:DateTime} AND version = {version:UInt64} "
        "GROUP BY project_id, hour, replica_group, served_from",
        project_id=project_id,
        parameters={"hour": hour.replace(tzinfo=None), "version": version},
    )
    _record_build(store, "request_rollup_builds", "hour", project_id, hour, version, source_version)


def build_dirty_hours(store: ClickHouseStore, project_id: int, settle_seconds: float = 120) -> int:
    """Rebuild stale hourly rollups, then the daily rollups whose hours are all current."""
    settled = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=settle_seconds)
    done = 0
    for hour, version in dirty_hours(store, project_id, settled):
        build_hour(store, project_id, hour, version)
        done += 1
    for day, version in dirty_days(store, project_id, settled):
        build_day(store, project_id, day, version)
        done += 1
    return done


def dirty_days(store: ClickHouseStore, project_id: int, settled_before: dt.datetime, limit: int = 100) -> list[tuple[dt.datetime, int]]:
    """Closed days whose touched hours are all clean and whose daily rollup is missing or stale."""
    rows = store.query(
        "SELECT t.day, t.version FROM ("
        "  SELECT toStartOfDay(th.hour) AS day, max(th.version) AS version, "
        "         countIf(hb.source_version < th.version) AS stale_hours "
        f"  FROM {store.table('request_hour_touches')} AS th FINAL "
        f"  LEFT JOIN (SELECT hour, source_version FROM {store.table('request_rollup_builds')} FINAL "
        "             WHERE project_id = {project_id:UInt32}) AS hb ON hb.hour = th.hour "
        "  WHERE th.project_id = {project_id:UInt32} GROUP BY day) AS t "
        f"LEFT JOIN (SELECT day, source_version FROM {store.table('request_rollup_daily_builds')} FINAL "
        "           WHERE project_id = {project_id:UInt32}) AS d ON d.day = t.day "
        "WHERE t.stale_hours = 0 AND t.day + INTERVAL 1 DAY <= {settled:DateTime} AND t.version > d.source_version "
        "ORDER BY t.day LIMIT {limit:UInt32} SETTINGS join_use_nulls = 0",
        project_id=project_id,
        parameters={"settled": settled_before.replace(tzinfo=None), "limit": limit},
    )
    return [(day, version) for day, version in rows]


def build_day(store: ClickHouseStore, project_id: int, day: dt.datetime, source_version: int) -> None:
    """Merge the day's current hourly states into one state per group."""
    version = time.time_ns()
    dims = ", ".join(DIMENSIONS)
    means = ", ".join(f"avgMergeState({c})" for c in MEAN_COLUMNS)
    store.tenant_command(
        f"INSERT INTO {store.table('request_rollup_daily')} {_columns('day', dims)}"
        f"SELECT project_id, toStartOfDay(hour), {dims}, sum(requests), sum(errors), {_states('MergeState')}, {means}, "
        f"{_summed()}, "
        "{version:UInt64}, max(retention_days) "
        f"FROM {store.table('request_rollup_hourly')} "
        "WHERE project_id = {project_id:UInt32} AND hour >= {day:DateTime} AND hour < {day:DateTime} + INTERVAL 1 DAY "
        "AND (hour, version) IN (SELECT hour, version FROM "
        f"     {store.table('request_rollup_builds')} FINAL WHERE project_id = {{project_id:UInt32}} "
        "     AND hour >= {day:DateTime} AND hour < {day:DateTime} + INTERVAL 1 DAY) "
        f"GROUP BY project_id, toStartOfDay(hour), {dims}",
        project_id=project_id,
        parameters={"day": day.replace(tzinfo=None), "version": version},
    )
    _record_build(store, "request_rollup_daily_builds", "day", project_id, day, version, source_version)


def clean_days(store: ClickHouseStore, project_id: int, first: dt.datetime, end: dt.datetime) -> list[tuple[int, int]]:
    """(day as epoch seconds, daily rollup version) of the days in [first, end) whose daily rollup is current."""
    if first >= end:
        return []
    rows = store.query(
        "SELECT toUnixTimestamp(d.day), d.version "
        f"FROM {store.table('request_rollup_daily_builds')} AS d FINAL "
        "INNER JOIN (SELECT toStartOfDay(hour) AS day, max(version) AS version "
        f"            FROM {store.table('request_hour_touches')} FINAL "
        "            WHERE project_id = {project_id:UInt32} AND hour >= {first:DateTime} AND hour < {end:DateTime} "
        "            GROUP BY day) AS t ON t.day = d.day "
        "WHERE d.project_id = {project_id:UInt32} AND d.day >= {first:DateTime} AND d.day < {end:DateTime} "
        "AND d.source_version >= t.version",
        project_id=project_id,
        parameters={"first": first.replace(tzinfo=None), "end": end.replace(tzinfo=None)},
    )
    return [(int(d), int(v)) for d, v in rows]


def clean_hours(store: ClickHouseStore, project_id: int, first: dt.datetime, end: dt.datetime) -> list[tuple[int, int]]:
    """(hour as epoch seconds, rollup version) of the clean hours in [first, end)."""
    if first >= end:
        return []
    rows = store.query(
        "SELECT toUnixTimestamp(b.hour), b.version "
        f"FROM {store.table('request_rollup_builds')} AS b FINAL "
        f"INNER JOIN (SELECT hour, version FROM {store.table('request_hour_touches')} FINAL "
        "             WHERE project_id = {project_id:UInt32} AND hour >= {first:DateTime} AND hour < {end:DateTime}) "
        "  AS t ON t.hour = b.hour "
        "WHERE b.project_id = {project_id:UInt32} AND b.hour >= {first:DateTime} AND b.hour < {end:DateTime} "
        "AND b.source_version >= t.version",
        project_id=project_id,
        parameters={"first": first.replace(tzinfo=None), "end": end.replace(tzinfo=None)},
    )
    return [(int(h), int(v)) for h, v in rows]


class RollupBuilder(threading.Thread):
    """Rebuilds the rollups of closed hours that changed, every `interval` seconds, for every project."""

    def __init__(self, store: ClickHouseStore, *, interval: float, settle_seconds: float, project_ids, schema=None):
        super().__init__(name="rollup-builder", daemon=True)
        self.store = store
        self.interval = interval
        self.settle_seconds = settle_seconds
        self.project_ids = project_ids  # callable returning the current project ids
        self.schema = schema
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                if self.schema is not None:
                    self.schema.ensure()
                for project_id in self.project_ids():
                    build_dirty_hours(self.store, project_id, self.settle_seconds)
            except StoreUnavailable as exc:
                log.warning("rollup builder: ClickHouse unavailable (%s)", exc)
            except Exception:
                log.exception("rollup builder failed; retrying next round")
