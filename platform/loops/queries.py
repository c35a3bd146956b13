"""The loops app's ClickHouse SQL: how many requests a replica group completed in a span. Every statement filters on
the project and binds values as parameters."""
from __future__ import annotations

import datetime as dt

from traces.store import ClickHouseStore, utc_naive

LONGEST = dt.timedelta(hours=1)  # a request that took longer than this to complete is not looked for


def completed(store: ClickHouseStore, project_id: int, group: str, since: dt.datetime, until: dt.datetime) -> int:
    """The group's requests that completed (any status) in [since, until): started, then done e2e_ms later."""
    rows = store.query(
        f"SELECT count() FROM {store.table('llm_requests')} FINAL "
        "WHERE project_id = {project_id:UInt32} AND replica_group = {group:String} "
        "AND start_time >= {earliest:DateTime64(6)} AND start_time < {until:DateTime64(6)} AND e2e_ms IS NOT NULL "
        "AND toUnixTimestamp64Milli(start_time) + e2e_ms >= {since_ms:Float64} "
        "AND toUnixTimestamp64Milli(start_time) + e2e_ms < {until_ms:Float64}",
        project_id=project_id,
        parameters={"group": group, "earliest": utc_naive(since - LONGEST), "until": utc_naive(until),
                    "since_ms": since.timestamp() * 1000.0, "until_ms": until.timestamp() * 1000.0})
    return int(rows[0][0]) if rows else 0
