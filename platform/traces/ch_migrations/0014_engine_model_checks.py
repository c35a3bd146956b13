"""One row per live check of a replica group's engine model: the events of the SLI `engine_model_error`.

Why: the model's error on its group's latest traffic is measured every TUNING_CALIBRATION_CHECK_SECONDS
(tuning/calibration.refresh_live_error) and kept on the model only as its latest figure; an SLO counts events over
windows of up to 30 days, so each check is kept as a row (issue 41). Written by tuning/checks.py, read and written
through the slo app's SQL (platform/slo/queries.py): SLO window counts and the burn alert's diagnosis.

A check is few rows (one per group and check interval: 8,640 per group in 30 days), so windows are counted from
the rows directly, without buckets. ReplacingMergeTree: the same check written twice (a retried insert) counts once
(readers use FINAL).
"""
from traces.ch_schema import RenderContext, Table

blocking = False

ENGINE_MODEL_CHECKS = Table(
    name="engine_model_checks",
    columns=(
        ("project_id", "UInt32"),
        ("ts", "DateTime64(3, 'UTC')"),
        ("replica_group", "String"),
        ("model_id", "UInt64"),
        ("config_version", "String"),
        # max(|ttft_p50_error|, |tpot_p50_error|): the figure a study's bound and the SLO's threshold are on
        ("worst_error", "Float64"),
        # (predicted − observed) / observed of p50 TTFT (the engine core's) and TPOT; NULL when not measured
        ("ttft_p50_error", "Nullable(Float64)"),
        ("tpot_p50_error", "Nullable(Float64)"),
        ("requests", "UInt32"),
        # what moved at the same batch sizes: cost (decode, prefill, ...) → relative change
        ("moved", "Map(LowCardinality(String), Float64)"),
    ),
    engine="ReplacingMergeTree()",
    order_by="project_id, ts, replica_group, model_id",
    partition_by="toYYYYMM(ts)",
    ttl="toDateTime(ts) + toIntervalDay(400)",
    sharding_key="project_id",
)


def forwards(ctx: RenderContext) -> list[str]:
    return ENGINE_MODEL_CHECKS.create_statements(ctx)


def backwards(ctx: RenderContext) -> list[str]:
    return ENGINE_MODEL_CHECKS.drop_statements(ctx)
