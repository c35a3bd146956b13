"""`manage.py revoke_api_token PREFIX_OR_TOKEN`: revoke an API token given its display prefix or the full token."""
from django.core.management.base import BaseCommand, CommandError

from tenancy.keys import SecretNotFound, find_secret
from tenancy.models import ApiToken


class Command(BaseCommand):
    help = "Revoke an API token, named by its display prefix (see list_api_tokens) or by the full token; at once."

    def add_arguments(self, parser):
        parser.add_argument("prefix_or_token", help="the token's display prefix (lot_…, 12 characters) or the full token")

    def handle(self, *args, prefix_or_token, **options):
        try:
            token = find_secret(ApiToken, prefix_or_token, what="API token", noun="token", owner="user",
                                example="lot_AbCd1234, from list_api_tokens")
        except SecretNotFound as exc:
            raise CommandError(str(exc)) from None
        if token.revoked_at is not None:
            self.stdout.write(f"API token {token.display_prefix} (user {token.user.username}) was already revoked at "
                              f"{token.revoked_at.isoformat()}")
            return
        token.revoke()
        self.stdout.write(f"revoked API token {token.display_prefix} (user {token.user.username}); refused from now on")
