"""Make sure a user can log in to the dashboard, and say how: `manage.py dashboard_login --user admin`.

A user without a usable password gets a random one, printed once (it is stored hashed, like any Django
password); a user who has one keeps it, and the command says how to change it. The user is made a member of
`--project` with `--role` when it is not one yet (an existing membership keeps its role)."""
from __future__ import annotations

import secrets as _secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from tenancy.models import Membership, Project, Role


class Command(BaseCommand):
    help = "Ensure a dashboard login for a user; prints a generated password the first time."

    def add_arguments(self, parser):
        parser.add_argument("--user", required=True)
        parser.add_argument("--project", help="a project to make the user a member of (created if missing)")
        parser.add_argument("--role", default=Role.ADMIN, choices=[r.value for r in Role])

    def handle(self, *args, user: str, project: str | None, role: str, **options):
        if not user or len(user) > 150:
            raise CommandError("--user takes a user name of 1 to 150 characters")
        User = get_user_model()
        with transaction.atomic():
            account, _ = User.objects.get_or_create(username=user)
            if project:
                target, _ = Project.objects.get_or_create(name=project)
                Membership.objects.get_or_create(user=account, project=target, defaults={"role": role})
            if account.password and account.has_usable_password():
                self.stdout.write(f"user '{user}' (password already set; `python manage.py changepassword {user}` "
                                  "changes it)")
                return
            password = _secrets.token_urlsafe(12)
            account.set_password(password)
            account.save(update_fields=["password"])
        self.stdout.write(f"user '{user}'  password '{password}'  (shown once; `python manage.py changepassword "
                          f"{user}` changes it)")
