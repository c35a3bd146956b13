"""LLM calls and request rows say how many prompt tokens came from a cache, and what served the request.

Why: a request row said how long prefill took but not how many prompt tokens vLLM's prefix cache supplied,
so "prefill doubled" could not be told from "the shared system prompt stopped hitting"; and a gateway with a
response cache answers some requests without any engine, which must not pass for a fast engine (issue 40).

- `llm_calls`: `cached_prompt_tokens` Nullable(UInt32) (the hop's own report: GenAI
  `gen_ai.usage.cache_read.input_tokens` and its equivalents, collectors/attrs.cached_count),
  `served_from` LowCardinality(Nullable(String)) and `lookup_ms` Nullable(Float64) (the platform gateway's
  `observatory.cache.served_from` / `observatory.cache.lookup_ms`).
- `llm_requests`: `cached_prompt_tokens` Nullable(UInt32) (the engine's, else the nearest gateway's, else the
  client's), `served_from` LowCardinality(String) DEFAULT 'engine' ('exact_cache' | 'semantic_cache' for a
  request the gateway answered from its response cache) and `lookup_ms` Nullable(Float64).

Rows written before this migration read NULL cached tokens (not reported) and `served_from = 'engine'` (the
column's default: no response cache existed). Nothing in a sorting key changes, so the statements re-run.

backwards drops the six columns.
"""
from traces.ch_schema import RenderContext

blocking = False

_COLUMNS = {
    "llm_calls": (("cached_prompt_tokens", "Nullable(UInt32)"), ("served_from", "LowCardinality(Nullable(String))"),
                  ("lookup_ms", "Nullable(Float64)")),
    "llm_requests": (("cached_prompt_tokens", "Nullable(UInt32)"),
                     ("served_from", "LowCardinality(String) DEFAULT 'engine'"), ("lookup_ms", "Nullable(Float64)")),
}


def _names(ctx: RenderContext, table: str) -> list[str]:
    # In a cluster the replicated local table holds the data; the Distributed front gets the columns too.
    return [table + "_local", table] if ctx.cluster else [table]


def forwards(ctx: RenderContext) -> list[str]:
    statements = []
    for table, columns in _COLUMNS.items():
        changes = ", ".join(f"ADD COLUMN IF NOT EXISTS `{name}` {column_type}" for name, column_type in columns)
        statements += [f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} {changes}" for name in _names(ctx, table)]
    return statements


def backwards(ctx: RenderContext) -> list[str]:
    statements = []
    for table, columns in _COLUMNS.items():
        changes = ", ".join(f"DROP COLUMN IF EXISTS `{name}`" for name, _type in columns)
        statements += [f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} {changes}" for name in _names(ctx, table)]
    return statements
