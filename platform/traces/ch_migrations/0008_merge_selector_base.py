"""The span tables (spans, llm_calls) merge their parts less eagerly: merge_selector_base 20 instead of 5.

Why: ingest makes a part every insert (~40k spans), and ClickHouse merges parts of similar size as soon
as their total is `merge_selector_base` times the largest of them, so with the default each span was
rewritten again every time ~5 parts had gathered. Merging ~20 at a time rewrites each row about half as
often: in a 600-batch ingest run (600k spans) the embedded ClickHouse's merges took ~5-6 µs of CPU per
span instead of ~8-9, and ingest ran ~6% faster. The price is more parts at a time (up to ~20 per size
class and day), which lookups by trace id, the only reads of these tables, barely feel. `llm_requests`
keeps the default: one row per request, and the summaries scan it.

A server that does not know the setting (ClickHouse before 25.x) keeps its default; the migration is then
recorded with nothing to do.

backwards restores the default.
"""
from traces.ch_schema import RenderContext

blocking = False

_TABLES = ("spans", "llm_calls")
_SETTING = "merge_selector_base"
_BASE = 20


def _names(ctx: RenderContext) -> list[str]:
    # The MergeTree settings live on the (replicated) local tables of a cluster.
    return [f"{table}_local" if ctx.cluster else table for table in _TABLES]


def forwards(ctx: RenderContext) -> list[str]:
    if not ctx.knows_setting(_SETTING):
        return []
    return [f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} MODIFY SETTING {_SETTING} = {_BASE}"
            for name in _names(ctx)]


def backwards(ctx: RenderContext) -> list[str]:
    if not ctx.knows_setting(_SETTING):
        return []
    return [f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} RESET SETTING {_SETTING}"
            for name in _names(ctx)]
