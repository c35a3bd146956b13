"""The rollups carry the components' means (avg states) and the gateways' processing, and one row per project and
hour and replica group over the other dimensions (`request_rollup_hourly_totals`): long-range charts from them.

Why: the dashboard's overview charts the decomposition over time as the mean of each component and as their
p95. Over 7 or 30 days its buckets are whole hours, which the hourly rollups could answer — but they held only
t-digest states (percentiles), no means, and no `gateway_ms`. With them, a 7-day overview over 10 million rows
reads ~1,000 states per hour instead of the raw rows (dashboards.bench).

The hourly rollups keep a row per combination of service, model, engine config, prompt bucket and replica group
(~180 an hour in a mixed fleet), so charting 7 days from them merges ~30,000 t-digest states per metric; the
overview's charts need no dimension but the replica group (baseline and canary side by side), so
`request_rollup_hourly_totals` holds the same states merged over the others (built with each hour's rollup, from
it): a few rows an hour.

New columns on both rollups (no sorting-key change, so re-runnable): `mean_<component>` as
AggregateFunction(avg, Nullable(Float64)) for network, gateway, overhead, queue, prefill and decode, and a
`gateway_ms` t-digest state like the other metrics'. The build records are emptied, so every touched hour and
day is rolled up again with them (rollups are derived data; until rebuilt, an hour counts as not clean and
summaries read its rows, as for any dirty hour).

backwards drops the columns and the totals table, and empties the build records again.
"""
from traces.ch_schema import RenderContext, Table

blocking = False

MEANS = ("network_ms", "gateway_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")
_QUANTILE_STATE = "AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Nullable(Float64))"
_ROLLUPS = ("request_rollup_hourly", "request_rollup_daily")
_METRICS = ("e2e_ms", "ttft_ms", "tpot_ms", "network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms",
            "gateway_ms")
TOTALS = Table(
    name="request_rollup_hourly_totals",
    columns=(
        ("project_id", "UInt32"),
        ("hour", "DateTime('UTC')"),
        ("replica_group", "LowCardinality(String)"),
        ("requests", "UInt64"),
        ("errors", "UInt64"),
        *((name, _QUANTILE_STATE) for name in _METRICS),
        *((f"mean_{name}", "AggregateFunction(avg, Nullable(Float64))") for name in MEANS),
        ("version", "UInt64"),
        ("retention_days", "UInt16"),
    ),
    engine="ReplacingMergeTree(version)",
    order_by="project_id, hour, replica_group",
    partition_by="toYYYYMM(hour)",
    ttl="hour + toIntervalDay(retention_days)",
    sharding_key="project_id",
)
_BUILDS = ("request_rollup_builds", "request_rollup_daily_builds")


def _changes() -> list[str]:
    changes = [f"ADD COLUMN IF NOT EXISTS `gateway_ms` {_QUANTILE_STATE} AFTER `decode_ms`"]
    after = "gateway_ms"
    for metric in MEANS:
        changes.append(f"ADD COLUMN IF NOT EXISTS `mean_{metric}` AggregateFunction(avg, Nullable(Float64)) "
                       f"AFTER `{after}`")
        after = f"mean_{metric}"
    return changes


def _truncate(ctx: RenderContext) -> list[str]:
    return [f"TRUNCATE TABLE IF EXISTS {ctx.qualified(name + '_local' if ctx.cluster else name)}{ctx.on_cluster}"
            for name in _BUILDS]


def forwards(ctx: RenderContext) -> list[str]:
    statements = []
    for table in _ROLLUPS:
        names = [table + "_local", table] if ctx.cluster else [table]
        for name in names:
            statements.append(f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} " + ", ".join(_changes()))
    return statements + TOTALS.create_statements(ctx) + _truncate(ctx)


def backwards(ctx: RenderContext) -> list[str]:
    drops = ", ".join(f"DROP COLUMN IF EXISTS `{c}`" for c in ("gateway_ms", *(f"mean_{m}" for m in MEANS)))
    statements = []
    for table in _ROLLUPS:
        names = [table + "_local", table] if ctx.cluster else [table]
        statements += [f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} {drops}" for name in names]
    return statements + TOTALS.drop_statements(ctx) + _truncate(ctx)
