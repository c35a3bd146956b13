"""`manage.py revoke_ingest_key PREFIX_OR_KEY`: revoke an ingest key given its display prefix or the full key."""
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from tenancy.keys import SecretNotFound, find_secret
from tenancy.models import IngestKey


class Command(BaseCommand):
    help = (
        "Revoke an ingest key, named by its display prefix (the first 12 characters, as shown in the admin) or by "
        "the full key. Running receivers stop accepting it within INGEST_KEY_CACHE_SECONDS."
    )

    def add_arguments(self, parser):
        parser.add_argument("prefix_or_key", help="the key's display prefix (the first 12 characters, lok_…) or the full key")

    def handle(self, *args, prefix_or_key, **options):
        try:
            key = find_secret(IngestKey, prefix_or_key, what="ingest key", noun="key", owner="project", example="lok_AbCd1234")
        except SecretNotFound as exc:
            raise CommandError(str(exc)) from None
        if key.revoked_at is not None:
            self.stdout.write(
                f"ingest key {key.display_prefix} (project {key.project.name}) was already revoked at "
                f"{key.revoked_at.isoformat()}"
            )
            return
        key.revoke()
        self.stdout.write(
            f"revoked ingest key {key.display_prefix} (project {key.project.name}); running receivers refuse it "
            f"within {settings.INGEST['KEY_CACHE_SECONDS']:g} s"
        )
