"""The canary analysis' one query (rollouts.queries.group_requests) against a migrated in-process store: the
project's requests of the two groups that arrived in [since, until), newest first, at most the limit, with the
latency figures in the plan's order; analysis.fetch counts them per group."""
from __future__ import annotations

import datetime as dt
import json
import uuid

from rollouts import analysis, queries
from rollouts.plan import LATENCY_METRICS
from traces import ch_migrate

COLUMNS = ("project_id", "trace_id", "request_key", "start_time", "replica_group", "status", *LATENCY_METRICS,
           "version", "is_deleted", "retention_days")


def _row(project_id: int, group: str, at: dt.datetime, ttft: float, status: str = "ok") -> list:
    figures = [ttft, 20.0, 900.0, 5.0, 30.0, 800.0]
    return [project_id, uuid.uuid4().hex, uuid.uuid4().hex[:16], at.strftime("%Y-%m-%d %H:%M:%S.%f"), group, status,
            *figures, 1, 0, 30]


def test_the_two_groups_of_the_project_in_the_span_newest_first(make_store):
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    since, until = now - dt.timedelta(minutes=10), now
    rows = [_row(7, "base", since + dt.timedelta(seconds=i), 100.0 + i) for i in range(5)]
    rows += [_row(7, "canary", since + dt.timedelta(seconds=10 + i), 200.0 + i) for i in range(3)]
    rows += [_row(7, "canary", since + dt.timedelta(seconds=20), 0.0, status="error")]
    rows += [_row(7, "other", since + dt.timedelta(seconds=30), 1.0),  # another group
             _row(8, "base", since + dt.timedelta(seconds=30), 1.0),  # another project
             _row(7, "base", since - dt.timedelta(seconds=1), 1.0),  # before the span
             _row(7, "base", until, 1.0)]  # at its end (excluded)
    store.insert_encoded("llm_requests", COLUMNS, "\n".join(json.dumps(r) for r in rows).encode(),
                         "JSONCompactEachRow")

    found = queries.group_requests(store, 7, ("base", "canary"), since, until, limit=100)
    assert [(r[0], r[1], r[2]) for r in found] == [
        ("canary", "error", 0.0), ("canary", "ok", 202.0), ("canary", "ok", 201.0), ("canary", "ok", 200.0),
        ("base", "ok", 104.0), ("base", "ok", 103.0), ("base", "ok", 102.0), ("base", "ok", 101.0),
        ("base", "ok", 100.0)]
    assert list(found[1][2:]) == [202.0, 20.0, 900.0, 5.0, 30.0, 800.0]  # LATENCY_METRICS' order
    assert [r[2] for r in queries.group_requests(store, 7, ("base", "canary"), since, until, limit=2)] == [0.0, 202.0]

    samples = analysis.fetch(store, 7, ("base", "canary"), since, until)
    assert (samples["base"].total, samples["base"].errors) == (5, 0)
    assert (samples["canary"].total, samples["canary"].errors) == (4, 1)
    assert samples["canary"].values["ttft_ms"].tolist() == [202.0, 201.0, 200.0]
