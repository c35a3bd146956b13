"""The regressions app's ClickHouse SQL: the decomposed request rows of a run's traces, whether their engine spans
came from the simulator, the similarities the gateway's semantic cache found for them, and the token lengths of a
project's traffic (for a dataset shaped like it). Every statement filters on the project and binds values as
parameters."""
from __future__ import annotations

import datetime as dt

from traces.store import ClickHouseStore, string_set

# The columns of a run's request row; after the trace id, the ten figures a result keeps (METRIC_COLUMNS).
ROW_COLUMNS = ("trace_id", "e2e_ms", "ttft_ms", "tpot_ms", "engine_ttft_ms", "network_ms", "gateway_ms",
               "overhead_ms", "queue_ms", "prefill_ms", "decode_ms", "prompt_bucket", "prompt_tokens",
               "completion_tokens", "service")
METRIC_COLUMNS = ROW_COLUMNS[1:11]
TRACES_PER_QUERY = 5000
SIMILARITY_ATTRIBUTE = "observatory.cache.similarity"
SIMULATED_SAMPLE = 200  # traces looked at to tell whether a run's engine was the simulator


def request_rows(store: ClickHouseStore, project_id: int, trace_ids: list[str]) -> dict[str, dict]:
    """The decomposed request row of each trace (the one with the longest e2e if a trace has several)."""
    out: dict[str, dict] = {}
    for start in range(0, len(trace_ids), TRACES_PER_QUERY):
        ids_sql, ids = string_set("ids", trace_ids[start:start + TRACES_PER_QUERY])
        rows = store.query(
            f"SELECT {', '.join(ROW_COLUMNS)} FROM {store.table('llm_requests')} FINAL "
            f"WHERE project_id = {{project_id:UInt32}} AND trace_id IN {ids_sql}",
            project_id=project_id, parameters={"ids": ids})
        for row in rows:
            data = dict(zip(ROW_COLUMNS, row))
            previous = out.get(data["trace_id"])
            if previous is None or (data["e2e_ms"] or 0) > (previous["e2e_ms"] or 0):
                out[data["trace_id"]] = data
    return out


def cache_similarities(store: ClickHouseStore, project_id: int, trace_ids: list[str]) -> dict[str, float]:
    """The best similarity the gateway's semantic lookup found for each trace that has one (its SERVER span's
    `observatory.cache.similarity`); a value that is not a cosine is left out."""
    out: dict[str, float] = {}
    for start in range(0, len(trace_ids), TRACES_PER_QUERY):
        ids_sql, ids = string_set("ids", trace_ids[start:start + TRACES_PER_QUERY])
        rows = store.query(
            f"SELECT trace_id, attributes['{SIMILARITY_ATTRIBUTE}'] FROM {store.table('spans')} "
            f"WHERE project_id = {{project_id:UInt32}} AND trace_id IN {ids_sql} "
            f"AND mapContains(attributes, '{SIMILARITY_ATTRIBUTE}')",
            project_id=project_id, parameters={"ids": ids})
        for trace_id, text in rows:
            try:
                value = float(text)
            except ValueError:
                continue
            if -1.0 <= value <= 1.0:  # NaN is neither
                out[trace_id] = value
    return out


def simulated(store: ClickHouseStore, project_id: int, trace_ids: list[str]) -> bool:
    """Whether the engine spans of these traces came from the simulator (resource llm_observatory.simulated)."""
    if not trace_ids:
        return False
    ids_sql, ids = string_set("ids", trace_ids[:SIMULATED_SAMPLE])
    rows = store.query(
        f"SELECT count() FROM {store.table('spans')} AS s "
        f"LEFT JOIN {store.table('span_resources')} AS r FINAL "
        "ON r.project_id = s.project_id AND r.resource_id = s.resource_id AND r.day = toDate(s.start_time) "
        f"WHERE s.project_id = {{project_id:UInt32}} AND s.trace_id IN {ids_sql} "
        "AND if(s.resource_id = 0, s.resource_attributes, r.attributes)['llm_observatory.simulated'] = 'true'",
        project_id=project_id, parameters={"ids": ids})
    return bool(rows and rows[0][0])


def traffic_lengths(store: ClickHouseStore, project_id: int, *, since: dt.datetime,
                    until: dt.datetime) -> list[tuple[str, int, int]]:
    """(prompt bucket, prompt tokens, completion tokens) of up to 200,000 of the project's completed requests in
    [since, until), in an order fixed by their keys (the same sample for the same range)."""
    return store.query(
        f"SELECT prompt_bucket, prompt_tokens, completion_tokens FROM {store.table('llm_requests')} FINAL "
        "WHERE project_id = {project_id:UInt32} AND start_time >= {since:DateTime64(6)} "
        "AND start_time < {until:DateTime64(6)} AND status = 'ok' AND prompt_tokens IS NOT NULL "
        "AND completion_tokens IS NOT NULL AND completion_tokens > 0 "
        "ORDER BY cityHash64(request_key) LIMIT 200000",
        project_id=project_id,
        parameters={"since": since.replace(tzinfo=None), "until": until.replace(tzinfo=None)},
    )
