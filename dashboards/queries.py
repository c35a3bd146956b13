"""The dashboard's ClickHouse reads. Every query filters on the project and takes its values as parameters."""
from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
from typing import Any

from traces import queries as trace_queries
from traces import rollups
from traces.store import ClickHouseStore, string_set

from collectors.base import CACHE_CLASSES

# Time ranges of the pages: (label, seconds, bucket seconds of the charts, ~60-120 points each).
RANGES = {
    "15m": (900, 15),
    "1h": (3600, 60),
    "6h": (6 * 3600, 300),
    "24h": (86400, 900),
    "7d": (7 * 86400, 7200),
    "30d": (30 * 86400, 6 * 3600),
}
DEFAULT_RANGE = "1h"
COMPONENTS = ("network_ms", "gateway_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")
TAILS = ("e2e_ms", "ttft_ms", "tpot_ms")
BREAKDOWNS = ("model", "service", "engine_config", "replica_group", "prompt_bucket")
PROMPT_BUCKETS = ("<256", "<1k", "<4k", "<16k", ">=16k", "unknown")
EXPLORER_FILTERS = ("model", "service", "engine_config", "replica_group", "prompt_bucket", "status", "served_from")
SORTS = {"start_time": "toUnixTimestamp64Micro(start_time)", "e2e_ms": "ifNull(e2e_ms, -1)",
         "ttft_ms": "ifNull(ttft_ms, -1)", "tpot_ms": "ifNull(tpot_ms, -1)"}
PAGE_SIZE = 50


def _num(value: Any) -> float | None:
    if value is None or (isinstance(value, float) and (math.isnan(value) or math.isinf(value))):
        return None
    return float(value)


def _window(since: dt.datetime, until: dt.datetime) -> dict:
    return {"since": since.replace(tzinfo=None), "until": until.replace(tzinfo=None)}


def _hour_aligned(step: int) -> bool:
    return step % 3600 == 0


CACHE_SUMS = tuple(rollups.CACHE_SUMS)
# The series' prefix-cache columns: their figures of rollups.cache_figures.
_RATIOS = {"prefix_token_hit_ratio": "token_hit_ratio", "prefix_request_hit_ratio": "request_hit_ratio",
           "prefill_ms_per_uncached_token": "prefill_ms_per_uncached_token"}


def _fill(rows, since: dt.datetime, until: dt.datetime, step: int) -> dict[str, Any]:
    """Columns of equal length from rows of (t, served_from, count, errors, 3 tail arrays, 6 means, 6 p95s,
    the cache sums of CACHE_SUMS): request and error rates of all requests; the percentiles and components of the
    engine-served ones; each response-cache class's rate and e2e p50; the prefix cache's token and request hit
    ratios and the prefill time per computed prompt token."""
    by_t: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_t.setdefault(int(row[0]), {})[row[1]] = row
    start = int(since.timestamp()) // step * step
    out: dict[str, Any] = {"t": [], "rate": [], "errors": [], "since": int(since.timestamp()),
                           "until": int(until.timestamp())}
    for metric in TAILS:
        for q in ("p50", "p95", "p99"):
            out[f"{metric}_{q}"] = []
    for metric in COMPONENTS:
        out[f"{metric}_mean"] = []
        out[f"{metric}_p95"] = []
    for cls in CACHE_CLASSES:
        out[f"{cls}_rate"], out[f"{cls}_share"], out[f"{cls}_e2e_p50"] = [], [], []
    for name in _RATIOS:
        out[name] = []
    t = start
    while t < until.timestamp():
        out["t"].append(t)
        classes = by_t.get(t, {})
        count = sum(row[2] for row in classes.values())
        out["rate"].append(count / step)
        out["errors"].append(sum(row[3] for row in classes.values()) / step)
        row = classes.get("engine")
        column = 4
        for metric in TAILS:
            values = (row[column] if row and row[2] else None) or [None, None, None]
            for q, value in zip(("p50", "p95", "p99"), values):
                out[f"{metric}_{q}"].append(_num(value))
            column += 1
        for suffix in ("mean", "p95"):
            for metric in COMPONENTS:
                out[f"{metric}_{suffix}"].append(_num(row[column]) if row and row[2] else None)
                column += 1
        for cls in CACHE_CLASSES:
            hit = classes.get(cls)
            n = hit[2] if hit else 0
            out[f"{cls}_rate"].append(n / step)
            out[f"{cls}_share"].append(rollups.ratio(n, count))
            out[f"{cls}_e2e_p50"].append(_num(hit[4][0]) if n and hit[4] else None)
        sums = {name: sum(row[column + i] for row in classes.values()) for i, name in enumerate(CACHE_SUMS)}
        figures = rollups.cache_figures(sums)
        for name, key in _RATIOS.items():
            out[name].append(figures[key])
        t += step
    return out


