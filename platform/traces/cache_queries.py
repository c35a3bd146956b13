"""Cache figures over time (GET /api/v1/caches): the engine's prefix-cache hit ratios and the gateway's response
cache, per time bucket and group, from the hourly rollups where whole hours are clean and the rows elsewhere.

Latency saved by a response-cache class in a bucket and group: the p50 e2e of the engine-served requests of the same
bucket and group minus the class's p50 e2e (requests are comparable when they share the model, service, replica
group or prompt bucket the figures are grouped by; null when either side has no request). t-digest p50s, as the
summaries' (queries.TDIGEST_ERROR_NOTE).
"""
from __future__ import annotations

import datetime as dt
from typing import Any

from collectors.base import CACHE_CLASSES

from . import queries, rollups
from .store import ClickHouseStore

GROUPS = ("model", "service", "replica_group", "prompt_bucket")
FILTERS = ("model", "service", "engine_config", "prompt_bucket", "replica_group")
_SUMS = tuple(rollups.CACHE_SUMS)
_LEVELS = "0.5, 0.95, 0.99"


def latency_saved(engine_p50: float | None, p50: float | None) -> float | None:
    """What a response-cache class saved per request: the engine-served p50 e2e minus the class's own (None when
    either is unknown)."""
    return engine_p50 - p50 if engine_p50 is not None and p50 is not None else None


def _p50(value: Any) -> float | None:
    return queries._clean(float(value)) if value is not None else None


def cache_series(store: ClickHouseStore, project_id: int, *, since: dt.datetime, until: dt.datetime, step: int,
                 by: str | None, filters: dict[str, str]) -> list[dict]:
    """[{t, groups: [...]}] for every bucket of `step` seconds from the one holding `since` to `until`."""
    if by is not None and by not in GROUPS:
        raise ValueError(f"cannot group cache figures by {by!r}")
    if set(filters) - set(FILTERS):
        raise ValueError(f"cache figures filter on {', '.join(FILTERS)} only")
    dims = f"{by}, served_from" if by else "served_from"
    # The totals rollup (one row per hour, replica group and class) serves whatever needs no other dimension.
    totals = by in (None, "replica_group") and set(filters) <= {"replica_group"}
    where, params = queries._filters(filters)
    union, params = queries.rollup_union(
        store, project_id, since, until, step,
        ", ".join([f"{c} AS c_{c}" for c in _SUMS] + ["e2e_ms AS s_e2e"]),
        ", ".join([f"{expr} AS c_{c}" for c, expr in rollups.CACHE_SUMS.items()]
                  + [f"quantilesTDigestState({_LEVELS})(e2e_ms) AS s_e2e"]),
        extra_dims=dims, where=where, params=params,
        table="request_rollup_hourly_totals" if totals else "request_rollup_hourly")
    rows = store.query(
        f"SELECT b, {dims}, sum(n), {', '.join(f'sum(c_{c})' for c in _SUMS)}, "
        f"quantilesTDigestMerge({_LEVELS})(s_e2e)[1] FROM ({union}) GROUP BY b, {dims} ORDER BY b "
        "SETTINGS do_not_merge_across_partitions_select_final = 1",
        project_id=project_id, parameters=params)
    cells: dict[int, dict[str, dict[str, tuple]]] = {}  # bucket -> group key -> class -> figures
    for row in rows:
        t, key = int(row[0]), (row[1] if by else "")
        served_from, figures = row[2 if by else 1], row[3 if by else 2:]
        cells.setdefault(t, {}).setdefault(key, {})[served_from] = figures
    buckets = []
    t = int(since.timestamp()) // step * step
    while t < until.timestamp():
        groups = [_group(by, key, classes) for key, classes in sorted(cells.get(t, {}).items())]
        buckets.append({"t": dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z"),
                        "groups": groups})
        t += step
    return buckets


def _group(by: str | None, key: str, classes: dict[str, tuple]) -> dict:
    """One group's figures from its rows per class: (requests, the CACHE_SUMS in order, p50 e2e)."""
    totals = [sum(figures[i] for figures in classes.values()) for i in range(1 + len(_SUMS))]
    requests, sums = totals[0], dict(zip(_SUMS, totals[1:]))
    engine = classes.get("engine")
    engine_p50 = _p50(engine[-1]) if engine else None
    response_cache = {}
    for name in CACHE_CLASSES:
        figures = classes.get(name)
        p50 = _p50(figures[-1]) if figures else None
        response_cache[name] = {
            "requests": figures[0] if figures else 0,
            "share": rollups.ratio(figures[0], requests) if figures else 0.0,
            "e2e_ms_p50": p50,
            "latency_saved_ms": latency_saved(engine_p50, p50),
        }
    ratios = rollups.cache_figures(sums)
    return {
        "key": {by: key} if by else {},
        "requests": requests,
        "prompt_tokens": sums["sum_prompt_tokens"],
        "reported_prompt_tokens": sums["sum_reported_prompt_tokens"],
        "cached_prompt_tokens": sums["sum_cached_prompt_tokens"],
        "token_hit_ratio": ratios["token_hit_ratio"],
        "requests_reporting_cached": sums["cache_reported_requests"],
        "requests_with_hit": sums["cache_hit_requests"],
        "request_hit_ratio": ratios["request_hit_ratio"],
        "prefill_ms_per_uncached_token": ratios["prefill_ms_per_uncached_token"],
        "engine": {"requests": engine[0] if engine else 0, "e2e_ms_p50": engine_p50},
        "response_cache": response_cache,
    }
