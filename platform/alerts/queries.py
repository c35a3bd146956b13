"""ClickHouse queries of the alerts app (diagnosis and regression detection): tenant first, values as parameters."""
from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence

from traces.store import ClickHouseStore, identifier, utc_naive

try:  # one definition of each SLI's figure, and of an engine-served request, for evaluation and diagnosis
    from slo.queries import ENGINE_SERVED, METRIC_SQL
except ImportError:  # pragma: no cover - the slo app is part of the platform
    METRIC_SQL = {"ttft_ms": "coalesce(ttft_ms, engine_ttft_ms)", "tpot_ms": "tpot_ms", "e2e_ms": "e2e_ms",
                  "queue_ms": "queue_ms"}
    ENGINE_SERVED = "served_from = 'engine'"

# gateway_ms: the gateways' own processing where a chain shows it (NULL otherwise: then it is inside network_ms).
COMPONENTS = ("network_ms", "gateway_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")
HOP_COLUMNS = ("network_client_gateway_ms", "network_gateway_engine_ms")
FIGURES = ("e2e_ms", "ttft_ms", "tpot_ms", *COMPONENTS, *HOP_COLUMNS)
FILTER_DIMENSIONS = ("service", "model", "prompt_bucket", "engine_config", "replica_group")  # as SLO filters
CONTRIBUTOR_DIMENSIONS = ("model", "prompt_bucket", "engine_config", "replica_group")
WINDOWS = ("burning", "baseline")
_SETTINGS = " SETTINGS do_not_merge_across_partitions_select_final = 1"


def filter_clause(filters: Mapping[str, object], *, include_cached: bool = False) -> tuple[str, dict]:
    """` AND dim IN (...)` for each filtered dimension (a string or a list of strings per dimension), and
    ` AND served_from = 'engine'` unless `include_cached` (as the SLO counts: an engine SLO never reads the
    gateway's response-cache hits)."""
    clauses, params = ([] if include_cached else [ENGINE_SERVED]), {}
    for name in FILTER_DIMENSIONS:
        value = filters.get(name)
        if value in (None, "", []):
            continue
        values = [value] if isinstance(value, str) else [str(v) for v in value]
        params[f"f_{name}"] = values
        clauses.append(f"{identifier(name)} IN {{f_{name}:Array(String)}}")
    return "".join(f" AND {c}" for c in clauses), params


def metric_sql(metric: str) -> str:
    """The SQL of a latency figure as the SLO evaluation reads it (TTFT falls back to the engine's own TTFT
    when the outermost hop did not report one)."""
    if metric in METRIC_SQL:
        return METRIC_SQL[metric]
    if metric in FIGURES:
        return identifier(metric)
    raise ValueError(f"not a latency figure: {metric!r}")


def bad_expression(sli: str | None, threshold_ms: float | None) -> tuple[str, dict]:
    """SQL for "this request is a bad event" of an SLI, exactly as slo/queries.py counts it: a failed
    request (error_ratio), or one whose figure is above the threshold (latency SLIs; a request without the
    figure is neither good nor bad). Empty without a threshold (regressions)."""
    if sli == "error_ratio":
        return "status = 'error'", {}
    if sli in METRIC_SQL and threshold_ms is not None:
        return f"ifNull({metric_sql(sli)} > {{bad_threshold:Float64}}, 0)", {"bad_threshold": float(threshold_ms)}
    return "", {}


def _window_params(burning: tuple[dt.datetime, dt.datetime], baseline: tuple[dt.datetime, dt.datetime]) -> dict:
    return {"b_since": utc_naive(burning[0]), "b_until": utc_naive(burning[1]),
            "base_since": utc_naive(baseline[0]), "base_until": utc_naive(baseline[1])}


_WINDOW_SQL = (
    "multiIf(start_time >= {b_since:DateTime64(6)} AND start_time < {b_until:DateTime64(6)}, 'burning', 'baseline')"
)
_RANGE_SQL = (
    "((start_time >= {b_since:DateTime64(6)} AND start_time < {b_until:DateTime64(6)}) "
    "OR (start_time >= {base_since:DateTime64(6)} AND start_time < {base_until:DateTime64(6)}))"
)


