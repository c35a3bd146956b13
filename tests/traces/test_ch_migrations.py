"""ClickHouse migrations: discovery, apply-once bookkeeping, the migrate_clickhouse command, cluster
rendering, idempotent DDL, and the store's tenant guard.

Store-level tests run in this process on the session chdb path (chdb opens one data directory
per process), each on a database of its own; the management command runs in subprocesses with
their own OBSERVATORY_DATA_DIR.
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from traces import ch_migrate
from traces.ch_schema import RenderContext, Table
from traces.store import ClickHouseStore, TenantFilterMissing, identifier

# Mode-independent (ClickHouse's schema migrations): CI runs it once, in the server suite (tests/conftest.py).
pytestmark = pytest.mark.mode_independent(suite="server")

ROOT = Path(__file__).resolve().parents[2]
INITIAL = importlib.import_module("traces.ch_migrations.0001_initial")
SINGLE = RenderContext(database="observatory")
CLUSTER = RenderContext(database="observatory", cluster="prod")


# -- helpers ---------------------------------------------------------------------------------------
@pytest.fixture
def migration_package(tmp_path, monkeypatch):
    """write(files: {module name: source}) -> the name of a fresh importable package holding them."""
    root = tmp_path / "pkgroot"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    created = []

    def write(files: dict[str, str], name: str | None = None) -> str:
        name = name or f"chmig_{uuid.uuid4().hex[:10]}"
        package = root / name
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text('"""test migrations"""\n')
        for module, source in files.items():
            (package / f"{module}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        created.append(name)
        return name

    yield write
    for name in created:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


def table_migration(table: str, column: str = "x UInt32") -> str:
    return f'''
        blocking = False

        def forwards(ctx):
            return [f"CREATE TABLE IF NOT EXISTS {{ctx.qualified('{table}')}} ({column}) ENGINE = MergeTree ORDER BY tuple()"]

        def backwards(ctx):
            return [f"DROP TABLE IF EXISTS {{ctx.qualified('{table}')}}"]
    '''


def forget(package: str) -> None:
    """Drop a test package from the import cache so edited files are read again."""
    for module in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[module]
    importlib.invalidate_caches()


def tables_of(store: ClickHouseStore) -> set[str]:
    rows = store.system_query("SELECT name FROM system.tables WHERE database = {db:String}",
                              parameters={"db": store.database})
    return {r[0] for r in rows}


def recorded(store: ClickHouseStore) -> list[str]:
    rows = store.system_query(f"SELECT name FROM {store.table('schema_migrations')} ORDER BY name")
    return [r[0] for r in rows]


def all_statements():
    """(label, statement) for every DDL statement of every real migration, single server and cluster."""
    for migration in ch_migrate.discover():
        for ctx in (SINGLE, CLUSTER):
            kind = "cluster" if ctx.cluster else "single"
            for direction in ("forwards", "backwards"):
                for statement in getattr(migration, direction)(ctx):
                    yield f"{migration.name}/{direction}/{kind}", statement
    for ctx in (SINGLE, CLUSTER):
        for statement in ch_migrate.STATE_TABLE.create_statements(ctx):
            yield f"schema_migrations/{ctx.cluster or 'single'}", statement


def flat(statement: str) -> str:
    return " ".join(statement.split())


# -- discovery -------------------------------------------------------------------------------------
def test_discover_real_migrations_are_numbered_ordered_and_complete():
    migrations = ch_migrate.discover()
    assert migrations, "there must be at least the initial migration"
    numbers = [m.number for m in migrations]
    assert numbers == sorted(set(numbers))
    assert migrations[0].name == "0001_initial"
    for m in migrations:
        assert re.fullmatch(r"\d{4}_[a-z0-9_]+", m.name)
        assert int(m.name[:4]) == m.number
        assert m.forwards(SINGLE) and m.backwards(SINGLE)


def test_discover_rejects_two_migrations_with_one_number(migration_package):
    package = migration_package({"0001_first": table_migration("a"), "0001_second": table_migration("b")})
    with pytest.raises(ch_migrate.MigrationError, match="0001"):
        ch_migrate.discover(package)


def test_discover_rejects_a_migration_without_backwards(migration_package):
    package = migration_package({
        "0001_ok": table_migration("a"),
        "0002_no_backwards": "def forwards(ctx):\n    return []\n",
    })
    with pytest.raises(ch_migrate.MigrationError, match="backwards"):
        ch_migrate.discover(package)


def test_discover_orders_by_number_and_ignores_other_modules(migration_package):
    package = migration_package({
        "0010_later": table_migration("c"),
        "0002_second": table_migration("b"),
        "0001_first": table_migration("a"),
        "helpers": "X = 1\n",
        "draft_0003": table_migration("d"),
    })
    assert [m.name for m in ch_migrate.discover(package)] == ["0001_first", "0002_second", "0010_later"]


# -- apply -----------------------------------------------------------------------------------------
def test_real_migrations_apply_once_and_are_recorded(make_store):
    store = make_store()
    names = [m.name for m in ch_migrate.discover()]
    assert [m.name for m in ch_migrate.pending(store)] == names
    assert ch_migrate.apply(store, log=lambda *_: None) == names
    assert {"spans", "llm_calls", "llm_requests", "schema_migrations"} <= tables_of(store)
    assert recorded(store) == names
    # A second run applies nothing and records nothing again.
    assert ch_migrate.pending(store) == []
    assert ch_migrate.apply(store, log=lambda *_: None) == []
    assert recorded(store) == names
    assert ch_migrate.applied_names(store) == set(names)


def test_apply_runs_only_new_migrations_in_number_order(make_store, migration_package):
    store = make_store()
    package = migration_package({"0002_b": table_migration("tb"), "0001_a": table_migration("ta")})
    seen = []
    assert ch_migrate.apply(store, package, log=seen.append) == ["0001_a", "0002_b"]
    assert seen and "0001_a" in seen[0] and "0002_b" in seen[1]
    assert {"ta", "tb"} <= tables_of(store)

    migration_package({"0003_c": table_migration("tc")}, name=package)
    forget(package)
    assert [m.name for m in ch_migrate.pending(store, package)] == ["0003_c"]
    assert ch_migrate.apply(store, package, log=lambda *_: None) == ["0003_c"]
    assert ch_migrate.apply(store, package, log=lambda *_: None) == []
    assert recorded(store) == ["0001_a", "0002_b", "0003_c"]


def test_a_failed_migration_is_not_recorded_and_the_next_run_resumes(make_store, migration_package):
    store = make_store()
    broken = '''
        def forwards(ctx):
            return [f"CREATE TABLE IF NOT EXISTS {ctx.qualified('half')} (x UInt32) ENGINE = MergeTree ORDER BY x",
                    "THIS IS NOT SQL"]

        def backwards(ctx):
            return [f"DROP TABLE IF EXISTS {ctx.qualified('half')}"]
    '''
    package = migration_package({"0001_ok": table_migration("ok"), "0002_broken": broken})
    with pytest.raises(Exception):
        ch_migrate.apply(store, package, log=lambda *_: None)
    assert recorded(store) == ["0001_ok"]
    assert "half" in tables_of(store)  # cut short after its first statement

    fixed = '''
        def forwards(ctx):
            return [f"CREATE TABLE IF NOT EXISTS {ctx.qualified('half')} (x UInt32) ENGINE = MergeTree ORDER BY x",
                    f"CREATE TABLE IF NOT EXISTS {ctx.qualified('rest')} (x UInt32) ENGINE = MergeTree ORDER BY x"]

        def backwards(ctx):
            return []
    '''
    migration_package({"0002_broken": fixed}, name=package)
    forget(package)
    # The repeat runs the already-executed statement again: it must be idempotent.
    assert ch_migrate.apply(store, package, log=lambda *_: None) == ["0002_broken"]
    assert {"half", "rest"} <= tables_of(store)
    assert recorded(store) == ["0001_ok", "0002_broken"]


@pytest.mark.parametrize("cut", range(len(ch_migrate.discover())))
def test_real_migration_ddl_can_run_again_after_a_cut_short_run(make_store, cut):
    """apply() says a run cut short can be repeated: every forwards statement is safe to re-run."""
    store = make_store()
    ctx = ch_migrate.context_for(store)
    migrations = ch_migrate.discover()
    for migration in migrations[:cut]:  # applied, but the process died before recording them
        for statement in migration.forwards(ctx):
            store.command(statement)
    statements = migrations[cut].forwards(ctx)
    for statement in statements[: max(1, len(statements) // 2)]:
        store.command(statement)  # the first half of this one ran, then the process died
    assert ch_migrate.apply(store, log=lambda *_: None) == [m.name for m in migrations]
    for migration in ch_migrate.discover():
        for statement in migration.forwards(ctx):
            store.command(statement)


def test_backwards_then_forwards_round_trip(make_store):
    store = make_store()
    ctx = ch_migrate.context_for(store)
    ch_migrate.apply(store, log=lambda *_: None)
    for migration in reversed(ch_migrate.discover()):
        for statement in migration.backwards(ctx):
            store.command(statement)
        for statement in migration.backwards(ctx):
            store.command(statement)  # IF EXISTS: dropping twice is fine
    assert not ({"spans", "llm_calls", "llm_requests"} & tables_of(store))
    for migration in ch_migrate.discover():
        for statement in migration.forwards(ctx):
            store.command(statement)
    assert {"spans", "llm_calls", "llm_requests"} <= tables_of(store)


# -- DDL shape -------------------------------------------------------------------------------------
def statement_params(only_cluster: bool = False):
    items = [(label, st) for label, st in all_statements()
             if not only_cluster or "/cluster" in label or label.endswith("/prod")]
    return [pytest.param(label, st, id=f"{label}#{i}") for i, (label, st) in enumerate(items)]


@pytest.mark.parametrize("label,statement", statement_params())
def test_every_statement_is_idempotent(label, statement):
    s = flat(statement).upper()
    verb = s.split(" ", 1)[0]
    if verb == "CREATE":
        assert re.match(r"CREATE (TABLE|MATERIALIZED VIEW|VIEW|DICTIONARY|DATABASE) IF NOT EXISTS ", s), statement
    elif verb == "DROP":
        assert re.match(r"DROP (TABLE|VIEW|DICTIONARY|DATABASE) IF EXISTS ", s), statement
    elif verb == "ALTER":
        bad = re.findall(r"\b(ADD|DROP|MODIFY|CLEAR|MATERIALIZE) (COLUMN|INDEX|PROJECTION|CONSTRAINT)\b(?! IF)", s)
        assert not bad, statement
    elif verb == "TRUNCATE":  # emptying derived data (rollup build records) is the same done twice
        assert re.match(r"TRUNCATE TABLE IF EXISTS ", s), statement
    else:
        pytest.fail(f"{label}: statement kind {verb} is not known to be idempotent; extend this test if intended")


@pytest.mark.parametrize("label,statement", statement_params(only_cluster=True))
def test_cluster_statements_run_on_the_cluster_and_parse(make_store, label, statement):
    assert " ON CLUSTER `prod`" in flat(statement), statement
    # ClickHouse's own parser (formatQuery) must accept the DDL even though no cluster exists here.
    store = make_store()
    store.system_query("SELECT formatQuery({q:String})", parameters={"q": statement})


def test_cluster_render_uses_replicated_local_tables_and_distributed_fronts():
    statements = [flat(s) for s in INITIAL.forwards(CLUSTER)]
    for table in INITIAL.TABLES:
        local = f"{table.name}_local"
        create_local = [s for s in statements if s.startswith(f"CREATE TABLE IF NOT EXISTS `observatory`.`{local}` ")]
        assert len(create_local) == 1, table.name
        engine_name, _, args = table.engine.partition("(")
        args = args[:-1] if args.endswith(")") else args
        zk = f"'/clickhouse/tables/{{shard}}/observatory/{local}', '{{replica}}'"
        expected = f"ENGINE = Replicated{engine_name}({zk}{', ' + args if args else ''})"
        assert expected in create_local[0], (expected, create_local[0])
        front = [s for s in statements if s.startswith(f"CREATE TABLE IF NOT EXISTS `observatory`.`{table.name}` ")]
        assert len(front) == 1, table.name
        assert f"AS `observatory`.`{local}`" in front[0]
        assert (f"ENGINE = Distributed(`prod`, `observatory`, `{local}`, {table.sharding_key})") in front[0]
        # Rows that are deduplicated together must land on one shard: shard by trace.
        assert "trace_id" in table.sharding_key
    # The local table comes before its Distributed front.
    for table in INITIAL.TABLES:
        local_i = next(i for i, s in enumerate(statements) if f"`{table.name}_local` ON CLUSTER" in s
                       and s.startswith("CREATE"))
        front_i = next(i for i, s in enumerate(statements) if f"`observatory`.`{table.name}` ON CLUSTER" in s)
        assert local_i < front_i
    drops = [flat(s) for s in INITIAL.backwards(CLUSTER)]
    for table in INITIAL.TABLES:
        assert any(f"`{table.name}_local` ON CLUSTER `prod`" in d for d in drops)
        assert any(f"`observatory`.`{table.name}` ON CLUSTER `prod`" in d for d in drops)


def test_single_server_render_has_no_cluster_parts():
    for statement in INITIAL.forwards(SINGLE) + INITIAL.backwards(SINGLE):
        s = flat(statement)
        assert "ON CLUSTER" not in s and "Replicated" not in s and "Distributed" not in s and "_local" not in s


@pytest.mark.parametrize(
    "engine,expected_tail",
    [
        ("MergeTree", ""),
        ("MergeTree()", ""),
        ("ReplacingMergeTree(version, is_deleted)", ", version, is_deleted"),
        ("SummingMergeTree((requests, errors))", ", (requests, errors)"),
        ("AggregatingMergeTree()", ""),
        ("CollapsingMergeTree(sign)", ", sign"),
    ],
)
def test_replicated_engine_keeps_the_engine_arguments_intact(make_store, engine, expected_tail):
    table = Table(name="rollup", columns=(("project_id", "UInt32"), ("requests", "UInt64"), ("errors", "UInt64"),
                                          ("version", "UInt64"), ("is_deleted", "UInt8"), ("sign", "Int8")),
                  engine=engine, order_by="project_id")
    local = flat(table.create_statements(RenderContext(database="db", cluster="c1"))[0])
    name = engine.split("(", 1)[0]
    assert f"ENGINE = Replicated{name}('/clickhouse/tables/{{shard}}/db/rollup_local', '{{replica}}'{expected_tail})" \
        in local, local
    store = make_store()
    store.system_query("SELECT formatQuery({q:String})", parameters={"q": local})
    # And the single-server form really creates the table.
    single = table.create_statements(RenderContext(database=store.database))[0]
    store.command(single)
    assert "rollup" in tables_of(store)


# -- the management command (subprocesses: the chdb directory belongs to them) ----------------------
def manage(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OBSERVATORY_DATA_DIR": str(data_dir), "LOG_LEVEL": "WARNING"}
    env.pop("CLICKHOUSE_URL", None)
    env.pop("CLICKHOUSE_CLUSTER", None)
    return subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate_clickhouse", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def chdb_tables(data_dir: Path) -> set[str]:
    code = textwrap.dedent(f"""
        import clickhouse_connect
        c = clickhouse_connect.get_client(dsn="chdb://{data_dir / 'chdb'}")
        print("\\n".join(r[0] for r in c.query(
            "SELECT name FROM system.tables WHERE database = 'observatory'").result_rows))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return {line for line in out.stdout.split() if line}


