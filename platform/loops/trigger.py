"""What a page does to loops (registered with the alerts' lifecycle in LoopsConfig.ready()): a page whose diagnosis
points at an engine component of a managed group starts a loop when the policy allows one; a page from the canary
of a loop's rollout aborts that loop (its rollout is rolled back)."""
from __future__ import annotations

import logging

from alerts.lifecycle import on_fired
from django.db import transaction

from . import service as S
from .models import Loop, LoopState

log = logging.getLogger(__name__)


def connect() -> None:
    on_fired(on_page)


def on_page(alert) -> None:
    if alert.severity != "page":
        return
    with transaction.atomic():
        abort_for_canary(alert)
        S.start_from_alert(alert)


def suspects(alert) -> set[str]:
    """The replica groups a page's diagnosis blames: its first replica group, and an outlier group if it names one."""
    diagnosis = alert.diagnosis or {}
    ranked = [e.get("value") for e in (diagnosis.get("contributors") or {}).get("replica_group") or []]
    out = {ranked[0]} if ranked and ranked[0] else set()
    outlier = (diagnosis.get("suggestion_detail") or {}).get("outlier") or {}
    if outlier.get("dimension") == "replica_group" and outlier.get("value"):
        out.add(outlier["value"])
    return out


def abort_for_canary(alert) -> list[int]:
    """Abort the loops whose rollout's canary group the page's diagnosis blames (the rollout is rolled back)."""
    blamed = suspects(alert)
    aborted = []
    for loop in Loop.objects.filter(project_id=alert.project_id, state=LoopState.ROLLING_OUT,
                                    rollout__isnull=False).select_related("rollout", "project"):
        canary = loop.rollout.canary_group
        if canary and canary in blamed:
            title = (alert.annotations or {}).get("title") or alert.fingerprint[:12]
            if S.stop(loop, LoopState.ABORTED, actor=S.LOOP, reason=f"page from the canary {canary}: {title}"):
                aborted.append(loop.id)
    return aborted