def window_stats(store: ClickHouseStore, project_id: int, *, filters: Mapping[str, object],
                 burning: tuple[dt.datetime, dt.datetime], baseline: tuple[dt.datetime, dt.datetime],
                 sli: str | None, threshold_ms: float | None, include_cached: bool = False) -> dict[str, dict]:
    """Per window ("burning", "baseline"): requests, errors, bad events, mean prompt tokens, and for e2e,
    TTFT, every component and each network hop its count, mean, p50 and p95 (NULLs left out)."""
    where, params = filter_clause(filters, include_cached=include_cached)
    bad_sql, bad_params = bad_expression(sli, threshold_ms)
    params.update(bad_params)
    params.update(_window_params(burning, baseline))
    figures = ("e2e_ms", "ttft_ms", *COMPONENTS, *HOP_COLUMNS)
    aggregates = ", ".join(
        f"count({metric_sql(c)}), avg({metric_sql(c)}), quantilesTDigest(0.5, 0.95)({metric_sql(c)})" for c in figures
    )
    rows = store.query(
        f"SELECT {_WINDOW_SQL} AS w, count(), countIf(status = 'error'), "
        f"{'countIf(' + bad_sql + ')' if bad_sql else 'toUInt64(0)'}, avg(prompt_tokens), {aggregates} "
        f"FROM {store.table('llm_requests')} FINAL "
        f"WHERE project_id = {{project_id:UInt32}} AND {_RANGE_SQL}{where} GROUP BY w{_SETTINGS}",
        project_id=project_id,
        parameters=params,
    )
    out = {w: _empty_stats(figures) for w in WINDOWS}
    for row in rows:
        stats = {"requests": int(row[1]), "errors": int(row[2]), "bad": int(row[3]) if bad_sql else None,
                 "mean_prompt_tokens": _num(row[4]), "figures": {}}
        for i, figure in enumerate(figures):
            n, mean, (p50, p95) = row[5 + 3 * i: 8 + 3 * i]
            stats["figures"][figure] = {"count": int(n), "mean": _num(mean) if n else None,
                                        "p50": _num(p50) if n else None, "p95": _num(p95) if n else None}
        out[row[0]] = stats
    return out


def _empty_stats(figures) -> dict:
    return {"requests": 0, "errors": 0, "bad": None, "mean_prompt_tokens": None,
            "figures": {f: {"count": 0, "mean": None, "p50": None, "p95": None} for f in figures}}


def contributors(store: ClickHouseStore, project_id: int, dimension: str, *, filters: Mapping[str, object],
                 burning: tuple[dt.datetime, dt.datetime], baseline: tuple[dt.datetime, dt.datetime],
                 metric: str, sli: str | None, threshold_ms: float | None, limit: int = 50,
                 include_cached: bool = False) -> list[dict]:
    """Per value of `dimension` and window: requests, bad events and the mean of `metric` (e.g. ttft_ms)."""
    if dimension not in CONTRIBUTOR_DIMENSIONS:
        raise ValueError(f"cannot rank by {dimension!r}")
    where, params = filter_clause(filters, include_cached=include_cached)
    bad_sql, bad_params = bad_expression(sli, threshold_ms)
    params.update(bad_params)
    params.update(_window_params(burning, baseline))
    params["limit"] = limit
    dim, col = identifier(dimension), metric_sql(metric)
    rows = store.query(
        f"SELECT {dim} AS value, {_WINDOW_SQL} AS w, count(), "
        f"{'countIf(' + bad_sql + ')' if bad_sql else 'toUInt64(0)'}, count({col}), avg({col}) "
        f"FROM {store.table('llm_requests')} FINAL "
        f"WHERE project_id = {{project_id:UInt32}} AND {_RANGE_SQL}{where} "
        f"GROUP BY value, w ORDER BY count() DESC LIMIT {{limit:UInt32}} BY w{_SETTINGS}",
        project_id=project_id,
        parameters=params,
    )
    return [
        {"value": value, "window": w, "requests": int(n), "bad": int(bad) if bad_sql else None,
         "observed": int(observed), "mean": _num(mean) if observed else None}
        for value, w, n, bad, observed, mean in rows
    ]


