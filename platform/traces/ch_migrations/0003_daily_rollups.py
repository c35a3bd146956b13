"""Daily rollups merged from clean hourly rollups, so long ranges merge ~24× fewer t-digest states."""
from traces.ch_schema import RenderContext, Table

blocking = False

ROLLUP_METRICS = ("e2e_ms", "ttft_ms", "tpot_ms", "network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")
QUANTILE_STATE = "AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Nullable(Float64))"

DAILY = Table(
    name="request_rollup_daily",
    columns=(
        ("project_id", "UInt32"),
        ("day", "DateTime('UTC')"),
        ("service", "LowCardinality(String)"),
        ("model", "LowCardinality(String)"),
        ("engine_config", "LowCardinality(String)"),
        ("prompt_bucket", "LowCardinality(String)"),
        ("requests", "UInt64"),
        ("errors", "UInt64"),
        *((name, QUANTILE_STATE) for name in ROLLUP_METRICS),
        ("version", "UInt64"),
        ("retention_days", "UInt16"),
    ),
    engine="ReplacingMergeTree(version)",
    order_by="project_id, day, service, model, engine_config, prompt_bucket",
    partition_by="toYYYYMM(day)",
    ttl="day + toIntervalDay(retention_days)",
    sharding_key="project_id",
)

DAILY_BUILDS = Table(
    name="request_rollup_daily_builds",
    columns=(
        ("project_id", "UInt32"),
        ("day", "DateTime('UTC')"),
        ("version", "UInt64"),
        ("source_version", "UInt64"),
    ),
    engine="ReplacingMergeTree(version)",
    order_by="project_id, day",
    ttl="day + toIntervalDay(400)",
    sharding_key="project_id",
)

TABLES = (DAILY, DAILY_BUILDS)


def forwards(ctx: RenderContext) -> list[str]:
    return [statement for table in TABLES for statement in table.create_statements(ctx)]


def backwards(ctx: RenderContext) -> list[str]:
    return [statement for table in reversed(TABLES) for statement in table.drop_statements(ctx)]