def overview_series(store: ClickHouseStore, project_id: int, since: dt.datetime, until: dt.datetime,
                    step: int) -> dict[str, list]:
    """Per time bucket: request and error rates; p50/p95/p99 of e2e/TTFT/TPOT and the mean and p95 of each
    component over the engine-served requests (a response-cache hit would pass for a fast engine); per
    response-cache class its rate, share of the requests and e2e p50; the prefix cache's hit ratios (tokens and
    requests, over the rows that report cached tokens) and the prefill time per prompt token the engine computed.
    Columns of equal length (None where a bucket has no value), `t` in epoch seconds.

    Buckets of whole hours (7 and 30 days) merge the hourly rollups' states of the clean hours with states of the
    raw rows of the rest (t-digests and avg states, as the summaries do); shorter ones read the raw rows
    (bfloat16 quantiles: ~0.4% relative precision, a third cheaper than t-digests; the charts are coarser).
    One query either way: grouped by bucket and what served the request."""
    window = _window(since, until)
    sums = ", ".join(f"sum({name})" for name in CACHE_SUMS)
    if _hour_aligned(step):
        levels = "0.5, 0.95, 0.99"
        rollup_cols = ", ".join([f"{m} AS s_{m}" for m in TAILS + COMPONENTS]
                                + [f"mean_{m} AS a_{m}" for m in COMPONENTS] + list(CACHE_SUMS))
        raw_cols = ", ".join([f"quantilesTDigestState({levels})({m}) AS s_{m}" for m in TAILS + COMPONENTS]
                             + [f"avgState({m}) AS a_{m}" for m in COMPONENTS]
                             + [f"{expr} AS {name}" for name, expr in rollups.CACHE_SUMS.items()])
        # The totals rows (one per hour, replica group and what served): ~100x fewer states than the hourly rollups'.
        union, params = trace_queries.rollup_union(store, project_id, since, until, step, rollup_cols, raw_cols,
                                      extra_dims="served_from", table="request_rollup_hourly_totals")
        tails = ", ".join(f"quantilesTDigestMerge({levels})(s_{m})" for m in TAILS)
        means = ", ".join(f"avgMerge(a_{m})" for m in COMPONENTS)
        p95s = ", ".join(f"quantilesTDigestMerge({levels})(s_{m})[2]" for m in COMPONENTS)
        rows = store.query(
            f"SELECT b, served_from, sum(n), sum(errs), {tails}, {means}, {p95s}, {sums} FROM ({union}) "
            "GROUP BY b, served_from SETTINGS do_not_merge_across_partitions_select_final = 1",
            project_id=project_id, parameters=params,
        )
        return _fill(rows, since, until, step)
    tails = ", ".join(f"quantilesBFloat16(0.5, 0.95, 0.99)({m})" for m in TAILS)
    means = ", ".join(f"avg({m})" for m in COMPONENTS)
    p95s = ", ".join(f"quantileBFloat16(0.95)({m})" for m in COMPONENTS)
    rows = store.query(
        f"SELECT toUnixTimestamp(toStartOfInterval(start_time, INTERVAL {{step:UInt32}} SECOND)) AS t, served_from, "
        f"count(), countIf(status = 'error'), {tails}, {means}, {p95s}, {', '.join(rollups.CACHE_SUMS.values())} "
        f"FROM {store.table('llm_requests')} FINAL "
        "WHERE project_id = {project_id:UInt32} AND start_time >= {since:DateTime64(6)} "
        "AND start_time < {until:DateTime64(6)} GROUP BY t, served_from "
        "SETTINGS do_not_merge_across_partitions_select_final = 1",
        project_id=project_id, parameters={"step": step, **window},
    )
    return _fill(rows, since, until, step)


