"""ClickHouse queries behind the JSON API; every one filters on the project and takes values as parameters."""
from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any

from . import rollups
from .store import ClickHouseStore

GROUP_DIMENSIONS = ("model", "service", "prompt_bucket", "engine_config", "replica_group", "gateway", "served_from")
FILTER_DIMENSIONS = ("model", "service", "engine_config", "prompt_bucket", "replica_group", "gateway", "served_from")
# The SQL condition of an engine-served row (llm_requests.served_from; rows written before response caches existed
# read 'engine' too): what the engine's own latency is measured over.
ENGINE_SERVED = "served_from = 'engine'"
TAIL_METRICS = ("e2e_ms", "ttft_ms", "tpot_ms")  # p50/p95/p99
COMPONENT_METRICS = ("network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")  # p50/p95
LEVELS = (0.5, 0.95, 0.99)
TDIGEST_ERROR_NOTE = (
    "ClickHouse quantilesTDigest: relative rank error typically under 1% (worse only for groups with very "
    "few requests); pass exact=1 for exact percentiles"
)

REQUEST_FIELDS = (
    "trace_id", "request_key", "request_id", "start_time", "service", "model", "engine_config", "replica_group", "gateway",
    "prompt_tokens",
    "completion_tokens", "prompt_bucket", "e2e_ms", "ttft_ms", "engine_ttft_ms", "tpot_ms", "network_ms",
    "network_client_gateway_ms", "network_gateway_engine_ms", "gateway_ms", "overhead_ms", "queue_ms", "prefill_ms",
    "decode_ms", "hops", "status", "joined_by", "linked_trace_ids", "cached_prompt_tokens", "served_from", "lookup_ms",
)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dt.datetime):
        return value.replace(tzinfo=dt.timezone.utc).isoformat().replace("+00:00", "Z") if value.tzinfo is None else value.isoformat()
    return value


def requests_for_trace(store: ClickHouseStore, project_id: int, trace_id: str) -> list[dict]:
    """The request rows of a trace: its own, and those joined across traces that hold some of its hops."""
    columns = ", ".join(REQUEST_FIELDS)
    rows = store.query(
        f"SELECT {columns} FROM {store.table('llm_requests')} FINAL "
        "WHERE project_id = {project_id:UInt32} "
        "AND (trace_id = {trace_id:String} OR has(linked_trace_ids, {trace_id:String})) "
        "ORDER BY start_time, request_key",
        project_id=project_id,
        parameters={"trace_id": trace_id},
    )
    out = []
    for row in rows:
        item = {name: _clean(value) for name, value in zip(REQUEST_FIELDS, row)}
        item["hops"] = json.loads(item["hops"] or "[]")
        item["linked_trace_ids"] = list(item["linked_trace_ids"] or ())
        item["network_ms_per_hop"] = {
            "client_gateway": item.pop("network_client_gateway_ms"),
            "gateway_engine": item.pop("network_gateway_engine_ms"),
        }
        out.append(item)
    return out


def _filters(filters: dict[str, str]) -> tuple[str, dict[str, Any]]:
    clauses = []
    params: dict[str, Any] = {}
    for name in FILTER_DIMENSIONS:
        value = filters.get(name)
        if value is not None:
            clauses.append(f"{name} = {{f_{name}:String}}")
            params[f"f_{name}"] = value
    return "".join(f" AND {c}" for c in clauses), params


def _hour_floor(t: dt.datetime) -> dt.datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def _uncovered_ranges(since: dt.datetime, until: dt.datetime, clean_hours: list[int]) -> list[tuple[dt.datetime, dt.datetime]]:
    """The parts of [since, until) not covered by the clean hours (epoch seconds, sorted)."""
    ranges = []
    cursor = since
    for hour in clean_hours:
        start = dt.datetime.fromtimestamp(hour, dt.timezone.utc)
        if start > cursor:
            ranges.append((cursor, start))
        cursor = max(cursor, start + dt.timedelta(hours=1))
    if cursor < until:
        ranges.append((cursor, until))
    return ranges


