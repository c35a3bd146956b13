"""The platform's own Prometheus metrics (served at /metrics)."""
from prometheus_client import Counter, Gauge, Histogram

SPANS_RECEIVED = Counter("observatory_spans_received", "Spans received by the OTLP receivers", ["protocol"])
SPANS_ACCEPTED = Counter("observatory_spans_accepted", "Spans accepted (durable in the spool)", ["protocol"])
SPANS_REJECTED = Counter("observatory_spans_rejected", "Spans rejected, by reason", ["protocol", "reason"])
ATTRIBUTES_TRUNCATED = Counter("observatory_attributes_truncated", "Attributes truncated or dropped by ingest limits")
EXPORT_REQUESTS = Counter("observatory_export_requests", "OTLP export requests by outcome", ["protocol", "status"])
DECODED_PAYLOADS = Counter(
    "observatory_ingest_decoded_payloads",
    "OTLP/protobuf payloads by decoder: c (the fast path, ingest/_otlp_fast.c) or python (unusual, rejected or "
    "trimmed content, or the fast path not built or turned off)",
    ["decoder"],
)
SPOOL_PENDING_BYTES = Gauge("observatory_spool_pending_bytes", "Bytes in the spool not yet written to ClickHouse")
SPOOL_DEADLETTER = Counter("observatory_spool_deadletter_records", "Spool records ClickHouse refused, kept in deadletter/")
INSERT_SECONDS = Histogram(
    "observatory_clickhouse_insert_seconds",
    "Time to insert one batch into ClickHouse",
    ["table"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
INSERT_ROWS = Counter("observatory_clickhouse_inserted_rows", "Rows inserted into ClickHouse", ["table"])
STORE_UNAVAILABLE = Counter("observatory_clickhouse_unavailable", "Times a ClickHouse call failed because it was unreachable")
# The backlog between arrival and queryable rows (docs/ingest.md, "Overload and backpressure").
DECOMPOSE_PENDING_TRACES = Gauge(
    "observatory_decompose_pending_traces", "Traces stored and waiting to be decomposed (or being decomposed)")
DECOMPOSE_PENDING_BYTES = Gauge(
    "observatory_decompose_pending_bytes", "Spool bytes of the stored batches not yet completely decomposed")
BACKLOG_OLDEST_SECONDS = Gauge(
    "observatory_ingest_backlog_oldest_seconds",
    "Age of the oldest accepted span not yet queryable (in the spool or waiting for decomposition); 0 when none",
)
WRITER_BLOCKED_SECONDS = Counter(
    "observatory_span_writer_blocked_seconds",
    "Time the span writer waited for room in the decomposition backlog (the spool kept the data meanwhile)",
)
BACKPRESSURE_REFUSALS = Counter(
    "observatory_ingest_backpressure_refusals",
    "Exports refused with 503/UNAVAILABLE because the platform was behind, by reason "
    "(spool_full, backlog_bytes, backlog_age, shutting_down)",
    ["reason"],
)
BACKPRESSURE = Gauge(
    "observatory_ingest_backpressure", "1 while ingest refuses exports because the backlog is beyond its bound")
SPOOL_CACHE_BYTES = Gauge(
    "observatory_spool_cache_bytes",
    "Spool records held in memory for the writer, in bytes as spooled (INGEST_SPOOL_CACHE_BYTES bounds it)")
CLICKHOUSE_MEMORY_BYTES = Gauge(
    "observatory_clickhouse_memory_tracked_bytes",
    "Memory the embedded ClickHouse (chdb, in this process) accounts for (system.metrics MemoryTracking); "
    "absent with a ClickHouse server")
