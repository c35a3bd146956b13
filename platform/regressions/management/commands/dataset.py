"""`manage.py dataset import FILE --project P --name NAME [--format openai|vllm|sharegpt] [--replace]`,
`manage.py dataset list [--project P]`, `manage.py dataset export --project P --name NAME [--version N]`."""
import json
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from jobs.commands import project_named

from regressions.datasets import FORMATS, DatasetError, parse_file, resolve_version, write_version
from regressions.models import Dataset


class Command(BaseCommand):
    help = "Import, list and export golden datasets (docs/regressions.md)."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        imp = sub.add_parser("import", help="import a file as a new version of a dataset (created if missing)")
        imp.add_argument("file", help="JSONL (openai, vllm) or JSON (sharegpt) file; '-' for standard input")
        imp.add_argument("--project", required=True)
        imp.add_argument("--name", required=True, help="dataset name")
        imp.add_argument("--format", choices=FORMATS, default="openai")
        imp.add_argument("--replace", action="store_true",
                         help="the new version holds only the file's items (default: upsert by id into the latest)")
        imp.add_argument("--note", default="", help="a note kept with the version")
        listing = sub.add_parser("list", help="datasets and their versions")
        listing.add_argument("--project", default=None)
        export = sub.add_parser("export", help="print a version's items as JSONL (the openai format)")
        export.add_argument("--project", required=True)
        export.add_argument("--name", required=True)
        export.add_argument("--version", type=int, default=None)

    def handle(self, *args, action, **options):
        return getattr(self, f"do_{action}")(**options)

    def do_import(self, file, project, name, format, replace, note, **_):
        if len(name) > 100 or not name.strip():
            raise CommandError("--name must be 1-100 characters")
        try:
            data = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
        except OSError as exc:
            raise CommandError(f"cannot read {file}: {exc}") from None
        try:
            items = parse_file(data, format)
            version = write_version(project_named(project), name, items, source=f"import {format} {Path(file).name}"[:200],
                                    created_by="manage.py", note=note, replace=replace)
        except DatasetError as exc:
            raise CommandError(f"nothing was imported; {len(exc.problems)} problem(s):\n  "
                               + "\n  ".join(exc.problems)) from None
        self.stdout.write(f"dataset {name!r} version {version.number}: {version.item_count} items "
                          f"({len(items)} from {file})")

    def do_list(self, project=None, **_):
        datasets = Dataset.objects.select_related("project").order_by("project__name", "name")
        if project:
            datasets = datasets.filter(project=project_named(project))
        for dataset in datasets:
            latest = dataset.latest()
            self.stdout.write(f"{dataset.project.name}/{dataset.name}: version {latest.number if latest else '-'}, "
                              f"{latest.item_count if latest else 0} items")

    def do_export(self, project, name, version=None, **_):
        try:
            found = resolve_version(project_named(project), name, version)
        except LookupError as exc:
            raise CommandError(str(exc)) from None
        for item in found.items.order_by("position"):
            self.stdout.write(json.dumps(item.as_dict(), ensure_ascii=False))