def rollup_union(store: ClickHouseStore, project_id: int, since: dt.datetime, until: dt.datetime, step: int,
                  rollup_cols: str, raw_cols: str, extra_dims: str = "", where: str = "",
                  params: dict | None = None, table: str = "request_rollup_hourly") -> tuple[str, dict]:
    """A subquery of per-bucket states (`b`: the bucket's start, epoch seconds): the hourly rollups (`table`) of the
    clean hours in the range, and the raw rows of the rest (range edges, the current hour, hours touched since
    their rollup was built). Rollups are read only when `step` is a whole number of hours (an hour then lies in one
    bucket); otherwise every row is read. `rollup_cols` and `raw_cols` give the same states from either side,
    after `n` (requests) and `errs`."""
    params = dict(params or {})
    first_hour = since.replace(minute=0, second=0, microsecond=0)
    if first_hour < since:
        first_hour += dt.timedelta(hours=1)
    last_hour = until.replace(minute=0, second=0, microsecond=0)
    hours = rollups.clean_hours(store, project_id, first_hour, last_hour) if step % 3600 == 0 else []
    ranges = _uncovered_ranges(since, until, sorted(h for h, _ in hours))
    params["clean"] = hours
    raw = []
    for i, (start, end) in enumerate(ranges):
        params[f"r{i}_start"], params[f"r{i}_end"] = start.replace(tzinfo=None), end.replace(tzinfo=None)
        raw.append(f"(start_time >= {{r{i}_start:DateTime64(6)}} AND start_time < {{r{i}_end:DateTime64(6)}})")
    dims = f", {extra_dims}" if extra_dims else ""
    sql = (
        f"SELECT toUnixTimestamp(toStartOfInterval(hour, INTERVAL {{step:UInt32}} SECOND)) AS b{dims}, "
        f"requests AS n, errors AS errs, {rollup_cols} FROM {store.table(table)} "
        "WHERE project_id = {project_id:UInt32} AND (toUnixTimestamp(hour), version) IN "
        f"{{clean:Array(Tuple(UInt32, UInt64))}}{where} "
        "UNION ALL "
        f"SELECT toUnixTimestamp(toStartOfInterval(start_time, INTERVAL {{step:UInt32}} SECOND)) AS b{dims}, "
        f"count() AS n, countIf(status = 'error') AS errs, {raw_cols} FROM {store.table('llm_requests')} FINAL "
        f"WHERE project_id = {{project_id:UInt32}} AND ({' OR '.join(raw) if raw else '0'}){where} "
        f"GROUP BY b{dims}"
    )
    params["step"] = step
    return sql, params


