"""The rollouts app's ClickHouse SQL: the requests of a canary group and its baseline over a step's span. Every
statement filters on the project and binds values as parameters; columns come from the plan's allow-list."""
from __future__ import annotations

import datetime as dt

from traces.store import ClickHouseStore, identifier, utc_naive

from .plan import LATENCY_METRICS


def group_requests(store: ClickHouseStore, project_id: int, groups: tuple[str, str], since: dt.datetime,
                   until: dt.datetime, limit: int) -> list[tuple]:
    """(replica_group, status, *LATENCY_METRICS) of the two groups' requests that arrived in [since, until), newest
    first, at most ``limit``."""
    columns = ", ".join(identifier(m) for m in LATENCY_METRICS)
    return store.query(
        f"SELECT replica_group, status, {columns} FROM {store.table('llm_requests')} FINAL "
        "WHERE project_id = {project_id:UInt32} AND start_time >= {since:DateTime64(6)} "
        "AND start_time < {until:DateTime64(6)} AND replica_group IN ({a:String}, {b:String}) "
        "ORDER BY start_time DESC LIMIT {limit:UInt32}",
        project_id=project_id,
        parameters={"since": utc_naive(since), "until": utc_naive(until), "a": groups[0], "b": groups[1],
                    "limit": int(limit)})
