"""The decomposition's Prometheus metrics (served at /metrics with the platform's others; names unchanged)."""
from prometheus_client import Counter, Gauge, Histogram

DECOMPOSED_TRACES = Counter("observatory_decomposed_traces", "Traces whose LLM requests were (re)computed")
DECOMPOSE_SECONDS = Histogram(
    "observatory_decompose_cycle_seconds", "Time of one decomposition cycle",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
JOIN_LOOKUPS = Counter(
    "observatory_decompose_join_lookups",
    "Lookups of other traces holding the correlation ids of request rows without an engine or a client hop "
    "(joins across broken trace propagation, traces/joins.py)",
)
JOINED_REQUESTS = Counter(
    "observatory_decompose_joined_requests",
    "Request rows written whose hops came from several traces, joined by the response id",
)
DECOMPOSE_TRACE_SOURCES = Counter(
    "observatory_decompose_traces_by_source",
    "Traces decomposed, by where their spans came from: memory (no lookup: new to the store, see the trace "
    "filter), memory_checked (memory, after a span-count lookup), store (read back from ClickHouse)",
    ["source"],
)
TRACE_FILTER_BYTES = Gauge("observatory_trace_filter_bytes", "Memory held by the decomposition's filter of recent traces")
QUERYABLE_LAG_SECONDS = Histogram(
    "observatory_ingest_queryable_lag_seconds",
    "From an export's arrival to its request rows being stored (queryable), per export",
    buckets=(0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120, 300, 600),
)
DECOMPOSE_MEMORY_TRACES = Gauge(
    "observatory_decompose_memory_traces",
    "Traces whose LLM calls the decomposition holds in memory (bounded: the backlog's limit plus one writer batch)")