def latency_summary(store: ClickHouseStore, project_id: int, *, since: dt.datetime, until: dt.datetime,
                    group_by: list[str], filters: dict[str, str], exact: bool = False,
                    separately: bool = False, metrics: tuple[str, ...] | None = None) -> list[dict]:
    """Per group: count, errors, p50/p95/p99 of e2e/ttft/tpot and p50/p95 of each component.

    t-digest mode merges the hourly rollup states of clean whole hours with states computed
    from the raw rows of everything else; exact mode reads raw rows only, and so does a summary
    grouped or filtered by `gateway` (the rollups do not carry it: ch_migrations/0010).

    `separately`: one breakdown per dimension of `group_by` instead of one over their combination,
    in the same pass (GROUPING SETS); each group's key then holds its own dimension only.
    `metrics`: only these of TAIL_METRICS + COMPONENT_METRICS (the others are left out of the groups);
    merging fewer t-digest states is most of what a shorter list saves.
    """
    for name in group_by:
        if name not in GROUP_DIMENSIONS:
            raise ValueError(f"cannot group by {name!r}")
    if separately and exact:
        raise ValueError("separate breakdowns are t-digest summaries")
    metrics = tuple(m for m in TAIL_METRICS + COMPONENT_METRICS if metrics is None or m in metrics)
    levels = ", ".join(str(q) for q in LEVELS)
    dims = ", ".join(group_by)
    select_dims = dims + ", " if dims else ""
    group_clause = f" GROUP BY {dims} ORDER BY {dims}" if dims else ""
    if separately and group_by:
        # grouping(all dims) as a bitmask says which set a row belongs to (1 = the dimension is grouped on).
        select_dims = dims + ", "
        sets = ", ".join(f"({name})" for name in group_by)
        group_clause = f" GROUP BY GROUPING SETS ({sets})"
    where, params = _filters(filters)
    params.update(since=since.replace(tzinfo=None), until=until.replace(tzinfo=None))
    raw_where = (
        "WHERE project_id = {project_id:UInt32} AND start_time >= {since:DateTime64(6)} "
        f"AND start_time < {{until:DateTime64(6)}}{where}"
    )
    final = " SETTINGS do_not_merge_across_partitions_select_final = 1"
    if exact:
        # quantilesExact over no values answers 0; say "not observed" (NaN → null) instead.
        aggregates = ", ".join(f"if(count({m}) > 0, quantilesExact({levels})({m}), [nan, nan, nan])" for m in metrics)
        sql = (
            f"SELECT {select_dims}count(), countIf(status = 'error'), {aggregates} "
            f"FROM {store.table('llm_requests')} FINAL {raw_where}{group_clause}{final}"
        )
    else:
        first_hour = _hour_floor(since)
        if first_hour < since:
            first_hour += dt.timedelta(hours=1)
        last_hour = _hour_floor(until)
        first_day = first_hour.replace(hour=0)
        if first_day < first_hour:
            first_day += dt.timedelta(days=1)
        if "gateway" in group_by or "gateway" in filters:
            days, hours = [], []
        else:
            days = rollups.clean_days(store, project_id, first_day, last_hour.replace(hour=0) + dt.timedelta(days=1))
            days = [(day, v) for day, v in days if day + 86400 <= last_hour.timestamp()]
            hours = [
                (hour, v) for hour, v in rollups.clean_hours(store, project_id, first_hour, last_hour)
                if hour - hour % 86400 not in {day for day, _ in days}
            ]
        day_starts = {day for day, _ in days}
        params["clean_days"] = days
        params["clean"] = hours
        covered = sorted([hour for hour, _ in hours] + [day + h * 3600 for day in day_starts for h in range(24)])
        ranges = _uncovered_ranges(since, until, covered)
        range_sql = []
        for i, (start, end) in enumerate(ranges):
            params[f"r{i}_start"], params[f"r{i}_end"] = start.replace(tzinfo=None), end.replace(tzinfo=None)
            range_sql.append(f"(start_time >= {{r{i}_start:DateTime64(6)}} AND start_time < {{r{i}_end:DateTime64(6)}})")
        raw_where = (
            "WHERE project_id = {project_id:UInt32} AND "
            f"({' OR '.join(range_sql) if range_sql else '0'}){where}"
        )
        states = ", ".join(f"quantilesTDigestState({levels})({m}) AS s_{m}" for m in metrics)
        rollup_states = ", ".join(f"{m} AS s_{m}" for m in metrics)
        merged = ", ".join(f"quantilesTDigestMerge({levels})(s_{m})" for m in metrics)
        parts = []
        if days or hours:
            parts += [
                f"SELECT {select_dims}requests AS n, errors AS errs, {rollup_states} "
                f"FROM {store.table('request_rollup_daily')} "
                "WHERE project_id = {project_id:UInt32} "
                f"AND (toUnixTimestamp(day), version) IN {{clean_days:Array(Tuple(UInt32, UInt64))}}{where} ",
                f"SELECT {select_dims}requests AS n, errors AS errs, {rollup_states} "
                f"FROM {store.table('request_rollup_hourly')} "
                "WHERE project_id = {project_id:UInt32} "
                f"AND (toUnixTimestamp(hour), version) IN {{clean:Array(Tuple(UInt32, UInt64))}}{where} ",
            ]
        parts.append(
            f"SELECT {select_dims}count() AS n, countIf(status = 'error') AS errs, {states} "
            f"FROM {store.table('llm_requests')} FINAL {raw_where}"
            f"{' GROUP BY ' + dims if dims else ''}"
        )
        outer_dims = select_dims
        if separately and group_by:
            outer_dims = f"{dims}, grouping({dims}), "
        sql = f"SELECT {outer_dims}sum(n), sum(errs), {merged} FROM ({'UNION ALL '.join(parts)}){group_clause}{final}"
    rows = store.query(sql, project_id=project_id, parameters=params)
    if separately and group_by:
        out = []
        n = len(group_by)
        for row in rows:
            mask = row[n]
            if row[n + 1] <= 0:
                continue
            # grouping(a, b, c) marks dimension i by bit (n-1-i): set for the one grouped on, or (the SQL standard's
            # sense, force_grouping_standard_compatibility) for the aggregated ones; either way one bit stands out.
            marked = [i for i in range(n) if mask & (1 << (n - 1 - i))]
            unmarked = [i for i in range(n) if i not in marked]
            if len(marked) == 1:
                index = marked[0]
            elif len(unmarked) == 1:
                index = unmarked[0]
            else:
                continue
            group = _summary_group([group_by[index]], [row[index], *row[n + 1:]], metrics)
            out.append(group)
        return out
    return [_summary_group(group_by, row, metrics) for row in rows if row[len(group_by)] > 0]


def _summary_group(group_by: list[str], row, metrics: tuple[str, ...] = TAIL_METRICS + COMPONENT_METRICS) -> dict:
    n = len(group_by)
    group = {"key": {name: row[i] for i, name in enumerate(group_by)}, "count": row[n], "errors": row[n + 1]}
    values = row[n + 2 :]
    for metric, quantiles in zip(metrics, values):
        keep = 3 if metric in TAIL_METRICS else 2
        group[metric] = {f"p{int(q * 100)}": _clean(float(v)) for q, v in zip(LEVELS[:keep], quantiles[:keep])}
    return group
