"""SLO counts per 5-minute bucket (so 30-day windows do not scan raw rows), their build bookkeeping, and the SLO status series.

Owned by the slo app (platform/slo/queries.py reads and writes these tables).
"""
from traces.ch_schema import RenderContext, Table

blocking = False

# total/bad requests of one SLI (sli_key: SLI, threshold, filters) per 5 minutes, built per closed hour.
SLI_BUCKETS = Table(
    name="slo_sli_buckets",
    columns=(
        ("project_id", "UInt32"),
        ("sli_key", "UInt64"),
        ("bucket", "DateTime('UTC')"),
        ("total", "UInt64"),
        ("bad", "UInt64"),
        ("version", "UInt64"),
        ("retention_days", "UInt16"),
    ),
    # Rows of older builds of an hour stay until merged away; readers use only the version recorded
    # in slo_sli_builds for that (sli_key, hour).
    engine="ReplacingMergeTree(version)",
    order_by="project_id, sli_key, bucket",
    partition_by="toYYYYMM(bucket)",
    ttl="bucket + toIntervalDay(retention_days)",
    sharding_key="project_id",
)

# Which bucket version is current for (sli_key, hour) and which request_hour_touches version it covers.
SLI_BUILDS = Table(
    name="slo_sli_builds",
    columns=(
        ("project_id", "UInt32"),
        ("sli_key", "UInt64"),
        ("hour", "DateTime('UTC')"),
        ("version", "UInt64"),
        ("source_version", "UInt64"),
    ),
    engine="ReplacingMergeTree(version)",
    order_by="project_id, sli_key, hour",
    ttl="hour + toIntervalDay(400)",
    sharding_key="project_id",
)

# One point per SLO and evaluation minute: state, budget remaining, burn rate and counts per window. A
# minute evaluated twice (a doubled beat, an SLO created mid-minute) keeps its latest evaluation (version).
SLO_STATUS = Table(
    name="slo_status",
    columns=(
        ("project_id", "UInt32"),
        ("slo_id", "UInt64"),
        ("at", "DateTime('UTC')"),
        ("version", "UInt64"),
        ("state", "LowCardinality(String)"),
        ("firing_tier", "LowCardinality(String)"),
        ("severity", "LowCardinality(String)"),
        ("budget_remaining", "Nullable(Float64)"),
        ("burn_rates", "Map(LowCardinality(String), Float64)"),
        ("totals", "Map(LowCardinality(String), UInt64)"),
        ("bads", "Map(LowCardinality(String), UInt64)"),
        ("retention_days", "UInt16"),
    ),
    engine="ReplacingMergeTree(version)",
    order_by="project_id, slo_id, at",
    partition_by="toYYYYMM(at)",
    ttl="at + toIntervalDay(retention_days)",
    sharding_key="project_id",
)

TABLES = (SLI_BUCKETS, SLI_BUILDS, SLO_STATUS)


def forwards(ctx: RenderContext) -> list[str]:
    return [statement for table in TABLES for statement in table.create_statements(ctx)]


def backwards(ctx: RenderContext) -> list[str]:
    return [statement for table in reversed(TABLES) for statement in table.drop_statements(ctx)]
