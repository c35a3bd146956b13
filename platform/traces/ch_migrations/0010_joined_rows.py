"""Request rows joined across traces (`joined_by`, `linked_trace_ids`, a bloom filter to find them) and the
gateways a request went through (`gateway`).

Why: when a hop does not pass `traceparent` on (LiteLLM by default, OpenInference's OpenAI instrumentor without
an HTTP client instrumentation), one call lands in two traces. The decomposition joins the pieces by the
response id both sides record (traces/joins.py) into one row, which belongs to the engine's trace and names the
others in `linked_trace_ids`; `joined_by` says how ('response_id'; '' for a row of one trace). A lookup by any of
the traces (`GET /api/v1/requests?trace_id=`) finds the row through `idx_linked_traces`.

The partners of a loose end are found in `llm_calls` by `request_id` (ordered by trace id, so without an index
every lookup would read the project's whole `request_id` column): `idx_request_id`. Parts written before this
migration have no index entries and are read whole by those lookups until merged; nothing is materialised here,
so the migration costs nothing on a large store.

`gateway` is the services of the row's gateway hops, outermost first, joined by ' > ' (e.g. 'litellm-proxy >
llm-gateway'; '' for none), so summaries can group and filter by the path a request took ("are the requests
through LiteLLM slower than the direct ones?"). The rollups do not carry it (their sorting key cannot take
another column re-runnably after 0006's): a summary grouped or filtered by gateway reads the request rows.
Rows written before this migration have '' until their trace is decomposed again.

backwards drops the columns and the indexes.
"""
from traces.ch_schema import RenderContext

blocking = False

_REQUEST_COLUMNS = (
    "ADD COLUMN IF NOT EXISTS `joined_by` LowCardinality(String) DEFAULT '' AFTER `gateway_ms`",
    "ADD COLUMN IF NOT EXISTS `linked_trace_ids` Array(String) AFTER `joined_by`",
    "ADD COLUMN IF NOT EXISTS `gateway` LowCardinality(String) AFTER `replica_group`",
)
_REQUEST_INDEX = "ADD INDEX IF NOT EXISTS idx_linked_traces linked_trace_ids TYPE bloom_filter(0.001) GRANULARITY 1"
_CALL_INDEX = "ADD INDEX IF NOT EXISTS idx_request_id request_id TYPE bloom_filter(0.001) GRANULARITY 1"


def forwards(ctx: RenderContext) -> list[str]:
    if ctx.cluster:
        # Columns on the local tables and the Distributed ones; indexes on the local (MergeTree) tables only.
        statements = []
        for table in ("llm_requests_local", "llm_requests"):
            statements += [f"ALTER TABLE {ctx.qualified(table)}{ctx.on_cluster} {change}" for change in _REQUEST_COLUMNS]
        statements.append(f"ALTER TABLE {ctx.qualified('llm_requests_local')}{ctx.on_cluster} {_REQUEST_INDEX}")
        statements.append(f"ALTER TABLE {ctx.qualified('llm_calls_local')}{ctx.on_cluster} {_CALL_INDEX}")
        return statements
    return ([f"ALTER TABLE {ctx.qualified('llm_requests')} {change}" for change in _REQUEST_COLUMNS]
            + [f"ALTER TABLE {ctx.qualified('llm_requests')} {_REQUEST_INDEX}",
               f"ALTER TABLE {ctx.qualified('llm_calls')} {_CALL_INDEX}"])


def backwards(ctx: RenderContext) -> list[str]:
    requests = "llm_requests_local" if ctx.cluster else "llm_requests"
    calls = "llm_calls_local" if ctx.cluster else "llm_calls"
    statements = [f"ALTER TABLE {ctx.qualified(requests)}{ctx.on_cluster} DROP INDEX IF EXISTS idx_linked_traces",
                  f"ALTER TABLE {ctx.qualified(calls)}{ctx.on_cluster} DROP INDEX IF EXISTS idx_request_id"]
    for table in (["llm_requests_local", "llm_requests"] if ctx.cluster else ["llm_requests"]):
        statements += [f"ALTER TABLE {ctx.qualified(table)}{ctx.on_cluster} DROP COLUMN IF EXISTS `{column}`"
                       for column in ("linked_trace_ids", "joined_by", "gateway")]
    return statements
