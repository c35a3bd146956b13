"""The tuning app's ClickHouse SQL: the completed request rows a traffic workload is built from. Only engine-served
rows make a workload (a request the gateway answered from its response cache never reached the engine). Every
statement filters on the project and binds its values as parameters."""
from __future__ import annotations

import datetime as dt

from traces.queries import ENGINE_SERVED
from traces.store import ClickHouseStore

ROW_LIMIT = 1_000_000  # request rows read for one workload
_IN_WINDOW = ("project_id = {project_id:UInt32} AND start_time >= {since:DateTime64(6)} "
              "AND start_time < {until:DateTime64(6)}")


def _window(since: dt.datetime, until: dt.datetime) -> dict:
    return {"since": since.replace(tzinfo=None), "until": until.replace(tzinfo=None)}


def _scope(group: str | None, since: dt.datetime, until: dt.datetime) -> tuple[str, dict]:
    where, parameters = _IN_WINDOW, _window(since, until)
    if group is not None:
        where += " AND replica_group = {group:String}"
        parameters["group"] = group
    return where, parameters


def served_counts(store: ClickHouseStore, project_id: int, *, group: str | None, since: dt.datetime,
                  until: dt.datetime) -> tuple[int, int]:
    """(engine-served, answered from the gateway's response cache): how many of the project's request rows in
    [since, until) (of ``group`` when given) each served. One scan."""
    where, parameters = _scope(group, since, until)
    [[engine, cached]] = store.query(
        f"SELECT countIf({ENGINE_SERVED}), countIf(NOT ({ENGINE_SERVED})) FROM {store.table('llm_requests')} FINAL "
        f"WHERE {where}",
        project_id=project_id, parameters=parameters)
    return int(engine), int(cached)


def request_rows(store: ClickHouseStore, project_id: int, *, group: str | None, since: dt.datetime,
                 until: dt.datetime) -> list[tuple]:
    """(start time in Unix seconds, prompt tokens, completion tokens, prompt bucket, status, cached prompt tokens)
    of the project's engine-served request rows in [since, until) (those of ``group`` when given), in order of
    their start. Cached prompt tokens are NULL where the request did not report them."""
    where, parameters = _scope(group, since, until)
    return store.query(
        "SELECT toFloat64(toUnixTimestamp64Micro(start_time)) / 1e6, prompt_tokens, completion_tokens, "
        f"prompt_bucket, status, cached_prompt_tokens FROM {store.table('llm_requests')} FINAL "
        f"WHERE {where} AND {ENGINE_SERVED} ORDER BY start_time LIMIT {{limit:UInt32}}",
        project_id=project_id, parameters={**parameters, "limit": ROW_LIMIT})


def calibration_facts(store: ClickHouseStore, project_id: int, *, group: str, since: dt.datetime,
                      until: dt.datetime) -> tuple[int, int, list[str]]:
    """(engine-served requests that finished well, those of them with the engine's timings, the config versions
    they ran) of ``group`` in [since, until): what a calibration checks before it is queued. One scan."""
    where, parameters = _scope(group, since, until)
    [[served, timed, versions]] = store.query(
        "SELECT count(), countIf(prefill_ms IS NOT NULL AND tpot_ms IS NOT NULL AND queue_ms IS NOT NULL), "
        "arraySort(groupUniqArrayIf(engine_config, engine_config != '')) "
        f"FROM {store.table('llm_requests')} FINAL WHERE {where} AND {ENGINE_SERVED} AND status = 'ok'",
        project_id=project_id, parameters=parameters)
    return int(served), int(timed), list(versions)


def calibration_rows(store: ClickHouseStore, project_id: int, *, group: str, since: dt.datetime,
                     until: dt.datetime) -> list[tuple]:
    """(start in Unix seconds, prompt tokens, completion tokens, cached prompt tokens, the engine core's TTFT ms
    (queue + prefill), TPOT ms, queue ms) of ``group``'s engine-served, successful request rows in [since, until),
    in order of their start; the timings are NULL where no engine span reported them."""
    where, parameters = _scope(group, since, until)
    return store.query(
        "SELECT toFloat64(toUnixTimestamp64Micro(start_time)) / 1e6, prompt_tokens, completion_tokens, "
        "cached_prompt_tokens, queue_ms + prefill_ms, tpot_ms, queue_ms "
        f"FROM {store.table('llm_requests')} FINAL WHERE {where} AND {ENGINE_SERVED} AND status = 'ok' "
        "AND prompt_tokens IS NOT NULL AND completion_tokens IS NOT NULL ORDER BY start_time LIMIT {limit:UInt32}",
        project_id=project_id, parameters={**parameters, "limit": ROW_LIMIT})


def groups_with_traffic(store: ClickHouseStore, project_id: int, *, since: dt.datetime, until: dt.datetime,
                        at_least: int) -> list[str]:
    """The replica groups with at least ``at_least`` engine-served requests in [since, until)."""
    rows = store.query(
        f"SELECT replica_group FROM {store.table('llm_requests')} FINAL WHERE {_IN_WINDOW} AND {ENGINE_SERVED} "
        "AND replica_group != '' GROUP BY replica_group HAVING count() >= {at_least:UInt32} ORDER BY replica_group",
        project_id=project_id, parameters={**_window(since, until), "at_least": at_least})
    return [row[0] for row in rows]
