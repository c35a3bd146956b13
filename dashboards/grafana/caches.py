"""`caches.json`: the caches seen in the request rows of the platform's ClickHouse store, through Grafana's ClickHouse
plugin (`grafana-clickhouse-datasource`): the prefix cache's hit ratio (prompt tokens and requests) over time and by
model, service, replica group and prompt-length bucket, the prefill time per uncached prompt token, and the share of
requests the gateway's response cache answered.

Every query reads what the platform's own summaries read (traces/queries.rollup_union): the hourly rollups
(`request_rollup_hourly`, with the cache sums of traces/rollups.CACHE_SUMS) for the clean hours wholly inside the range
(an hour is clean when its current build covers the newest rows written for it: `request_rollup_builds` against
`request_hour_touches`, both FINAL), and `llm_requests FINAL` (the newest version of each row, none cancelled) for the
rest: the range's edges, the current hour, hours touched since their build. A time series takes rollups only when
Grafana's interval is a whole number of hours (an hour then lies in one bucket), else every row.

Variables: `project_id` (a textbox; every query filters `project_id = toUInt32('${project_id:percentencode}')`: a
value that is not a number fails the query instead of reaching the SQL) and multi-selects of model, service and
replica group. A selected value is `x` + the hex of the name (no quote or backslash of a hostile name ever reaches
the SQL), interpolated percent-encoded and matched with `$__conditionalAll(…)`, which the plugin replaces by `1=1`
when All is selected.
"""
from __future__ import annotations

from traces.queries import ENGINE_SERVED
from traces.rollups import CACHE_SUMS

from collectors.base import SERVED_FROM
from dashboards.queries import PROMPT_BUCKETS

from .board import CLICKHOUSE, Board

PROJECT = "toUInt32('${project_id:percentencode}')"
SELECTABLE = {"model": "Model", "service": "Service", "replica_group": "Replica group"}
DIMENSIONS = {**SELECTABLE, "prompt_bucket": "Prompt-length bucket"}
RATIOS = {
    "tokens": "sum(c_sum_cached_prompt_tokens) / nullIf(sum(c_sum_reported_prompt_tokens), 0)",
    "requests": "sum(c_cache_hit_requests) / nullIf(sum(c_cache_reported_requests), 0)",
}
PREFILL = "sum(c_sum_prefill_ms) / nullIf(sum(c_sum_uncached_prompt_tokens), 0)"
REPORTING = "HAVING sum(c_cache_reported_requests) > 0"


def _token(column: str) -> str:
    return f"concat('x', hex({column}))"


def _selected(column: str) -> str:
    """The rows whose `column` is one of the variable's values (any, when All is selected)."""
    return (f"$__conditionalAll(has(extractAll(decodeURLComponent('${{{column}:percentencode}}'), 'x[0-9A-F]*'), "
            f"{_token(column)}), ${column})")


FILTERS = " AND ".join(_selected(column) for column in SELECTABLE)


def _sums(key: str, where: str, timed: bool, sums: list[str]) -> tuple[str, str]:
    """(WITH the clean hours, a subquery of (`time`,) `key`, `n` (requests) and these cache sums (`c_<CACHE_SUMS>`):
    the rollups of the clean hours wholly inside the range and the rows of the rest, both filtered by `where`)."""
    aligned = " AND $__interval_s % 3600 = 0" if timed else ""
    clean = (
        "WITH clean AS (\n"
        "  SELECT b.hour AS hour, b.version AS version FROM request_rollup_builds AS b FINAL\n"
        f"  INNER JOIN (SELECT hour, version FROM request_hour_touches FINAL WHERE project_id = {PROJECT}\n"
        "              AND hour >= toStartOfHour($__fromTime) AND hour <= $__toTime) AS t ON t.hour = b.hour\n"
        f"  WHERE b.project_id = {PROJECT} AND b.hour >= $__fromTime AND b.hour + INTERVAL 1 HOUR <= $__toTime\n"
        f"    AND b.source_version >= t.version{aligned})\n")
    group = "time, key" if timed else "key"
    rolled = "".join(f", sum({column}) AS c_{column}" for column in sums)
    raw = "".join(f", {CACHE_SUMS[column]} AS c_{column}" for column in sums)
    return clean, (
        f"  SELECT {'$__timeInterval(hour) AS time, ' if timed else ''}{key} AS key, sum(requests) AS n{rolled}\n"
        f"  FROM request_rollup_hourly WHERE project_id = {PROJECT}\n"
        f"    AND (hour, version) IN (SELECT hour, version FROM clean) AND {where}\n"
        f"  GROUP BY {group}\n"
        "  UNION ALL\n"
        f"  SELECT {'$__timeInterval(start_time) AS time, ' if timed else ''}{key} AS key, count() AS n{raw}\n"
        f"  FROM llm_requests FINAL WHERE project_id = {PROJECT} AND $__timeFilter(start_time)\n"
        f"    AND toStartOfHour(start_time) NOT IN (SELECT hour FROM clean) AND {where}\n"
        f"  GROUP BY {group}")


