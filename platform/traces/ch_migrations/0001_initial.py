"""Raw spans, the LLM calls found in them, and one row per LLM request with its latency decomposition."""
from traces.ch_schema import RenderContext, Table

blocking = False

SPANS = Table(
    name="spans",
    columns=(
        ("project_id", "UInt32"),
        ("trace_id", "String"),
        ("span_id", "String"),
        ("parent_span_id", "String"),
        ("start_time", "DateTime64(9, 'UTC') CODEC(Delta, ZSTD(1))"),
        ("end_time", "DateTime64(9, 'UTC') CODEC(Delta, ZSTD(1))"),
        ("name", "LowCardinality(String)"),
        ("kind", "UInt8"),
        ("status_code", "UInt8"),
        ("status_message", "String"),
        ("service_name", "LowCardinality(String)"),
        ("scope_name", "LowCardinality(String)"),
        ("scope_version", "LowCardinality(String)"),
        ("resource_attributes", "Map(LowCardinality(String), String)"),
        ("attributes", "Map(LowCardinality(String), String) CODEC(ZSTD(1))"),
        ("events_time", "Array(DateTime64(9, 'UTC'))"),
        ("events_name", "Array(LowCardinality(String))"),
        ("events_attributes", "Array(Map(LowCardinality(String), String))"),
        ("links_trace_id", "Array(String)"),
        ("links_span_id", "Array(String)"),
        ("dropped_attributes", "UInt32"),
        ("llm_convention", "LowCardinality(String)"),
        ("retention_days", "UInt16"),
        ("ingested_at", "DateTime64(3, 'UTC') DEFAULT now64(3)"),
    ),
    # Replays of the spool after a crash insert the same span again: keyed by (project, trace, span).
    engine="ReplacingMergeTree(ingested_at)",
    order_by="project_id, trace_id, span_id",
    partition_by="toDate(start_time)",
    ttl="toDateTime(start_time) + toIntervalDay(retention_days)",
    indexes=("INDEX idx_service service_name TYPE set(100) GRANULARITY 4",),
    settings="index_granularity = 8192, ttl_only_drop_parts = 0",
    sharding_key="sipHash64(trace_id)",
)

LLM_CALLS = Table(
    name="llm_calls",
    columns=(
        ("project_id", "UInt32"),
        ("trace_id", "String"),
        ("span_id", "String"),
        ("parent_span_id", "String"),
        ("role", "LowCardinality(String)"),
        ("convention", "LowCardinality(String)"),
        ("service", "LowCardinality(String)"),
        ("name", "LowCardinality(String)"),
        ("start_ns", "Int64"),
        ("end_ns", "Int64"),
        ("model", "Nullable(String)"),
        ("request_id", "Nullable(String)"),
        ("prompt_tokens", "Nullable(UInt32)"),
        ("completion_tokens", "Nullable(UInt32)"),
        ("streaming", "Nullable(UInt8)"),
        ("is_error", "UInt8"),
        ("ttft_ms", "Nullable(Float64)"),
        ("engine_e2e_ms", "Nullable(Float64)"),
        ("queue_ms", "Nullable(Float64)"),
        ("prefill_ms", "Nullable(Float64)"),
        ("decode_ms", "Nullable(Float64)"),
        ("inference_ms", "Nullable(Float64)"),
        ("engine_config", "Nullable(String)"),
        ("retention_days", "UInt16"),
        ("ingested_at", "DateTime64(3, 'UTC') DEFAULT now64(3)"),
    ),
    engine="ReplacingMergeTree(ingested_at)",
    order_by="project_id, trace_id, span_id",
    partition_by="toYYYYMM(fromUnixTimestamp64Nano(start_ns))",
    ttl="toDateTime(fromUnixTimestamp64Nano(start_ns)) + toIntervalDay(retention_days)",
    sharding_key="sipHash64(trace_id)",
)

COMPONENT_COLUMNS = (
    "e2e_ms",
    "ttft_ms",
    "engine_ttft_ms",
    "tpot_ms",
    "network_ms",
    "network_client_gateway_ms",
    "network_gateway_engine_ms",
    "overhead_ms",
    "queue_ms",
    "prefill_ms",
    "decode_ms",
)

LLM_REQUESTS = Table(
    name="llm_requests",
    columns=(
        ("project_id", "UInt32"),
        ("trace_id", "String"),
        ("request_key", "String"),
        ("request_id", "String"),
        ("start_time", "DateTime64(6, 'UTC')"),
        ("service", "LowCardinality(String)"),
        ("model", "LowCardinality(String)"),
        ("engine_config", "LowCardinality(String)"),
        ("prompt_tokens", "Nullable(UInt32)"),
        ("completion_tokens", "Nullable(UInt32)"),
        ("prompt_bucket", "LowCardinality(String)"),
        *((name, "Nullable(Float64)") for name in COMPONENT_COLUMNS),
        ("hops", "String"),
        ("status", "LowCardinality(String)"),
        ("version", "UInt64"),
        ("is_deleted", "UInt8"),
        ("retention_days", "UInt16"),
    ),
    # A trace is decomposed again when late spans arrive: the newest version wins, and rows
    # whose key moved are cancelled with is_deleted = 1.
    engine="ReplacingMergeTree(version, is_deleted)",
    # Time in the key keeps summaries to the hours asked for; a trace's rows are found through
    # the bloom filter. A row whose hour changed on a rebuild is cancelled (is_deleted = 1).
    order_by="project_id, toStartOfHour(start_time), trace_id, request_key",
    partition_by="toDate(start_time)",
    ttl="toDateTime(start_time) + toIntervalDay(retention_days)",
    indexes=("INDEX idx_trace trace_id TYPE bloom_filter(0.001) GRANULARITY 1",),
    sharding_key="sipHash64(trace_id)",
)

TABLES = (SPANS, LLM_CALLS, LLM_REQUESTS)


def forwards(ctx: RenderContext) -> list[str]:
    return [statement for table in TABLES for statement in table.create_statements(ctx)]


def backwards(ctx: RenderContext) -> list[str]:
    return [statement for table in reversed(TABLES) for statement in table.drop_statements(ctx)]