def prefix_cache_buckets(store: ClickHouseStore, project_id: int, *, filters: Mapping[str, object],
                         burning: tuple[dt.datetime, dt.datetime], baseline: tuple[dt.datetime, dt.datetime],
                         step_seconds: int) -> list[dict]:
    """Per bucket of `step_seconds` (Unix seconds of its start) and window: the engine-served requests that report
    cached prompt tokens, their prompt tokens, their cached prompt tokens (at most the prompt) and how many had any.
    A response-cache hit is never counted: no engine read its prompt."""
    where, params = filter_clause(filters)
    params.update(_window_params(burning, baseline))
    params["step"] = int(step_seconds)
    rows = store.query(
        "SELECT intDiv(toUnixTimestamp(start_time), {step:UInt32}) * {step:UInt32} AS bucket, "
        f"{_WINDOW_SQL} AS w, count(), sum(prompt_tokens), sum(least(cached_prompt_tokens, prompt_tokens)), "
        "countIf(cached_prompt_tokens > 0) "
        f"FROM {store.table('llm_requests')} FINAL "
        f"WHERE project_id = {{project_id:UInt32}} AND {_RANGE_SQL}{where} "
        "AND cached_prompt_tokens IS NOT NULL AND prompt_tokens > 0 "
        f"GROUP BY bucket, w ORDER BY bucket, w{_SETTINGS}",
        project_id=project_id,
        parameters=params,
    )
    return [{"bucket": int(bucket), "window": w, "requests": int(n), "prompt_tokens": int(prompt or 0),
             "cached_tokens": int(cached or 0), "requests_with_hits": int(hits)}
            for bucket, w, n, prompt, cached, hits in rows]


def regression_candidates(store: ClickHouseStore, project_id: int, *, current: tuple[dt.datetime, dt.datetime],
                          baseline: tuple[dt.datetime, dt.datetime], metrics: Sequence[str]) -> list[dict]:
    """Per (service, model): for each metric, the number of observed values and the p50 in the current
    window and in the baseline window before it, of engine-served requests (a response-cache hit's latency is no
    engine's)."""
    params = _window_params(current, baseline)
    parts = []
    for i, metric in enumerate(metrics):
        col = f"m{i}"
        metric_sql(metric)  # refuses anything but a latency figure
        parts.append(
            f"countIf({col} IS NOT NULL AND w = 'burning'), countIf({col} IS NOT NULL AND w = 'baseline'), "
            f"quantileTDigestIf(0.5)({col}, w = 'burning'), quantileTDigestIf(0.5)({col}, w = 'baseline')"
        )
    rows = store.query(
        f"SELECT service, model, {', '.join(parts)} FROM ("
        f"SELECT service, model, {', '.join(f'{metric_sql(m)} AS m{i}' for i, m in enumerate(metrics))}, "
        f"{_WINDOW_SQL} AS w "
        f"FROM {store.table('llm_requests')} FINAL "
        f"WHERE project_id = {{project_id:UInt32}} AND {_RANGE_SQL} AND {ENGINE_SERVED}) "
        f"GROUP BY service, model ORDER BY service, model{_SETTINGS}",
        project_id=project_id,
        parameters=params,
    )
    out = []
    for row in rows:
        item = {"service": row[0], "model": row[1], "metrics": {}}
        for i, metric in enumerate(metrics):
            n_cur, n_base, p50_cur, p50_base = row[2 + 4 * i: 6 + 4 * i]
            item["metrics"][metric] = {
                "current_count": int(n_cur), "baseline_count": int(n_base),
                "current_p50": _num(p50_cur) if n_cur else None, "baseline_p50": _num(p50_base) if n_base else None,
            }
        out.append(item)
    return out


def _num(value) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if value != value or value in (float("inf"), float("-inf")) else value