def _query(columns: str, key: str, where: str, timed: bool, tail: str = "", by_key: bool = True) -> str:
    """SELECT (`time`,) `columns` over the sums of `_sums`, per `key` too when `by_key`."""
    clean, union = _sums(key, where, timed, [c for c in CACHE_SUMS if f"c_{c}" in columns + tail])
    group = ", ".join(["time"] * timed + ["key"] * by_key)
    order = group if timed else ("indexOf([" + ", ".join(f"'{b}'" for b in PROMPT_BUCKETS) + "], key), key"
                                       if key == "prompt_bucket" else "key")
    return (f"{clean}SELECT {'time, ' if timed else ''}{columns}\nFROM (\n{union}\n)\nGROUP BY {group}"
            f"{' ' + tail if tail else ''}\nORDER BY {order}\nSETTINGS do_not_merge_across_partitions_select_final = 1")


def _name(key: str = "key") -> str:
    return f"if({key} = '', '(unknown)', {key})"


def _variable(column: str, label: str) -> dict:
    query = (f"SELECT {_token(column)} AS value, {column} AS text FROM llm_requests\n"
             f"WHERE project_id = {PROJECT} AND $__timeFilter(start_time)\nGROUP BY {column} ORDER BY {column} "
             "LIMIT 1000")
    return {"name": column, "label": label, "type": "query", "datasource": CLICKHOUSE, "refresh": 2, "query": query,
            "definition": query, "includeAll": True, "multi": True, "current": {}, "sort": 0}


PROJECT_VARIABLE = {"name": "project_id", "label": "Project id", "type": "textbox", "query": "",
                    "current": {"text": "", "value": ""},
                    "description": "The numeric id of the project whose requests the panels read."}


def caches_board() -> dict:
    board = Board("llm-observatory-caches", "LLM observatory: caches", ["llm-observatory", "caches"],
                  [PROJECT_VARIABLE] + [_variable(column, label) for column, label in SELECTABLE.items()],
                  datasource=CLICKHOUSE)
    engine = f"{ENGINE_SERVED} AND {FILTERS}"
    ratios = ", ".join(f"{expr} AS `{name}`" for name, expr in RATIOS.items())
    board.row("Prefix cache: engine-served requests that report cached prompt tokens")
    board.sql_panel("Prefix-cache hit ratio: prompt tokens and requests", _query(ratios, "''", engine, True),
                    description="Tokens: cached prompt tokens / prompt tokens; requests: requests with a hit / "
                                "requests reporting. Over the engine-served requests whose cached prompt tokens are "
                                "known (a request that reports none is not counted as a miss).")
    board.sql_panel("Prefill time per uncached prompt token",
                    _query(f"{PREFILL} AS `ms per uncached token`", "''", engine, True), unit="ms",
                    description="Prefill ms / (prompt tokens - cached prompt tokens), over engine-served requests "
                                "that report prefill, prompt and cached tokens: what a prompt token the engine "
                                "computed costs, whatever the cache supplied.")
    for column, label in DIMENSIONS.items():
        board.row(f"By {label.lower()}")
        board.sql_panel(f"Token hit ratio by {label.lower()}",
                        _query(f"{_name()} AS {column}, {RATIOS['tokens']} AS `token hit ratio`", column, engine, True,
                               REPORTING), display_name=f"${{__field.labels.{column}}}")
        board.sql_panel(f"Hit ratios by {label.lower()} over the range: prompt tokens, requests",
                        _query(f"{_name()} AS {column}, {ratios}", column, engine, False, REPORTING), kind="bargauge")
    board.row("Response cache")
    shares = ", ".join(f"sumIf(n, key = '{served}') / sum(n) AS {served}" for served in SERVED_FROM)
    board.sql_panel("Share of requests by what served them: the engine, the exact cache, the semantic cache",
                    _query(shares, "served_from", FILTERS, True, by_key=False),
                    width=24, stack=True,
                    description="Of all requests (any status). A response-cache hit never reaches an engine: the "
                                "panels above leave it out.")
    return board.json()
