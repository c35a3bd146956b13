"""Parts of the span tables (spans, llm_calls) stay Compact (one data file) up to 256 MiB uncompressed instead of
10 MiB.

Why: a Wide part writes two files per column and stream (a `spans` part: ~240 files, Map columns
having several streams each), and ingest makes a part every few seconds, then merges them into
bigger ones. Creating files is not free: on a busy ext4 volume, where ClickHouse's own merges
keep deleting parts, each new inode cost ~0.6 ms of kernel CPU, and merges into Wide parts were
~15% of the platform's CPU during an ingest run. A Compact part is ~13 files whatever its
columns. Parts past 256 MiB (older data, merged further) still become Wide, where reading a few
columns of many rows pays off. `llm_requests` keeps the default: summaries read a few of its columns
over many rows, which Wide parts serve best, and it takes one row per request, not per span.

backwards restores the default (10 MiB). Existing parts keep their format until merged again.
"""
from traces.ch_schema import RenderContext

blocking = False

_TABLES = ("spans", "llm_calls")
_BYTES = 256 * 1024 * 1024


def _names(ctx: RenderContext) -> list[str]:
    # The MergeTree settings live on the (replicated) local tables of a cluster.
    return [f"{table}_local" if ctx.cluster else table for table in _TABLES]


def forwards(ctx: RenderContext) -> list[str]:
    return [f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} MODIFY SETTING min_bytes_for_wide_part = {_BYTES}"
            for name in _names(ctx)]


def backwards(ctx: RenderContext) -> list[str]:
    return [f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} RESET SETTING min_bytes_for_wide_part"
            for name in _names(ctx)]