def group_series(store: ClickHouseStore, project_id: int, since: dt.datetime, until: dt.datetime, step: int,
                 groups: list[str]) -> dict[str, Any]:
    """p95 of e2e and TTFT per time bucket for each replica group (baseline and canary side by side), over the
    engine-served requests (the groups' engines compared, not their response caches)."""
    if _hour_aligned(step):
        levels = "0.5, 0.95, 0.99"
        union, params = trace_queries.rollup_union(
            store, project_id, since, until, step, "e2e_ms AS s_e2e, ttft_ms AS s_ttft",
            f"quantilesTDigestState({levels})(e2e_ms) AS s_e2e, quantilesTDigestState({levels})(ttft_ms) AS s_ttft",
            extra_dims="replica_group",
            where=f" AND replica_group IN {{groups:Array(String)}} AND {trace_queries.ENGINE_SERVED}",
            params={"groups": groups}, table="request_rollup_hourly_totals")
        rows = store.query(
            f"SELECT b, replica_group, sum(n), quantilesTDigestMerge({levels})(s_e2e)[2], "
            f"quantilesTDigestMerge({levels})(s_ttft)[2] FROM ({union}) GROUP BY b, replica_group ORDER BY b "
            "SETTINGS do_not_merge_across_partitions_select_final = 1",
            project_id=project_id, parameters=params,
        )
    else:
        rows = store.query(
            f"SELECT toUnixTimestamp(toStartOfInterval(start_time, INTERVAL {{step:UInt32}} SECOND)) AS t, "
            "replica_group, count(), quantileBFloat16(0.95)(e2e_ms), quantileBFloat16(0.95)(ttft_ms) "
            f"FROM {store.table('llm_requests')} FINAL WHERE project_id = {{project_id:UInt32}} "
            "AND start_time >= {since:DateTime64(6)} AND start_time < {until:DateTime64(6)} "
            f"AND replica_group IN {{groups:Array(String)}} AND {trace_queries.ENGINE_SERVED} GROUP BY t, replica_group "
            "ORDER BY t SETTINGS do_not_merge_across_partitions_select_final = 1",
            project_id=project_id, parameters={"step": step, "groups": groups, **_window(since, until)},
        )
    cells = {(int(t), g): (n, _num(e2e), _num(ttft)) for t, g, n, e2e, ttft in rows}
    start = int(since.timestamp()) // step * step
    times = list(range(start, int(until.timestamp()), step)) or [start]
    return {
        "t": times,
        "groups": groups,
        "e2e_p95": [[cells.get((t, g), (0, None, None))[1] for t in times] for g in groups],
        "ttft_p95": [[cells.get((t, g), (0, None, None))[2] for t in times] for g in groups],
    }


def _cache_figures(requests: int, errors: int, cached: int, sums: dict[str, float]) -> dict[str, Any]:
    return {
        "requests": requests, "errors": errors, "cache_served": cached, "cache_share": rollups.ratio(cached, requests),
        **rollups.cache_figures(sums), "requests_reporting_cached": sums["cache_reported_requests"],
    }


