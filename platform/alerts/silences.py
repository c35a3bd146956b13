"""Which silences mute an alert: those in force whose matchers (alerts.matchers) all match its labels."""
from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

from .matchers import matches_all
from .models import Silence


def active_silences(project_id: int, at: dt.datetime):
    """The project's silences in force at `at` (started, not ended, not expired)."""
    return list(Silence.objects.filter(project_id=project_id, starts_at__lte=at, ends_at__gt=at).order_by("id"))


def silencing(project_id: int, labels: Mapping[str, str], at: dt.datetime) -> list[int]:
    """Ids of the silences in force at `at` whose matchers all match `labels`."""
    found = []
    for silence in active_silences(project_id, at):
        if matches_all(silence.parsed_matchers(), labels):
            found.append(silence.id)
    return found
