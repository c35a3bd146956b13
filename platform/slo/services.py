"""Creating, changing and describing SLOs: the plain functions behind the API, the YAML loader and the admin."""
from __future__ import annotations

import datetime as dt

from django.db import IntegrityError, transaction
from django.utils import timezone

from . import burn, definitions
from .models import SLO


class SloExists(Exception):
    pass


def _iso(value: dt.datetime | None) -> str | None:
    return value.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z") if value else None


def create(project_id: int, data: dict) -> SLO:
    """A new SLO from a definition; DefinitionError when invalid, SloExists when the name is taken."""
    fields = definitions.validate(data)
    try:
        with transaction.atomic():
            return SLO.objects.create(project_id=project_id, **fields)
    except IntegrityError:
        raise SloExists(f"an SLO named {fields['name']!r} already exists in this project") from None


def replace(slo: SLO, data: dict) -> tuple[SLO, dict]:
    """Replace the SLO's definition (fields left out take their defaults); returns (slo, changes)."""
    fields = definitions.validate(data)
    changed = definitions.changes(slo, fields)
    if changed:
        for key, (_, new) in changed.items():
            setattr(slo, key, new)
        slo.updated_at = timezone.now()
        try:
            with transaction.atomic():
                slo.save(update_fields=[*changed, "updated_at"])
        except IntegrityError:
            raise SloExists(f"an SLO named {fields['name']!r} already exists in this project") from None
    return slo, changed


def describe(slo: SLO, project_name: str | None = None) -> dict:
    """The API form: the definition, the resolved tiers and the latest evaluation."""
    data = definitions.render(slo)
    tiers = [t.as_dict() for t in slo.burn_tiers]
    status = dict(slo.last_status or {})
    return {
        "project": project_name or slo.project.name,
        **data,
        "objective": slo.objective,
        "objective_percent": definitions.format_objective(slo.objective),
        "period_days": slo.period_days,
        "repeat_interval_seconds": slo.repeat_interval_seconds,
        "tiers": tiers,
        "default_tiers": not slo.tiers,
        "error_budget": burn.error_budget(slo.objective),
        "created_at": _iso(slo.created_at),
        "updated_at": _iso(slo.updated_at),
        "status": {
            "state": slo.last_state or "pending",
            "last_evaluated_at": _iso(slo.last_evaluated_at),
            "firing": status.get("firing"),
            "burn_rates": status.get("burn_rates", {}),
            "budget_remaining": status.get("budget_remaining"),
            "counts": status.get("counts", {}),
            "tiers": status.get("tiers", []),
        },
    }
