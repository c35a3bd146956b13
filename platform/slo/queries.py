"""The slo app's ClickHouse SQL: SLI counts per 5-minute bucket, window counts for many SLOs at once, the status series.

How a window is counted without scanning 30 days of raw rows:
- `slo_sli_buckets` holds (total, bad) per SLI and 5-minute bucket, built per closed hour for every
  SLI of a project in one pass over that hour (one INSERT … SELECT with a countIf pair per SLI).
- An hour's buckets are current while their build covers the newest request rows written for the
  hour (`slo_sli_builds.source_version >= request_hour_touches.version`, the rollups' touches
  scheme): late spans that change an hour make it dirty and it is built again.
- Evaluation at second T sums the current buckets that lie wholly inside each window
  (one query, sumIf per window), and reads raw rows only for what buckets cannot answer: hours not
  built yet (the current one, recently closed ones, dirty ones) and the partial 5-minute bucket at
  the start of each window (one query grouped by minute and bucket, a countIf pair per SLI). Windows
  are whole minutes, so every window starts at T's second of the minute: the raw rows' minutes are
  counted from that second on (12:00:17 to 12:01:17, …), and each window takes whole ones.
An SLI counts engine-served rows only (`served_from = 'engine'`: the gateway's response-cache hits never reached
the engine) unless its SLO sets `include_cached`, which is part of its sli_key.

The SLI `engine_model_error` counts live checks of a group's engine model, not requests: one row per check in
`engine_model_checks` (written through `insert_model_check` by tuning/checks.py). A check is one row per group and
check interval, so its windows are counted from the rows directly (`model_check_counts`), without buckets.
Every statement filters on the project and binds values as parameters; column names come from
allow-lists.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import time
from typing import Any

import orjson
from traces.queries import ENGINE_SERVED
from traces.store import ClickHouseStore, utc_naive

from .burn import WindowCounts
from .definitions import FILTER_DIMENSIONS

MINUTE = dt.timedelta(minutes=1)
BUCKET = dt.timedelta(minutes=5)
HOUR = dt.timedelta(hours=1)
# SLI → the request column it reads; ttft falls back to the engine's TTFT when no outer hop reported one.
METRIC_SQL = {
    "ttft_ms": "coalesce(ttft_ms, engine_ttft_ms)",
    "tpot_ms": "tpot_ms",
    "e2e_ms": "e2e_ms",
    "queue_ms": "queue_ms",
}
FILTER_COLUMNS = FILTER_DIMENSIONS  # columns of llm_requests
MODEL_ERROR_SLI = "engine_model_error"
MODEL_CHECK_COLUMNS = ("project_id", "ts", "replica_group", "model_id", "config_version", "worst_error",
                       "ttft_p50_error", "prefill_p50_error", "tpot_p50_error", "requests", "moved")


@dataclasses.dataclass(frozen=True)
class SliDefinition:
    """What an SLO counts: its SLI, threshold and filters (several SLOs may share one)."""

    key: int
    sli: str
    threshold_ms: float | None
    filters: tuple[tuple[str, tuple[str, ...]], ...]
    # False: engine-served requests only (served_from = 'engine'); True: the gateway's response-cache hits too.
    include_cached: bool = False
    threshold: float | None = None  # engine_model_error: the largest |relative error| of a good check

    @classmethod
    def of(cls, slo) -> SliDefinition:
        filters = tuple(sorted((k, tuple(sorted(v))) for k, v in (slo.filters or {}).items() if v))
        return cls(slo.sli_key, slo.sli, slo.threshold_ms, filters, bool(slo.include_cached), slo.threshold)

    @property
    def counts_model_checks(self) -> bool:
        return self.sli == MODEL_ERROR_SLI


def floor_time(t: dt.datetime, step: dt.timedelta) -> dt.datetime:
    epoch = dt.datetime(1970, 1, 1, tzinfo=t.tzinfo)
    return t - (t - epoch) % step


def sli_conditions(definitions: list[SliDefinition], params: dict[str, Any]) -> list[tuple[str, str]]:
    """(valid-request condition, bad-request condition) SQL per definition; filter values and thresholds
    are added to `params`."""
    out = []
    for i, d in enumerate(definitions):
        if d.counts_model_checks:
            raise ValueError("engine_model_error counts model checks (model_check_counts), not request rows")
        # A request the gateway answered from its response cache never reached the engine: an engine SLO does not
        # count it (its fast answer would pass for a fast engine) unless the SLO opts in.
        clauses = [] if d.include_cached else [ENGINE_SERVED]
        for column, values in d.filters:
            if column not in FILTER_COLUMNS:
                raise ValueError(f"unknown filter {column!r}")
            params[f"s{i}_{column}"] = list(values)
            clauses.append(f"{column} IN {{s{i}_{column}:Array(String)}}")
        if d.sli == "error_ratio":
            bad = "status = 'error'"
        else:
            metric = METRIC_SQL[d.sli]
            clauses.append(f"{metric} IS NOT NULL")
            params[f"s{i}_t"] = float(d.threshold_ms)
            bad = f"{metric} > {{s{i}_t:Float64}}"
        valid = " AND ".join(clauses) or "1"
        out.append((valid, bad))
    return out


def _count_pairs(conditions: list[tuple[str, str]]) -> str:
    return ", ".join(f"countIf({valid}), countIf({valid} AND {bad})" for valid, bad in conditions)


# -- building buckets ---------------------------------------------------------------------------------
def dirty_hours(store: ClickHouseStore, project_id: int, keys: list[int], since: dt.datetime,
                settled_before: dt.datetime) -> list[tuple[int, dt.datetime, int]]:
    """(sli_key, hour, touch version) of closed hours with request rows whose buckets are missing or older
    than the rows, newest hours first. All of them: one left out would be counted from neither buckets nor
    raw rows."""
    if not keys:
        return []
    rows = store.query(
        "SELECT ks.k, t.hour, t.version FROM "
        f"(SELECT hour, version FROM {store.table('request_hour_touches')} FINAL "
        " WHERE project_id = {project_id:UInt32} AND hour >= {since:DateTime} "
        " AND hour + INTERVAL 1 HOUR <= {settled:DateTime}) AS t "
        "CROSS JOIN (SELECT arrayJoin({keys:Array(UInt64)}) AS k) AS ks "
        f"LEFT JOIN (SELECT sli_key, hour, source_version FROM {store.table('slo_sli_builds')} FINAL "
        "           WHERE project_id = {project_id:UInt32} AND sli_key IN {keys:Array(UInt64)} "
        "           AND hour >= {since:DateTime}) AS b ON b.sli_key = ks.k AND b.hour = t.hour "
        "WHERE t.version > b.source_version ORDER BY t.hour DESC, ks.k "
        "SETTINGS join_use_nulls = 0",
        project_id=project_id,
        parameters={"since": utc_naive(since), "settled": utc_naive(settled_before), "keys": keys},
    )
    return [(int(k), hour, int(version)) for k, hour, version in rows]


def build_buckets(store: ClickHouseStore, project_id: int, definitions: list[SliDefinition],
                  pairs: list[tuple[int, dt.datetime, int]]) -> None:
    """Rebuild the buckets of these (sli_key, hour, touch version) in one pass over their hours."""
    if not pairs:
        return
    by_key = {d.key: d for d in definitions}
    keys = sorted({k for k, _, _ in pairs if k in by_key})
    if not keys:
        return
    defs = [by_key[k] for k in keys]
    params: dict[str, Any] = {}
    conditions = sli_conditions(defs, params)
    hours = sorted({h for _, h, _ in pairs})
    version = time.time_ns()
    per_key = ", ".join(
        f"tuple(toUInt64({{key{i}:UInt64}}), countIf({valid}), countIf({valid} AND {bad}))"
        for i, (valid, bad) in enumerate(conditions)
    )
    for i, key in enumerate(keys):
        params[f"key{i}"] = key
    params.update(
        hours=[utc_naive(h) for h in hours],
        lo=utc_naive(hours[0]),
        hi=utc_naive(hours[-1] + HOUR),
        pairs=[(k, utc_naive(h)) for k, h, _ in pairs if k in by_key],
        version=version,
    )
    store.tenant_command(
        f"INSERT INTO {store.table('slo_sli_buckets')} "
        "(project_id, sli_key, bucket, total, bad, version, retention_days) "
        "SELECT {project_id:UInt32}, kv.1, bucket, kv.2, kv.3, {version:UInt64}, retention "
        "FROM (SELECT toStartOfFiveMinutes(start_time) AS bucket, max(retention_days) AS retention, "
        f"       [{per_key}] AS per_key "
        f"      FROM {store.table('llm_requests')} FINAL "
        "      WHERE project_id = {project_id:UInt32} AND start_time >= {lo:DateTime64(6)} "
        "      AND start_time < {hi:DateTime64(6)} AND toStartOfHour(start_time) IN {hours:Array(DateTime)} "
        "      GROUP BY bucket) "
        "ARRAY JOIN per_key AS kv "
        "WHERE kv.2 > 0 AND (kv.1, toStartOfHour(bucket)) IN {pairs:Array(Tuple(UInt64, DateTime))} "
        "SETTINGS do_not_merge_across_partitions_select_final = 1",
        project_id=project_id,
        parameters=params,
    )
    # After the buckets, so a reader that sees this build also sees its buckets.
    rows = "\n".join(
        f"[{project_id},{k},{int(h.replace(tzinfo=dt.timezone.utc).timestamp()) if h.tzinfo is None else int(h.timestamp())},"
        f"{version},{source}]"
        for k, h, source in pairs if k in by_key
    )
    store.insert_encoded("slo_sli_builds", ("project_id", "sli_key", "hour", "version", "source_version"),
                         rows.encode(), "JSONCompactEachRow")


# -- counting windows ---------------------------------------------------------------------------------
def window_counts(store: ClickHouseStore, project_id: int, definitions: list[SliDefinition],
                  windows: list[dt.timedelta], at: dt.datetime, *, open_from: dt.datetime,
                  dirty: set[tuple[int, dt.datetime]]) -> dict[int, dict[dt.timedelta, WindowCounts]]:
    """Counts of every definition over every window [at − window, at), `at` a whole second and every window a
    whole number of minutes.

    Hours from `open_from` on, and the (sli_key, hour) pairs in `dirty`, are read from raw rows;
    everything else from the buckets of the current builds.
    """
    if not definitions or not windows:
        return {}
    at = utc_naive(at)
    if at.microsecond or any(w % MINUTE for w in windows):
        raise ValueError("window counts need `at` on a whole second and windows of whole minutes")
    # Raw rows are counted per minute starting at `at`'s second, on which every window starts too.
    shift = (at - floor_time(at, MINUTE)).seconds
    open_from = utc_naive(open_from)
    dirty = {(k, utc_naive(h)) for k, h in dirty}
    keys = [d.key for d in definitions]
    longest = max(windows)
    lo = at - longest
    totals: dict[int, dict[dt.timedelta, list[int]]] = {k: {w: [0, 0] for w in windows} for k in keys}

    # 1. whole buckets of current builds, one sumIf pair per window
    params: dict[str, Any] = {
        "keys": keys, "lo": lo, "open_from": open_from, "dirty": _hour_ranges(dirty),
    }
    sums = []
    for j, window in enumerate(windows):
        params[f"w{j}"] = at - window
        sums.append(f"sumIf(total, bucket >= {{w{j}:DateTime}}), sumIf(bad, bucket >= {{w{j}:DateTime}})")
    rows = store.query(
        f"SELECT sli_key, {', '.join(sums)} FROM {store.table('slo_sli_buckets')} "
        "WHERE project_id = {project_id:UInt32} AND sli_key IN {keys:Array(UInt64)} "
        "AND bucket >= {lo:DateTime} AND bucket < {open_from:DateTime} "
        "AND (sli_key, toStartOfHour(bucket), version) IN ("
        f"  SELECT sli_key, hour, version FROM {store.table('slo_sli_builds')} FINAL "
        "   WHERE project_id = {project_id:UInt32} AND sli_key IN {keys:Array(UInt64)} AND hour >= {lo_hour:DateTime}) "
        "AND NOT arrayExists(r -> r.1 = sli_key AND bucket >= r.2 AND bucket < r.3, "
        "                   {dirty:Array(Tuple(UInt64, DateTime, DateTime))}) "
        "GROUP BY sli_key",
        project_id=project_id,
        parameters={**params, "lo_hour": floor_time(lo, HOUR)},
    )
    for row in rows:
        key = int(row[0])
        for j, window in enumerate(windows):
            cell = totals[key][window]
            cell[0] += int(row[1 + 2 * j])
            cell[1] += int(row[2 + 2 * j])

    # 2. raw rows where buckets cannot answer, per minute
    ranges = _raw_ranges(windows, at, open_from, {h for _, h in dirty}, lo)
    if ranges:
        raw_params: dict[str, Any] = {"shift": shift}
        conditions = sli_conditions(definitions, raw_params)
        range_sql = []
        for i, (start, end) in enumerate(ranges):
            raw_params[f"r{i}_start"], raw_params[f"r{i}_end"] = start, end
            range_sql.append(f"(start_time >= {{r{i}_start:DateTime64(6)}} AND start_time < {{r{i}_end:DateTime64(6)}})")
        rows = store.query_json(
            "SELECT toUnixTimestamp(toStartOfMinute(start_time - toIntervalSecond({shift:UInt8}))) + {shift:UInt8} "
            "AS minute, toUnixTimestamp(toStartOfFiveMinutes(start_time)) AS bucket, "
            f"{_count_pairs(conditions)} FROM {store.table('llm_requests')} FINAL "
            f"WHERE project_id = {{project_id:UInt32}} AND ({' OR '.join(range_sql)}) "
            "GROUP BY minute, bucket ORDER BY minute, bucket",
            project_id=project_id,
            parameters=raw_params,
        )
        window_starts = [(w, at - w) for w in windows]
        epoch = dt.datetime(1970, 1, 1)
        for row in rows:
            # a minute from `at`'s second on, within one 5-minute bucket (a minute that straddles two comes twice)
            minute = epoch + dt.timedelta(seconds=row[0])
            bucket = epoch + dt.timedelta(seconds=row[1])
            hour = floor_time(bucket, HOUR)
            in_open = hour >= open_from
            for i, key in enumerate(keys):
                valid, bad = row[2 + 2 * i], row[3 + 2 * i]
                if not valid:
                    continue
                built = not in_open and (key, hour) not in dirty
                per_window = totals[key]
                for window, start in window_starts:
                    # a minute belongs to a window it lies in, unless the window takes its whole bucket
                    # from the bucket table
                    if minute >= start and not (built and bucket >= start):
                        cell = per_window[window]
                        cell[0] += valid
                        cell[1] += bad
    return {k: {w: WindowCounts(c[0], c[1]) for w, c in per.items()} for k, per in totals.items()}


def _hour_ranges(pairs: set[tuple[int, dt.datetime]]) -> list[tuple[int, dt.datetime, dt.datetime]]:
    """(sli_key, hour) pairs as (sli_key, start, end) runs of consecutive hours: a new SLO's backfill is one
    run per SLI instead of 720 pairs, which keeps the bound parameter small (it travels in the URL over HTTP)."""
    out: list[list] = []
    for key, hour in sorted(pairs):
        if out and out[-1][0] == key and out[-1][2] == hour:
            out[-1][2] = hour + HOUR
        else:
            out.append([key, hour, hour + HOUR])
    return [tuple(r) for r in out]


def _raw_ranges(windows: list[dt.timedelta], at: dt.datetime, open_from: dt.datetime, dirty_hours: set[dt.datetime],
                lo: dt.datetime) -> list[tuple[dt.datetime, dt.datetime]]:
    """The time ranges whose raw rows are needed, merged: open hours, dirty hours, window-start edges."""
    spans = []
    if open_from < at:
        spans.append((max(open_from, lo), at))
    for hour in dirty_hours:
        if hour + HOUR > lo and hour < at:
            spans.append((max(hour, lo), min(hour + HOUR, at)))
    for window in windows:
        start = at - window
        edge_end = floor_time(start, BUCKET)
        if edge_end < start:
            edge_end += BUCKET
        if start < edge_end:
            spans.append((start, min(edge_end, at)))
    spans.sort()
    merged: list[list[dt.datetime]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged if s < e]


# -- engine model checks (the SLI engine_model_error) ------------------------------------------------------
def _ms_time(t: dt.datetime) -> str:
    return utc_naive(t).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def insert_model_check(store: ClickHouseStore, project_id: int, check: dict) -> None:
    """One live check of a group's engine model: {at, group, model_id, config_version, worst_error, ttft_p50_error,
    prefill_p50_error, tpot_p50_error, requests, moved}."""
    insert_model_checks(store, project_id, [check])


def insert_model_checks(store: ClickHouseStore, project_id: int, checks: list[dict]) -> None:
    """Checks (as insert_model_check takes them) in one insert."""
    if not checks:
        return
    lines = [orjson.dumps([
        project_id, _ms_time(check["at"]), check["group"], int(check["model_id"]), check["config_version"],
        float(check["worst_error"]), check.get("ttft_p50_error"), check.get("prefill_p50_error"),
        check.get("tpot_p50_error"),
        int(check.get("requests") or 0), {k: float(v) for k, v in (check.get("moved") or {}).items()},
    ]) for check in checks]
    store.insert_encoded("engine_model_checks", MODEL_CHECK_COLUMNS, b"\n".join(lines), "JSONCompactEachRow")


def model_check_counts(store: ClickHouseStore, project_id: int, definitions: list[SliDefinition],
                       windows: list[dt.timedelta], at: dt.datetime) -> dict[int, dict[dt.timedelta, WindowCounts]]:
    """(checks, bad checks) of every engine_model_error definition over every window [at − window, at): a check is
    bad when its worst |error| is above the definition's threshold.

    One query over the project's checks in the longest window, grouped by replica group and by how many of the
    windows (all ending at `at`, so nested) start after the check, with a bad count per distinct threshold; each
    definition then sums the groups it selects into the windows that hold them. Its cost follows the thresholds, not
    definitions × windows."""
    definitions = [d for d in definitions if d.counts_model_checks]
    if not definitions or not windows:
        return {}
    at = utc_naive(at)
    windows = sorted(windows)
    thresholds = sorted({float(d.threshold) for d in definitions})
    params: dict[str, Any] = {"lo": at - windows[-1], "at": at, "starts": [at - w for w in windows]}
    bads = []
    for i, threshold in enumerate(thresholds):
        params[f"t{i}"] = threshold
        bads.append(f"countIf(worst_error > {{t{i}:Float64}})")
    rows = store.query(
        "SELECT replica_group, arrayCount(s -> ts < s, {starts:Array(DateTime64(3))}) AS outside, count(), "
        f"{', '.join(bads)} FROM {store.table('engine_model_checks')} FINAL "
        "WHERE project_id = {project_id:UInt32} AND ts >= {lo:DateTime64(3)} AND ts < {at:DateTime64(3)} "
        "GROUP BY replica_group, outside",
        project_id=project_id, parameters=params,
    )
    out: dict[int, dict[dt.timedelta, WindowCounts]] = {}
    for d in definitions:
        groups = dict(d.filters).get("replica_group")
        bad_column = 3 + thresholds.index(float(d.threshold))
        cells = [[0, 0] for _ in windows]
        for row in rows:
            if groups and row[0] not in groups:
                continue
            for j in range(int(row[1]), len(windows)):  # the windows that start at or before the check
                cells[j][0] += int(row[2])
                cells[j][1] += int(row[bad_column])
        out[d.key] = {w: WindowCounts(*cell) for w, cell in zip(windows, cells)}
    return out


def model_check_summary(store: ClickHouseStore, project_id: int, *, groups: list[str] | None, since: dt.datetime,
                        until: dt.datetime, threshold: float) -> list[dict]:
    """Per group, the live checks in [since, until): how many, how many above `threshold`, the latest one and the
    latest bad one (time, model, config version, worst, p50 TTFT, prefill and TPOT errors, requests, what moved); the groups
    with most bad checks first."""
    params: dict[str, Any] = {"since": utc_naive(since), "until": utc_naive(until), "t": float(threshold)}
    where = ""
    if groups:
        params["groups"] = list(groups)
        where = " AND replica_group IN {groups:Array(String)}"
    figures = ("model_id", "config_version", "worst_error", "ttft_p50_error", "prefill_p50_error", "tpot_p50_error",
               "requests", "moved")
    bad = "worst_error > {t:Float64}"
    rows = store.query(
        "SELECT replica_group, count(), countIf(" + bad + "), toUnixTimestamp64Milli(max(ts)), "
        + ", ".join(f"argMax({f}, ts)" for f in figures) + ", "
        + f"toUnixTimestamp64Milli(maxIf(ts, {bad})), "
        + ", ".join(f"argMaxIf({f}, ts, {bad})" for f in figures) + " "
        f"FROM {store.table('engine_model_checks')} FINAL "
        "WHERE project_id = {project_id:UInt32} AND ts >= {since:DateTime64(3)} AND ts < {until:DateTime64(3)}"
        + where + " GROUP BY replica_group ORDER BY countIf(" + bad + ") DESC, replica_group",
        project_id=project_id, parameters=params,
    )
    out = []
    n = len(figures)
    for row in rows:
        group, checks, bad_checks = row[0], int(row[1]), int(row[2])

        def check(at_ms, values) -> dict:
            return {"at": dt.datetime.fromtimestamp(at_ms / 1000, dt.timezone.utc).isoformat().replace("+00:00", "Z"),
                    **{f: (dict(v) if f == "moved" else v) for f, v in zip(figures, values)}}

        out.append({"group": group, "checks": checks, "bad": bad_checks, "latest": check(row[3], row[4:4 + n]),
                    "latest_bad": check(row[4 + n], row[5 + n:5 + 2 * n]) if bad_checks else None})
    return out


# -- status series ------------------------------------------------------------------------------------
def insert_status(store: ClickHouseStore, project_id: int, points: list[dict], retention_days: int) -> None:
    """One point per SLO evaluation: {slo_id, at, state, firing_tier, severity, budget_remaining,
    burn_rates, totals, bads}."""
    if not points:
        return
    lines = []
    version = time.time_ns()
    for p in points:
        at = p["at"]
        lines.append(orjson.dumps([
            project_id, p["slo_id"], int(at.timestamp()), version, p["state"], p["firing_tier"], p["severity"],
            p["budget_remaining"], {k: v for k, v in p["burn_rates"].items() if v is not None},
            p["totals"], p["bads"], retention_days,
        ]))
    store.insert_encoded(
        "slo_status",
        ("project_id", "slo_id", "at", "version", "state", "firing_tier", "severity", "budget_remaining", "burn_rates",
         "totals", "bads", "retention_days"),
        b"\n".join(lines), "JSONCompactEachRow",
    )


def status_series(store: ClickHouseStore, project_id: int, slo_id: int, since: dt.datetime, until: dt.datetime,
                  limit: int) -> list[dict]:
    """Status points of one SLO in [since, until), oldest first (the newest `limit` of them)."""
    rows = store.query_json(
        "SELECT * FROM (SELECT toUnixTimestamp(at) AS t, state, firing_tier, severity, budget_remaining, burn_rates, "
        f"totals, bads FROM {store.table('slo_status')} FINAL "
        "WHERE project_id = {project_id:UInt32} AND slo_id = {slo_id:UInt64} "
        # DateTime64: a whole-second `until` (12:01:00 for 12:01:00.4) would drop the point of the current
        # minute, stamped 12:01:00, during the first second after the minute turns.
        "AND at >= {since:DateTime64(6)} AND at < {until:DateTime64(6)} ORDER BY at DESC LIMIT {limit:UInt32}) "
        "ORDER BY t",
        project_id=project_id,
        parameters={"slo_id": slo_id, "since": utc_naive(since), "until": utc_naive(until), "limit": limit},
    )
    out = []
    for t, state, firing_tier, severity, budget, burn_rates, totals, bads in rows:
        out.append({
            "at": dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z"),
            "state": state,
            "firing_tier": firing_tier or None,
            "severity": severity or None,
            "budget_remaining": budget,
            "burn_rates": burn_rates,
            "counts": {label: {"total": totals.get(label, 0), "bad": bads.get(label, 0)} for label in totals},
        })
    return out
