"""`manage.py create_ingest_key --project NAME`: print a new ingest key (created project if needed)."""
from django.core.management.base import BaseCommand, CommandError
from django.utils.text import slugify

from tenancy.models import IngestKey, Project


class Command(BaseCommand):
    help = "Create an ingest key for a project (the project is created if it does not exist) and print it once."

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True)
        parser.add_argument("--name", default="", help="a label for the key")

    def handle(self, *args, project, name, **options):
        slug = slugify(project)
        if not slug or slug != project:
            raise CommandError(f"project names are slugs (letters, digits, '-', '_'); try {slug!r}" if slug else "empty project name")
        proj, _ = Project.objects.get_or_create(name=slug)
        _, raw = IngestKey.issue(proj, name=name)
        self.stdout.write(raw)
