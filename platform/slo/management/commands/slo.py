"""`manage.py slo apply FILE [--dry-run] [--prune] [--project P]` and `manage.py slo list [--project P]`."""
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from slo import definitions, yaml_format
from slo.models import SLO


class Command(BaseCommand):
    help = "Load SLO definitions from YAML (docs/slo.md) or list the SLOs."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        apply = sub.add_parser("apply", help="create/update SLOs from a YAML file, by (project, name)")
        apply.add_argument("file", help="YAML file ('-' for standard input)")
        apply.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
        apply.add_argument("--prune", action="store_true",
                           help="also delete the SLOs of the file's projects that the file does not define")
        apply.add_argument("--project", default=None, help="use this project for every document of the file")
        listing = sub.add_parser("list", help="list SLOs with their latest state")
        listing.add_argument("--project", default=None)

    def handle(self, *args, action, **options):
        if action == "apply":
            return self.apply(options["file"], dry_run=options["dry_run"], prune=options["prune"],
                              project=options["project"])
        return self.list_slos(options["project"])

    def apply(self, file: str, *, dry_run: bool, prune: bool, project: str | None) -> None:
        try:
            text = sys.stdin.read() if file == "-" else Path(file).read_text()
        except OSError as exc:
            raise CommandError(f"cannot read {file}: {exc}") from None
        try:
            plans = yaml_format.plan(text, source=file, prune=prune, project_override=project)
        except yaml_format.FileError as exc:
            raise CommandError("the file was not applied:\n  " + "\n  ".join(exc.problems)) from None
        for line in yaml_format.describe_plan(plans):
            self.stdout.write(line)
        created = sum(len(p.create) for p in plans)
        updated = sum(len(p.update) for p in plans)
        deleted = sum(len(p.delete) for p in plans)
        unchanged = sum(len(p.unchanged) for p in plans)
        summary = f"{created} created, {updated} updated, {deleted} deleted, {unchanged} unchanged"
        if dry_run:
            self.stdout.write(f"dry run: {summary} (nothing written)")
            return
        yaml_format.apply(plans)
        self.stdout.write(summary)

    def list_slos(self, project: str | None) -> None:
        slos = SLO.objects.select_related("project").order_by("project__name", "name")
        if project:
            slos = slos.filter(project__name=project)
        for slo in slos:
            sli = slo.sli if slo.threshold_ms is None else f"{slo.sli}<={slo.threshold_ms:g}ms"
            if slo.threshold is not None:
                sli = f"{slo.sli}<={slo.threshold:.4g}"
            status = slo.last_status or {}
            budget = status.get("budget_remaining")
            self.stdout.write(
                f"{slo.project.name}/{slo.name}\t{sli}\t{definitions.format_objective(slo.objective)}/{slo.period_days}d"
                f"\t{'enabled' if slo.enabled else 'disabled'}\t{slo.last_state or 'pending'}"
                f"\tbudget={'n/a' if budget is None else f'{budget:.1%}'}"
            )