def breakdown_caches(store: ClickHouseStore, project_id: int, since: dt.datetime,
                     until: dt.datetime) -> dict[str, dict[str, dict]]:
    """Per breakdown dimension and value, and for the whole range (dimension "all", value ""): all requests, their
    errors, those a response cache served, the prefix cache's token and request hit ratios (over the requests that report cached
    tokens) and the prefill time per prompt token the engine computed. One pass over the hourly rollups of the
    clean hours and the rows of the rest (sums only: no digest is merged)."""
    dims = ", ".join(BREAKDOWNS)
    union, params = trace_queries.rollup_union(
        store, project_id, since, until, 3600, ", ".join(f"{c} AS c_{c}" for c in CACHE_SUMS),
        ", ".join(f"{expr} AS c_{c}" for c, expr in rollups.CACHE_SUMS.items()),
        extra_dims=f"{dims}, served_from")
    # Each row counted once per dimension, and once more for the whole range.
    pairs = ", ".join([f"('{d}', {d})" for d in BREAKDOWNS] + ["('all', '')"])
    rows = store.query(
        f"SELECT pair.1, pair.2, sum(n), sum(errs), sumIf(n, served_from != 'engine'), "
        f"{', '.join(f'sum(c_{c})' for c in CACHE_SUMS)} FROM ({union}) ARRAY JOIN [{pairs}] AS pair "
        "GROUP BY pair.1, pair.2 SETTINGS do_not_merge_across_partitions_select_final = 1",
        project_id=project_id, parameters=params)
    out: dict[str, dict[str, dict]] = {d: {} for d in (*BREAKDOWNS, "all")}
    for dimension, value, requests, errors, cached, *figures in rows:
        out[dimension][value] = _cache_figures(requests, errors, cached, dict(zip(CACHE_SUMS, figures)))
    return out


# -- the requests explorer ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where a page of the explorer ends: the sort value, trace id and request key of its last row."""

    value: float
    trace_id: str
    request_key: str

    _FORM = re.compile(r"^(-?[0-9]{1,20}(?:\.[0-9]{1,20})?(?:e[-+]?[0-9]{1,3})?)~([0-9a-f]{32})~([0-9A-Za-z]{1,64})$")

    def encode(self) -> str:
        return f"{self.value!r}~{self.trace_id}~{self.request_key}" if isinstance(self.value, float) else \
            f"{self.value}~{self.trace_id}~{self.request_key}"

    @classmethod
    def decode(cls, text: str) -> "Cursor":
        match = cls._FORM.match(text or "")
        if match is None:
            raise ValueError("not a page cursor of this explorer")
        raw = match.group(1)
        return cls(float(raw) if ("." in raw or "e" in raw) else int(raw), match.group(2), match.group(3))


EXPLORER_COLUMNS = ("start_time", "trace_id", "request_key", "service", "model", "engine_config", "replica_group",
                    "gateway", "prompt_bucket", "prompt_tokens", "completion_tokens", "status", "e2e_ms", "ttft_ms",
                    "tpot_ms", "network_ms", "queue_ms", "prefill_ms", "decode_ms", "joined_by", "cached_prompt_tokens",
                    "served_from", "lookup_ms")


