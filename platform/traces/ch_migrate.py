"""Discover, plan and apply the numbered ClickHouse migrations; applied ones are recorded in `schema_migrations`."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import threading
from types import ModuleType

from .ch_schema import RenderContext, Table
from .store import ClickHouseStore

PACKAGE = "traces.ch_migrations"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)$")

STATE_TABLE = Table(
    name="schema_migrations",
    columns=(("name", "String"), ("applied_at", "DateTime64(3, 'UTC')")),
    engine="ReplacingMergeTree(applied_at)",
    order_by="name",
    settings="",
)


class MigrationError(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Migration:
    number: int
    name: str
    module: ModuleType

    @property
    def blocking(self) -> bool:
        return bool(getattr(self.module, "blocking", False))

    def forwards(self, ctx: RenderContext) -> list[str]:
        return list(self.module.forwards(ctx))

    def backwards(self, ctx: RenderContext) -> list[str]:
        return list(self.module.backwards(ctx))


def discover(package: str = PACKAGE) -> list[Migration]:
    """All migrations in number order; two files with one number is an error."""
    pkg = importlib.import_module(package)
    found: dict[int, Migration] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        match = _NAME.match(info.name)
        if not match:
            continue
        number = int(match.group(1))
        if number in found:
            raise MigrationError(f"duplicate ClickHouse migration number {number:04d}: {found[number].name} and {info.name}")
        module = importlib.import_module(f"{package}.{info.name}")
        for required in ("forwards", "backwards"):
            if not callable(getattr(module, required, None)):
                raise MigrationError(f"{info.name} has no {required}(ctx)")
        found[number] = Migration(number, info.name, module)
    return [found[n] for n in sorted(found)]


def context_for(store: ClickHouseStore) -> RenderContext:
    settings = frozenset(row[0] for row in store.system_query("SELECT name FROM system.merge_tree_settings"))
    return RenderContext(database=store.database, cluster=store.cluster, merge_tree_settings=settings)


def applied_names(store: ClickHouseStore, create: bool = True) -> set[str]:
    """Names of the applied migrations. With create=False nothing is created (--plan, --check): a store
    without the bookkeeping table has applied nothing."""
    # The bookkeeping table needs no server capability: no need to ask for the server's settings.
    ctx = RenderContext(database=store.database, cluster=store.cluster)
    if create:
        for statement in STATE_TABLE.create_statements(ctx):
            store.command(statement)
    else:
        exists = store.system_query(
            "SELECT count() FROM system.tables WHERE database = {db:String} AND name = 'schema_migrations'",
            parameters={"db": store.database},
        )
        if not exists or not exists[0][0]:
            return set()
    rows = store.system_query(f"SELECT name FROM {ctx.qualified('schema_migrations')} FINAL")
    return {row[0] for row in rows}


def pending(store: ClickHouseStore, package: str = PACKAGE, create: bool = True) -> list[Migration]:
    done = applied_names(store, create=create)
    return [m for m in discover(package) if m.name not in done]


def render_plan(migrations: list[Migration], ctx: RenderContext) -> list[tuple[Migration, list[str]]]:
    return [(m, m.forwards(ctx)) for m in migrations]


def apply(store: ClickHouseStore, package: str = PACKAGE, log=print) -> list[str]:
    """Apply every pending migration in order. DDL is idempotent, so a run cut short can be repeated."""
    ctx = context_for(store)
    done: list[str] = []
    for migration, statements in render_plan(pending(store, package), ctx):
        log(f"Applying ClickHouse migration {migration.name} ({len(statements)} statements)")
        for statement in statements:
            store.command(statement)
        store.command(
            f"INSERT INTO {ctx.qualified('schema_migrations')} (name, applied_at) VALUES "
            "({name:String}, now64(3))",
            parameters={"name": migration.name},
        )
        done.append(migration.name)
    return done


class SchemaGate:
    """Applies pending migrations once ClickHouse answers; everything that writes waits behind it.

    The platform must accept data while ClickHouse is away (it goes to the spool), so a
    failure at start is not fatal: the first writer to find the store up migrates it.
    """

    def __init__(self, store: ClickHouseStore, log=print):
        self.store = store
        self.log = log
        self.ready = False
        self._lock = threading.Lock()

    def ensure(self) -> None:
        """Return once the schema is current; raises StoreUnavailable while ClickHouse is away."""
        if self.ready:
            return
        with self._lock:
            if not self.ready:
                apply(self.store, log=self.log)
                self.ready = True
