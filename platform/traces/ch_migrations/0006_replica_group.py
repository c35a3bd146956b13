"""The replica group that served a request, on LLM calls, request rows and both rollups.

Why: a fleet runs several groups of replicas (a canary beside the stable group, one group per
hardware type...), and when latency burns the first question is often "which group?". The
platform's replicas carry `llm_observatory.replica_group` as a resource attribute and its
gateway puts the group it routed to on its span; the collectors read either into the call,
the decomposition carries it to the request row (engine hop first), and summaries and alert
diagnoses group by it.

Rows written before this migration have `replica_group = ''` (unknown), as do requests of
engines that do not say. In the rollups the column joins the end of the sorting key (a newly
added column may, when it has no DEFAULT expression: its implicit default is '' all the same).

backwards drops the column from the calls and request rows, and drops and recreates the two
rollup tables as 0002/0003 made them (a column cannot leave a sorting key): rollups are derived
data, and with their build records gone every touched hour and day is rolled up again.
"""
import importlib

from traces.ch_schema import RenderContext

blocking = False

# (table, column type, sorting key to extend or None)
_COLUMNS = (
    ("llm_calls", "Nullable(String)", "engine_config", None),
    ("llm_requests", "LowCardinality(String)", "engine_config", None),
    ("request_rollup_hourly", "LowCardinality(String)", "prompt_bucket",
     "project_id, hour, service, model, engine_config, prompt_bucket, replica_group"),
    ("request_rollup_daily", "LowCardinality(String)", "prompt_bucket",
     "project_id, day, service, model, engine_config, prompt_bucket, replica_group"),
)


def forwards(ctx: RenderContext) -> list[str]:
    statements = []
    for table, column_type, after, order_by in _COLUMNS:
        add = f"ADD COLUMN IF NOT EXISTS `replica_group` {column_type} AFTER `{after}`"
        if ctx.cluster:
            # The sorting key lives on the replicated local table; the Distributed front only gets the column.
            local = f"ALTER TABLE {ctx.qualified(table + '_local')}{ctx.on_cluster} {add}"
            statements.append(local + (f", MODIFY ORDER BY ({order_by})" if order_by else ""))
            statements.append(f"ALTER TABLE {ctx.qualified(table)}{ctx.on_cluster} {add}")
        else:
            statements.append(f"ALTER TABLE {ctx.qualified(table)} {add}"
                              + (f", MODIFY ORDER BY ({order_by})" if order_by else ""))
    return statements


def backwards(ctx: RenderContext) -> list[str]:
    statements = []
    for table, _type, _after, order_by in _COLUMNS:
        if order_by is None:
            names = [table, table + "_local"] if ctx.cluster else [table]
            statements += [f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} DROP COLUMN IF EXISTS `replica_group`"
                           for name in names]
    # The rollups and their build records (not request_hour_touches: they say which hours have rows).
    rebuilt = [
        table
        for name in ("0002_request_rollups", "0003_daily_rollups")
        for table in importlib.import_module(f"traces.ch_migrations.{name}").TABLES
        if table.name in _REBUILT
    ]
    for table in rebuilt:
        statements += table.drop_statements(ctx)
    for table in rebuilt:
        statements += table.create_statements(ctx)
    return statements


_REBUILT = ("request_rollup_hourly", "request_rollup_builds", "request_rollup_daily", "request_rollup_daily_builds")
