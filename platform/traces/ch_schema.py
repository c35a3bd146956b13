"""Declarative ClickHouse tables rendered as DDL for a single server/chdb or for a cluster (Replicated + Distributed)."""
from __future__ import annotations

import dataclasses

from .store import identifier


@dataclasses.dataclass(frozen=True)
class RenderContext:
    database: str
    cluster: str = ""  # a name from the server's remote_servers; '' for one server or chdb
    # The MergeTree settings the server knows (system.merge_tree_settings), for migrations that tune a
    # setting older servers lack; None when rendered without asking a server (every statement rendered).
    merge_tree_settings: frozenset[str] | None = None

    def knows_setting(self, name: str) -> bool:
        return self.merge_tree_settings is None or name in self.merge_tree_settings

    @property
    def on_cluster(self) -> str:
        return f" ON CLUSTER {identifier(self.cluster)}" if self.cluster else ""

    def qualified(self, name: str) -> str:
        return f"{identifier(self.database)}.{identifier(name)}"


@dataclasses.dataclass(frozen=True)
class Table:
    """One MergeTree-family table.

    In a cluster it becomes `<name>_local` (Replicated engine, ON CLUSTER) plus a
    Distributed `<name>` sharded by `sharding_key`, so every query keeps using `<name>`.
    The sharding key keeps the rows that must be deduplicated together on one shard.
    """

    name: str
    columns: tuple[tuple[str, str], ...]
    engine: str  # e.g. "ReplacingMergeTree(version, is_deleted)"
    order_by: str
    partition_by: str = ""
    ttl: str = ""
    indexes: tuple[str, ...] = ()
    settings: str = "index_granularity = 8192"
    sharding_key: str = "rand()"

    def create_statements(self, ctx: RenderContext) -> list[str]:
        columns = ",\n    ".join([f"{identifier(n)} {t}" for n, t in self.columns] + list(self.indexes))
        tail = [f"ORDER BY ({self.order_by})"]
        if self.partition_by:
            tail.insert(0, f"PARTITION BY {self.partition_by}")
        if self.ttl:
            tail.append(f"TTL {self.ttl}")
        if self.settings:
            tail.append(f"SETTINGS {self.settings}")
        body = "\n".join(tail)
        if not ctx.cluster:
            return [
                f"CREATE TABLE IF NOT EXISTS {ctx.qualified(self.name)}\n(\n    {columns}\n)\n"
                f"ENGINE = {self.engine}\n{body}"
            ]
        local = f"{self.name}_local"
        engine_name, _, args = self.engine.partition("(")
        if args.endswith(")"):
            args = args[:-1]  # only the engine's own closing parenthesis: its arguments may hold more
        args = args.strip()
        zk_path = f"'/clickhouse/tables/{{shard}}/{ctx.database}/{local}', '{{replica}}'"
        replicated = f"Replicated{engine_name}({zk_path}{', ' + args if args else ''})"
        return [
            f"CREATE TABLE IF NOT EXISTS {ctx.qualified(local)}{ctx.on_cluster}\n(\n    {columns}\n)\n"
            f"ENGINE = {replicated}\n{body}",
            f"CREATE TABLE IF NOT EXISTS {ctx.qualified(self.name)}{ctx.on_cluster} AS {ctx.qualified(local)}\n"
            f"ENGINE = Distributed({identifier(ctx.cluster)}, {identifier(ctx.database)}, {identifier(local)}, "
            f"{self.sharding_key})",
        ]

    def drop_statements(self, ctx: RenderContext) -> list[str]:
        names = [self.name, f"{self.name}_local"] if ctx.cluster else [self.name]
        return [f"DROP TABLE IF EXISTS {ctx.qualified(n)}{ctx.on_cluster} SYNC" for n in names]
