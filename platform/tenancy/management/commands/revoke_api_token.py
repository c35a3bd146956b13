"""`manage.py revoke_api_token PREFIX_OR_TOKEN`: revoke an API token given its display prefix or the full token."""
from django.core.management.base import BaseCommand, CommandError

from tenancy.models import ApiToken, hash_secret


def find_api_token(prefix_or_token: str) -> ApiToken:
    """The one token whose full value or display prefix (its first 12 characters) is `prefix_or_token`."""
    value = prefix_or_token.strip()
    if not value:
        raise CommandError("give the token's display prefix (e.g. lot_AbCd1234, from list_api_tokens) or the full token")
    by_hash = ApiToken.objects.select_related("user").filter(token_hash=hash_secret(value)).first()
    if by_hash is not None:
        return by_hash
    matches = list(ApiToken.objects.select_related("user").filter(display_prefix=value).order_by("id"))
    if not matches:
        raise CommandError(f"no API token with the prefix or value {value[:12]!r}")
    active = [token for token in matches if token.revoked_at is None]
    if len(active) > 1 or (not active and len(matches) > 1):
        users = ", ".join(sorted({token.user.username for token in matches}))
        raise CommandError(f"{len(matches)} API tokens share the prefix {value!r} (users: {users}); pass the full token")
    return active[0] if active else matches[0]


class Command(BaseCommand):
    help = "Revoke an API token, named by its display prefix (see list_api_tokens) or by the full token; at once."

    def add_arguments(self, parser):
        parser.add_argument("prefix_or_token", help="the token's display prefix (lot_…, 12 characters) or the full token")

    def handle(self, *args, prefix_or_token, **options):
        token = find_api_token(prefix_or_token)
        if token.revoked_at is not None:
            self.stdout.write(f"API token {token.display_prefix} (user {token.user.username}) was already revoked at "
                              f"{token.revoked_at.isoformat()}")
            return
        token.revoke()
        self.stdout.write(f"revoked API token {token.display_prefix} (user {token.user.username}); refused from now on")
