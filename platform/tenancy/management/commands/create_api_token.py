"""`manage.py create_api_token --user NAME [--role viewer|operator|admin] [--project NAME]`: print a new API token."""
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

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

    def handle(self, *args, user, role, project, name, **options):
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
            _, raw = ApiToken.issue(account, role=role, name=name)
        self.stdout.write(raw)
