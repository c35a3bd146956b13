"""`manage.py revoke_ingest_key PREFIX_OR_KEY`: revoke an ingest key given its display prefix or the full key."""
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from tenancy.models import IngestKey, hash_secret


def find_ingest_key(prefix_or_key: str) -> IngestKey:
    """The one key whose full value or display prefix (its first 12 characters) is `prefix_or_key`."""
    value = prefix_or_key.strip()
    if not value:
        raise CommandError("give the key's display prefix (e.g. lok_AbCd1234) or the full key")
    by_hash = IngestKey.objects.select_related("project").filter(key_hash=hash_secret(value)).first()
    if by_hash is not None:
        return by_hash
    matches = list(IngestKey.objects.select_related("project").filter(display_prefix=value).order_by("id"))
    if not matches:
        raise CommandError(f"no ingest key with the prefix or value {value[:12]!r}")
    active = [key for key in matches if key.revoked_at is None]
    if len(active) > 1 or (not active and len(matches) > 1):
        # Prefixes carry 48 random bits, so this is rare; never revoke a key the caller did not single out.
        projects = ", ".join(sorted({key.project.name for key in matches}))
        raise CommandError(f"{len(matches)} ingest keys share the prefix {value!r} (projects: {projects}); pass the full key")
    return active[0] if active else matches[0]


class Command(BaseCommand):
    help = (
        "Revoke an ingest key, named by its display prefix (the first 12 characters, as shown in the admin) or by "
        "the full key. Running receivers stop accepting it within INGEST_KEY_CACHE_SECONDS."
    )

    def add_arguments(self, parser):
        parser.add_argument("prefix_or_key", help="the key's display prefix (the first 12 characters, lok_…) or the full key")

    def handle(self, *args, prefix_or_key, **options):
        key = find_ingest_key(prefix_or_key)
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
