"""Hourly rollups of llm_requests (t-digest states per group) and the bookkeeping that says which hours are current."""
from traces.ch_schema import RenderContext, Table

blocking = False

ROLLUP_METRICS = ("e2e_ms", "ttft_ms", "tpot_ms", "network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")
QUANTILE_STATE = "AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Nullable(Float64))"

ROLLUP = Table(
    name="request_rollup_hourly",
    columns=(
        ("project_id", "UInt32"),
        ("hour", "DateTime('UTC')"),
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
    # Rows of older builds of an hour stay until merged away; queries read only the
    # version recorded in request_rollup_builds.
    engine="ReplacingMergeTree(version)",
    order_by="project_id, hour, service, model, engine_config, prompt_bucket",
    partition_by="toYYYYMM(hour)",
    ttl="hour + toIntervalDay(retention_days)",
    sharding_key="project_id",
)

# The newest version of llm_requests rows written for each (project, hour).
TOUCHES = Table(
    name="request_hour_touches",
    columns=(("project_id", "UInt32"), ("hour", "DateTime('UTC')"), ("version", "UInt64")),
    engine="ReplacingMergeTree(version)",
    order_by="project_id, hour",
    ttl="hour + toIntervalDay(400)",
    sharding_key="project_id",
)

# Which rollup version is current for an hour and which touch version it covers.
BUILDS = Table(
    name="request_rollup_builds",
    columns=(
        ("project_id", "UInt32"),
        ("hour", "DateTime('UTC')"),
        ("version", "UInt64"),
        ("source_version", "UInt64"),
    ),
    engine="ReplacingMergeTree(version)",
    order_by="project_id, hour",
    ttl="hour + toIntervalDay(400)",
    sharding_key="project_id",
)

TABLES = (ROLLUP, TOUCHES, BUILDS)


def forwards(ctx: RenderContext) -> list[str]:
    return [statement for table in TABLES for statement in table.create_statements(ctx)]


def backwards(ctx: RenderContext) -> list[str]:
    return [statement for table in reversed(TABLES) for statement in table.drop_statements(ctx)]
