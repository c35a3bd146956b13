"""The rollups tell engine-served requests from cache-served ones and carry the prefix cache's sums.

Why: hit ratios over 7 or 30 days must come from the rollups as every other long-range figure does, and the
engine's own latency (summaries, SLOs, tuning) must be readable without the requests a gateway answered from its
response cache, which would otherwise pass for a fast engine (issue 40).

- `served_from` joins the sorting key of the hourly and daily rollups and of `request_rollup_hourly_totals`,
  after `replica_group` (as 0006 added the replica group: a column added without DEFAULT may extend the key).
  Chosen over per-class counts: a count cannot take the cache-served rows out of a latency digest, and the key
  costs no row where nothing is served from a cache (one more row per group and hour only where something is).
- Sums (UInt64/Float64, per group like `requests`): `sum_prompt_tokens` (every row's prompt tokens),
  `sum_reported_prompt_tokens` and `sum_cached_prompt_tokens` (over the rows that report cached tokens: the token
  hit ratio is their quotient), `cache_reported_requests` (cached tokens not NULL), `cache_hit_requests` (cached
  tokens > 0), and `sum_prefill_ms` / `sum_uncached_prompt_tokens` (engine rows with prefill, prompt and cached
  tokens known: prefill time per prompt token the engine computed). traces/rollups.py CACHE_SUMS defines them.

forwards drops the three rollup tables and makes them again as 0011 left them before it alters them (so that
every statement can run again; see forwards). The build records are emptied, so every touched hour and day is rolled up again with them (until then an hour is
not clean and is read from its rows, as any dirty hour). backwards drops the columns, restores the sorting keys of
0006/0011 (a column cannot leave a key: the rollup tables are dropped and recreated as 0002/0003/0006/0011 left
them) and empties the build records again.
"""
import importlib

from traces.ch_schema import RenderContext

blocking = False

SUMS = (
    ("sum_prompt_tokens", "UInt64"), ("sum_reported_prompt_tokens", "UInt64"), ("sum_cached_prompt_tokens", "UInt64"),
    ("cache_reported_requests", "UInt64"), ("cache_hit_requests", "UInt64"), ("sum_prefill_ms", "Float64"),
    ("sum_uncached_prompt_tokens", "UInt64"),
)
_KEYS = {
    "request_rollup_hourly": "project_id, hour, service, model, engine_config, prompt_bucket, replica_group",
    "request_rollup_daily": "project_id, day, service, model, engine_config, prompt_bucket, replica_group",
    "request_rollup_hourly_totals": "project_id, hour, replica_group",
}
_BUILDS = ("request_rollup_builds", "request_rollup_daily_builds")


def _local(ctx: RenderContext, table: str) -> str:
    return ctx.qualified(table + "_local" if ctx.cluster else table)


def _truncate(ctx: RenderContext) -> list[str]:
    return [f"TRUNCATE TABLE IF EXISTS {_local(ctx, name)}{ctx.on_cluster}" for name in _BUILDS]


def forwards(ctx: RenderContext) -> list[str]:
    # The rollups are first made again as 0011 left them: a column cannot join a sorting key twice (ClickHouse
    # refuses an existing column in the expression added to a key), and a run of 0006 repeated after this one (a
    # run cut short repeats every unrecorded migration) takes `served_from` back out of the key while the column
    # stays. Rebuilt tables let every forwards statement run again in any such order; rollups are derived data.
    statements = _as_0011_left_them(ctx)
    adds = ["ADD COLUMN IF NOT EXISTS `served_from` LowCardinality(String) AFTER `replica_group`"]
    adds += [f"ADD COLUMN IF NOT EXISTS `{name}` {column_type}" for name, column_type in SUMS]
    for table, key in _KEYS.items():
        # The sorting key lives on the (replicated) local table; a Distributed front only gets the columns.
        statements.append(f"ALTER TABLE {_local(ctx, table)}{ctx.on_cluster} {', '.join(adds)}, "
                          f"MODIFY ORDER BY ({key}, served_from)")
        if ctx.cluster:
            statements.append(f"ALTER TABLE {ctx.qualified(table)}{ctx.on_cluster} {', '.join(adds)}")
    return statements + _truncate(ctx)


def backwards(ctx: RenderContext) -> list[str]:
    return _as_0011_left_them(ctx) + _truncate(ctx)


def _as_0011_left_them(ctx: RenderContext) -> list[str]:
    """The three rollup tables dropped and made again as 0002/0003/0006/0011 left them."""
    migrations = {name: importlib.import_module(f"traces.ch_migrations.{name}")
                  for name in ("0002_request_rollups", "0003_daily_rollups", "0006_replica_group", "0011_rollup_means")}
    rollups = (migrations["0002_request_rollups"].ROLLUP, migrations["0003_daily_rollups"].DAILY)
    statements = [s for table in (*rollups, migrations["0011_rollup_means"].TOTALS) for s in table.drop_statements(ctx)]
    statements += [s for table in rollups for s in table.create_statements(ctx)]
    # Then what 0006 and 0011 did to them (both idempotent: every other table they touch is left as it is; 0011
    # creates the totals table and empties the build records).
    return statements + migrations["0006_replica_group"].forwards(ctx) + migrations["0011_rollup_means"].forwards(ctx)
