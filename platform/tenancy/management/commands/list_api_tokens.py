"""`manage.py list_api_tokens [--user NAME] [--all]`: the API tokens, without their secrets."""
from django.core.management.base import BaseCommand

from tenancy.models import ApiToken


def _when(value) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


class Command(BaseCommand):
    help = ("List API tokens: prefix, user, role, name, state (active, expired, revoked), created, last used, "
            "expires. Revoked tokens only with --all.")

    def add_arguments(self, parser):
        parser.add_argument("--user", default=None, help="only this user's tokens")
        parser.add_argument("--all", action="store_true", help="include revoked tokens")

    def handle(self, *args, user=None, all=False, **options):
        tokens = ApiToken.objects.select_related("user").order_by("user__username", "created_at", "id")
        if user:
            tokens = tokens.filter(user__username=user)
        if not all:
            tokens = tokens.filter(revoked_at__isnull=True)
        rows = [("PREFIX", "USER", "ROLE", "NAME", "STATE", "CREATED", "LAST USED", "EXPIRES")]
        for token in tokens:
            rows.append((token.display_prefix, token.user.username, token.role, token.name or "-", token.state,
                         _when(token.created_at), _when(token.last_used_at), _when(token.expires_at) if
                         token.expires_at else "never"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            self.stdout.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
