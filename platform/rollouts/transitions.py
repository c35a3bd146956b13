"""One change of a rollout, made once: a conditional UPDATE on ``revision`` with its audit row (and its
notification) in the same transaction, so that whatever the number of workers and beats, and an admin's click in
between, a transition happens exactly once; the others get Conflict."""
from __future__ import annotations

import math
from typing import Any

from apikit.inputs import iso
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from notify import services as notifications

from .metrics import TRANSITIONS
from .models import FINAL_STATES, Rollout, RolloutState, RolloutTransition

SYSTEM = "system"  # the actor of what the state machine decides


class Conflict(RuntimeError):
    """Another worker (or an admin) changed the rollout first."""


def transition(rollout: Rollout, *, to_state: str | None = None, action: str, actor: str = SYSTEM,
               reason: str = "", figures: dict | None = None, notify: str | None = None, **fields) -> Rollout:
    """Change the rollout (state and/or fields) if nobody else changed it since it was read, with its audit row
    (and notification) in the same transaction; raises Conflict otherwise. Returns the rollout as changed."""
    now = timezone.now()
    to_state = to_state or rollout.state
    fields = {**fields, "state": to_state, "revision": rollout.revision + 1, "updated_at": now}
    if to_state in FINAL_STATES and rollout.state not in FINAL_STATES:
        fields["finished_at"] = now
    if reason and "reason" not in fields:
        fields["reason"] = reason
    with transaction.atomic():
        changed = Rollout.objects.filter(id=rollout.id, revision=rollout.revision).update(**fields)
        if not changed:
            raise Conflict(f"rollout {rollout.id} changed under this worker")
        RolloutTransition.objects.create(
            rollout=rollout, at=now, actor=actor[:150], action=action[:32], from_state=rollout.state,
            to_state=to_state, step=fields.get("step", rollout.step), revision=rollout.revision + 1,
            reason=reason, figures=finite(figures or {}))
        updated = Rollout.objects.get(id=rollout.id)
        if notify:
            _notify(updated, action=action, reason=reason, figures=figures or {}, severity=notify)
    TRANSITIONS.labels(action, updated.state).inc()
    return updated


def finite(value: Any) -> Any:
    """JSON-safe figures: non-finite numbers (an unbounded interval) become None, numpy scalars Python's."""
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _notify(rollout: Rollout, *, action: str, reason: str, figures: dict, severity: str) -> None:
    public = getattr(settings, "ALERTS", {}).get("PUBLIC_URL", "") or ""
    titles = {
        "rolled_back": f"Rollout {rollout.id} of group {rollout.group} rolled back",
        "failed": f"Rollout {rollout.id} of group {rollout.group} failed",
        "paused": f"Rollout {rollout.id} of group {rollout.group} paused",
        "promoted": f"Rollout {rollout.id} of group {rollout.group} promoted",
        "aborted": f"Rollout {rollout.id} of group {rollout.group} aborted",
    }
    title = titles.get(rollout.state, f"Rollout {rollout.id} of group {rollout.group}: {action}")
    event = {
        "event_id": f"rollout-{rollout.id}-{rollout.revision}",
        "fingerprint": f"rollout-{rollout.id}",
        "status": "resolved" if rollout.state == RolloutState.PROMOTED else "firing",
        "severity": severity,
        "kind": "rollout",
        "project": rollout.project.name,
        "title": title,
        "summary": reason or title,
        "description": f"{title}: {reason}" if reason else title,
        "labels": {"alertname": "RolloutRolledBack" if rollout.state == RolloutState.ROLLED_BACK else
                   f"Rollout{rollout.state.title().replace('_', '')}", "project": rollout.project.name,
                   "group": rollout.group, "rollout": str(rollout.id), "state": rollout.state,
                   "config_version": rollout.config_version},
        "annotations": {"reason": reason} if reason else {},
        "starts_at": iso(rollout.created_at),
        "ends_at": iso(rollout.finished_at) if rollout.state == RolloutState.PROMOTED else None,
        "url": f"{public.rstrip('/')}/rollouts/{rollout.id}/" if public else None,
        "rollout": {"id": rollout.id, "group": rollout.group, "canary_group": rollout.canary_group,
                    "baseline_group": rollout.baseline_group, "state": rollout.state, "step": rollout.step,
                    "config_version": rollout.config_version, "action": action, "figures": finite(figures)},
        "diagnosis": None,
        "repeat": False,
    }
    notifications.enqueue(rollout.project_id, event, severity=severity)


def with_status(rollout: Rollout, **changes) -> dict:
    """The rollout's step status updated with ``changes`` (what a step has done so far)."""
    return {**(rollout.step_status or {}), **changes}
