"""Resource attributes stored once per resource and day instead of on every span row.

Why: every span of an OTLP resource carries the same resource attributes (service,
SDK, host, process...). Repeated on each `spans` row they were about a quarter of the
ClickHouse CPU of a spans insert (parsing a Map per row, then compressing and merging
it), and ~15% of the bytes spooled per span.

From this migration on, a span row has `resource_id` (a 64-bit hash of its resource's
attributes, never 0) and an empty `resource_attributes`; the attributes are in
`span_resources`, one row per (project, resource, day of the spans' start_time). Rows
written before keep `resource_id = 0` and their attributes inline, so for any span:

    SELECT s.*, if(s.resource_id = 0, s.resource_attributes, r.attributes) AS resource
    FROM spans AS s
    LEFT JOIN span_resources AS r FINAL
        ON r.project_id = s.project_id AND r.resource_id = s.resource_id AND r.day = toDate(s.start_time)

(GLOBAL LEFT JOIN on a cluster). A resource row lives at least as long as the spans of its
day: its TTL is one day past theirs, and of several rows for one key (a project whose
retention changed during the day) the longest retention is kept. Nothing in the platform
reads resource attributes back, so no query or API changed.

backwards drops the new column and table: the resource attributes of spans ingested in
between are lost with them.
"""
from traces.ch_schema import RenderContext, Table

blocking = False

SPAN_RESOURCES = Table(
    name="span_resources",
    columns=(
        ("project_id", "UInt32"),
        ("resource_id", "UInt64"),
        ("day", "Date"),
        ("attributes", "Map(LowCardinality(String), String)"),
        ("retention_days", "UInt16"),
    ),
    # The version is the retention: rows for one key differ only in it, and the longest must win.
    engine="ReplacingMergeTree(retention_days)",
    order_by="project_id, resource_id, day",
    partition_by="toYYYYMM(day)",
    ttl="day + toIntervalDay(retention_days) + toIntervalDay(1)",
    sharding_key="resource_id",
)

TABLES = (SPAN_RESOURCES,)


def _spans_tables(ctx: RenderContext) -> list[str]:
    # On a cluster the column goes on the replicated local table and on its Distributed front.
    return ["spans_local", "spans"] if ctx.cluster else ["spans"]


def forwards(ctx: RenderContext) -> list[str]:
    statements = [statement for table in TABLES for statement in table.create_statements(ctx)]
    statements += [
        f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} "
        "ADD COLUMN IF NOT EXISTS `resource_id` UInt64 DEFAULT 0 AFTER `resource_attributes`"
        for name in _spans_tables(ctx)
    ]
    return statements


def backwards(ctx: RenderContext) -> list[str]:
    statements = [
        f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} DROP COLUMN IF EXISTS `resource_id`"
        for name in reversed(_spans_tables(ctx))
    ]
    return statements + [statement for table in reversed(TABLES) for statement in table.drop_statements(ctx)]