# In the embedded suite: the suites start together, and the server one ran about a minute and a half longer.
@pytest.mark.mode_independent(suite="embedded")
def test_migrate_clickhouse_command_check_plan_apply(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()

    check = manage(data_dir, "--check")
    assert check.returncode != 0, check
    assert "0001_initial" in check.stderr + check.stdout

    plan = manage(data_dir, "--plan")
    assert plan.returncode == 0, plan.stderr
    assert "-- 0001_initial" in plan.stdout
    assert "CREATE TABLE IF NOT EXISTS `observatory`.`spans`" in plan.stdout
    assert "ON CLUSTER" not in plan.stdout
    # --plan changed nothing: still pending, and none of the migration's tables exist.
    assert manage(data_dir, "--check").returncode != 0
    assert not ({"spans", "llm_calls", "llm_requests"} & chdb_tables(data_dir))

    applied = manage(data_dir)
    assert applied.returncode == 0, applied.stderr
    assert "0001_initial" in applied.stdout
    assert {"spans", "llm_calls", "llm_requests", "schema_migrations"} <= chdb_tables(data_dir)

    check = manage(data_dir, "--check")
    assert check.returncode == 0, check.stderr
    again = manage(data_dir)
    assert again.returncode == 0 and "nothing to apply" in again.stdout
    plan = manage(data_dir, "--plan")
    assert plan.returncode == 0 and "CREATE TABLE" not in plan.stdout


def test_plan_and_check_create_nothing(tmp_path):
    """--plan is documented as 'change nothing' and --check is a read-only probe (CI, read-only users):
    neither may create tables, not even the bookkeeping table."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    assert manage(data_dir, "--plan").returncode == 0
    assert manage(data_dir, "--check").returncode != 0
    assert chdb_tables(data_dir) == set()


def test_plan_for_a_cluster_renders_without_touching_the_store(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    plan = manage(data_dir, "--plan", "--cluster", "prod")
    assert plan.returncode == 0, plan.stderr
    out = plan.stdout
    for table in ("spans", "llm_calls", "llm_requests"):
        assert f"CREATE TABLE IF NOT EXISTS `observatory`.`{table}_local` ON CLUSTER `prod`" in out
        assert f"CREATE TABLE IF NOT EXISTS `observatory`.`{table}` ON CLUSTER `prod` AS `observatory`.`{table}_local`" \
            in out
        assert f"Distributed(`prod`, `observatory`, `{table}_local`" in out
    assert "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/observatory/llm_requests_local', '{replica}', " \
           "version, is_deleted)" in out
    statements = [s for s in out.split(";\n") if s.strip().startswith("CREATE")]
    assert statements and all("IF NOT EXISTS" in s and "ON CLUSTER `prod`" in s for s in statements)
    # Rendering for a cluster applies nothing.
    assert manage(data_dir, "--check").returncode != 0


def test_plan_cluster_name_must_be_an_identifier(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    result = manage(data_dir, "--plan", "--cluster", "prod`; DROP DATABASE observatory; --")
    assert result.returncode != 0
    assert "DROP DATABASE observatory" not in result.stdout


# -- the store: identifiers and the tenant guard ---------------------------------------------------
@pytest.mark.parametrize("name", ["a-b", "x; DROP TABLE y", "`quoted`", "1abc", "", "db.table"])
def test_identifier_refuses_anything_but_a_plain_name(name):
    with pytest.raises(ValueError):
        identifier(name)
    with pytest.raises(ValueError):
        ClickHouseStore(url=None, chdb_path="/nonexistent", database=name)


def test_tenant_queries_must_filter_on_the_project(make_store):
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    table = store.table("llm_calls")
    with pytest.raises(TenantFilterMissing):
        store.query(f"SELECT count() FROM {table}", project_id=1)
    with pytest.raises(TenantFilterMissing):
        store.query(f"SELECT count() FROM {table} WHERE project_id = {{project:UInt32}}", project_id=1,
                    parameters={"project": 1})
    with pytest.raises(TenantFilterMissing):
        store.query_json(f"SELECT count() FROM {table} WHERE project_id = 1", project_id=1)
    with pytest.raises(TenantFilterMissing):
        store.tenant_command(f"ALTER TABLE {table} DELETE WHERE project_id = 1", project_id=1)
    with pytest.raises(TenantFilterMissing):
        store.query(f"SELECT count() FROM {table} WHERE project_id = {{project_id:UInt64}}", project_id=1)


def test_tenant_query_sees_only_its_project(make_store):
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    store.command(
        f"INSERT INTO {store.table('llm_requests')} "
        "(project_id, trace_id, request_key, start_time, hops, version, retention_days) VALUES "
        "(1, 't1', 'k1', now64(6), '[]', 1, 30), (2, 't2', 'k2', now64(6), '[]', 1, 30), "
        "(2, 't3', 'k3', now64(6), '[]', 1, 30)"
    )
    sql = f"SELECT trace_id FROM {store.table('llm_requests')} WHERE project_id = {{project_id:UInt32}} ORDER BY trace_id"
    assert store.query(sql, project_id=1) == [("t1",)]
    assert store.query(sql, project_id=2) == [("t2",), ("t3",)]
    assert store.query_json(sql, project_id=2) == [["t2"], ["t3"]]
    # The caller cannot override the project through parameters.
    assert store.query(sql, project_id=1, parameters={"project_id": 2}) == [("t1",)]


MERGE_SELECTOR = importlib.import_module("traces.ch_migrations.0008_merge_selector_base")


def test_the_span_tables_merge_twenty_parts_at_a_time_where_the_server_knows_the_setting(make_store):
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    ctx = ch_migrate.context_for(store)
    assert ctx.knows_setting("merge_selector_base") and "merge_selector_base" in ctx.merge_tree_settings
    engines = dict(store.system_query(
        "SELECT name, engine_full FROM system.tables WHERE database = {db:String}", parameters={"db": store.database}))
    for table in ("spans", "llm_calls"):
        assert "merge_selector_base = 20" in engines[table], engines[table]
    assert "merge_selector_base" not in engines["llm_requests"]


def test_a_server_without_the_setting_gets_no_statement_and_plans_render_it():
    older = RenderContext(database="observatory", merge_tree_settings=frozenset({"index_granularity"}))
    assert MERGE_SELECTOR.forwards(older) == [] and MERGE_SELECTOR.backwards(older) == []
    assert MERGE_SELECTOR.forwards(SINGLE) == [
        "ALTER TABLE `observatory`.`spans` MODIFY SETTING merge_selector_base = 20",
        "ALTER TABLE `observatory`.`llm_calls` MODIFY SETTING merge_selector_base = 20",
    ]
    assert all("`spans_local` ON CLUSTER `prod`" in s or "`llm_calls_local` ON CLUSTER `prod`" in s
               for s in MERGE_SELECTOR.forwards(CLUSTER))
