"""`manage.py create_api_token --user NAME [--role viewer|operator|admin] [--project NAME] [--expires-in 90d]`: print a new
API token."""
import datetime as dt

from apikit.inputs import parse_duration
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils import timezone

from tenancy.models import ApiToken, Membership, Project, Role


class Command(BaseCommand):
    help = (
        "Create an API token for a user (created if missing) and print it once. The user is given the role "
        "in --project (default: every existing project when the user has no membership yet)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--user", required=True)
        parser.add_argument("--role", default=Role.VIEWER, choices=[r.value for r in Role])
        parser.add_argument("--project", action="append", default=[], help="grant the role in this project (repeatable)")
        parser.add_argument("--name", default="")
        parser.add_argument("--expires-in", default=None, metavar="DURATION",
                            help="the token expires this long from now (e.g. 30d, 12h; 1m to 3650d); default: never")

    def handle(self, *args, user, role, project, name, expires_in=None, **options):
        expires_at = None
        if expires_in is not None:
            try:
                expires_at = timezone.now() + parse_duration(
                    expires_in, minimum=dt.timedelta(minutes=1), maximum=dt.timedelta(days=3650))
            except ValueError as exc:
                raise CommandError(f"--expires-in: {exc}") from None
        # Every project is checked before anything is written: a typo must not leave a user behind.
        projects = []
        for project_name in project:
            try:
                projects.append(Project.objects.get(name=project_name))
            except Project.DoesNotExist:
                raise CommandError(f"no project named {project_name!r}") from None
        with transaction.atomic():
            account, _ = get_user_model().objects.get_or_create(username=user)
            if not project and not Membership.objects.filter(user=account).exists():
                projects = list(Project.objects.all())
            for proj in projects:
                Membership.objects.update_or_create(user=account, project=proj, defaults={"role": role})
            _, raw = ApiToken.issue(account, role=role, name=name, expires_at=expires_at)
        self.stdout.write(raw)
