"""`manage.py migrate_clickhouse [--plan] [--check]`: bring the ClickHouse schema up to date."""
from django.core.management.base import BaseCommand, CommandError

from traces import ch_migrate
from traces.ch_schema import RenderContext
from traces.store import StoreUnavailable, get_store


class Command(BaseCommand):
    help = "Apply pending ClickHouse migrations (--plan prints the DDL, --check exits 1 when some are pending)."

    def add_arguments(self, parser):
        parser.add_argument("--plan", action="store_true", help="print the DDL that would run, change nothing")
        parser.add_argument("--check", action="store_true", help="exit with status 1 if migrations are pending")
        parser.add_argument("--cluster", default=None, help="with --plan: render for this cluster name")

    def handle(self, *args, plan=False, check=False, cluster=None, **options):
        store = get_store()
        try:
            if plan and cluster is not None:
                ctx = RenderContext(database=store.database, cluster=cluster)
                todo = ch_migrate.discover()
            else:
                ctx = ch_migrate.context_for(store)
                todo = ch_migrate.pending(store, create=False)  # --plan and --check change nothing
            if plan:
                for migration, statements in ch_migrate.render_plan(todo, ctx):
                    self.stdout.write(f"-- {migration.name}{' (blocking)' if migration.blocking else ''}")
                    for statement in statements:
                        self.stdout.write(statement + ";\n")
                if not todo:
                    self.stdout.write("No ClickHouse migrations to apply.")
                return
            if check:
                if todo:
                    names = ", ".join(m.name for m in todo)
                    raise CommandError(f"ClickHouse migrations pending: {names}", returncode=1)
                self.stdout.write("ClickHouse schema is up to date.")
                return
            applied = ch_migrate.apply(store, log=self.stdout.write)
            self.stdout.write(f"ClickHouse: {len(applied)} migration(s) applied." if applied else "ClickHouse: nothing to apply.")
        except StoreUnavailable as exc:
            raise CommandError(
                f"{exc}\nIn embedded mode only one process may open the chdb data directory: "
                "stop the running platform (it applies migrations itself on start) or set CLICKHOUSE_URL."
            ) from exc
        except ch_migrate.MigrationError as exc:
            raise CommandError(str(exc)) from exc