def explore(store: ClickHouseStore, project_id: int, *, since: dt.datetime, until: dt.datetime,
            filters: dict[str, str], min_e2e: float | None, min_ttft: float | None, sort: str, descending: bool,
            after: Cursor | None) -> tuple[list[dict], Cursor | None]:
    """One page of request rows (PAGE_SIZE), sorted by `sort` then trace id and request key (keyset pagination:
    `after` is the last row of the page before); returns the rows and the cursor of the next page (None: last)."""
    key = SORTS[sort]
    clauses = ["project_id = {project_id:UInt32}", "start_time >= {since:DateTime64(6)}",
               "start_time < {until:DateTime64(6)}"]
    params: dict[str, Any] = _window(since, until)
    for name in EXPLORER_FILTERS:
        if filters.get(name) is not None:
            clauses.append(f"{name} = {{f_{name}:String}}")
            params[f"f_{name}"] = filters[name]
    if min_e2e is not None:
        clauses.append("e2e_ms >= {min_e2e:Float64}")
        params["min_e2e"] = min_e2e
    if min_ttft is not None:
        clauses.append("ttft_ms >= {min_ttft:Float64}")
        params["min_ttft"] = min_ttft
    order = "DESC" if descending else "ASC"
    if after is not None:
        clauses.append(f"({key}, trace_id, request_key) {'<' if descending else '>'} "
                       "({after_value:Float64}, {after_trace:String}, {after_key:String})")
        params.update(after_value=float(after.value), after_trace=after.trace_id, after_key=after.request_key)
    columns = ", ".join(EXPLORER_COLUMNS)
    rows = store.query(
        f"SELECT {columns}, {key} FROM {store.table('llm_requests')} FINAL WHERE {' AND '.join(clauses)} "
        f"ORDER BY {key} {order}, trace_id {order}, request_key {order} LIMIT {PAGE_SIZE + 1} "
        "SETTINGS do_not_merge_across_partitions_select_final = 1",
        project_id=project_id, parameters=params,
    )
    items = []
    for row in rows[:PAGE_SIZE]:
        item = {name: (_num(value) if name.endswith("_ms") else value) for name, value in zip(EXPLORER_COLUMNS, row)}
        item["_sort"] = row[-1]
        items.append(item)
    following = None
    if len(rows) > PAGE_SIZE:
        last = items[-1]
        value = last["_sort"]
        following = Cursor(int(value) if sort == "start_time" else float(value), last["trace_id"],
                           last["request_key"])
    return items, following


def distinct_values(store: ClickHouseStore, project_id: int, since: dt.datetime, until: dt.datetime) -> dict[str, list]:
    """The values each label takes in the range, for the explorer's filter choices (at most 200 each)."""
    names = ("model", "service", "engine_config", "replica_group")
    selects = ", ".join(f"arraySort(groupUniqArray(200)({n}))" for n in names)
    rows = store.query(
        f"SELECT {selects} FROM {store.table('llm_requests')} WHERE project_id = {{project_id:UInt32}} "
        "AND start_time >= {since:DateTime64(6)} AND start_time < {until:DateTime64(6)} AND is_deleted = 0",
        project_id=project_id, parameters=_window(since, until),
    )
    row = rows[0] if rows else [[] for _ in names]
    return {name: [v for v in values if v] for name, values in zip(names, row)}


# -- a trace ---------------------------------------------------------------------------------------------------
def spans_of(store: ClickHouseStore, project_id: int, trace_ids: list[str], span_ids: list[str]) -> dict[str, dict]:
    """The stored spans with these ids (the hops of a trace's requests), by span id."""
    if not span_ids:
        return {}
    in_traces, traces = string_set("traces", sorted(set(trace_ids)))
    in_spans, spans = string_set("spans", sorted(set(span_ids)))
    rows = store.query(
        f"SELECT span_id, trace_id, name, kind, service_name, scope_name, status_code, status_message, "
        f"toUnixTimestamp64Nano(start_time), toUnixTimestamp64Nano(end_time), attributes "
        f"FROM {store.table('spans')} WHERE project_id = {{project_id:UInt32}} AND trace_id IN {in_traces} "
        f"AND span_id IN {in_spans}",
        project_id=project_id, parameters={"traces": traces, "spans": spans},
    )
    out = {}
    for span_id, trace_id, name, kind, service, scope, code, message, start, end, attributes in rows:
        out[span_id] = {"trace_id": trace_id, "name": name, "kind": kind, "service": service, "scope": scope,
                        "status_code": code, "status_message": message, "start_ns": int(start), "end_ns": int(end),
                        "attributes": sorted(dict(attributes).items())}
    return out
