"""The base of the job commands (`manage.py regression`, `tune`, `rollout`): an error is one line on stderr and exit
status 3, and waiting for a job shows its progress until it ends; with the project named by --project and the YAML
files the commands read, each a CommandError naming what is wrong."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from django.core.management.base import BaseCommand, CommandError
from django.db.models import Model
from tenancy.models import Project

from . import dispatch
from .dispatch import JobKind

EXIT_ERROR = 3


def project_named(name: str) -> Project:
    project = Project.objects.filter(name=name).first()
    if project is None:
        raise CommandError(f"no project named {name!r}")
    return project


def read_yaml(path: str, what: str) -> Any:
    """The YAML (or JSON) document in ``path``; ``what`` names the file in the error ("gates", "config")."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CommandError(f"cannot read the {what} file {path}: {exc}") from None


class JobCommand(BaseCommand):
    def execute(self, *args, **options):
        try:
            return super().execute(*args, **options)
        except CommandError as exc:
            self.stderr.write(f"error: {exc}")
            sys.exit(EXIT_ERROR)

    def follow(self, job: Model, kind: JobKind, queued: str, *, no_wait: bool, **waiting) -> Model | None:
        """Say that ``job`` is queued (the line ``queued``); with ``no_wait`` that is all (None), else the job once
        it has ended (`wait`, with ``waiting``'s arguments)."""
        self.stdout.write(queued)
        return None if no_wait else self.wait(job, kind, **waiting)

    def wait(self, job: Model, kind: JobKind, *, start_timeout: float, not_started: str,
             progress: Callable[[Model], str], interval: float = 0.5) -> Model:
        """Poll ``job`` (of ``kind``) until it leaves the kind's active states, writing ``progress(job)`` when it
        changes (on one rewritten line on a terminal). A job still queued after ``start_timeout`` seconds is
        cancelled and ``not_started`` raised; Ctrl-C cancels it too."""
        started = time.monotonic()
        tty = sys.stdout.isatty()
        shown = None
        try:
            while True:
                job.refresh_from_db()
                if job.state not in kind.active:
                    break
                if job.state == kind.queued and time.monotonic() - started > start_timeout:
                    dispatch.cancel(kind, job)
                    raise CommandError(not_started)
                text = progress(job)
                if text != shown:
                    shown = text
                    self.stdout.write(("\r" + text) if tty else text, ending="" if tty else "\n")
                    self.stdout.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            dispatch.cancel(kind, job)
            self.stdout.write("")
            raise CommandError(f"{job._meta.verbose_name} {job.pk} cancelled") from None
        if tty and shown is not None:
            self.stdout.write("")
        return job
