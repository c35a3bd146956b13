"""Loops: their policies, their start from a page, the steps of their audit (each one a notification through the
project's channels), the approval links, the controls a human has (pause, resume, end, approve, deny) and what is
read of them. The machine that advances a loop is machine.py.

    page ─► studying ─► (propose) proposed
                    ├─► (approve) awaiting_approval ─approve─► rolling_out ─► watching ─► restored | not_restored
                    │                                └─deny/expiry─► denied | expired
                    └─► (auto) rolling_out …       any step that fails ─► failed; a canary page ─► aborted;
                                                   a human ─► ended (pause/resume keep the state)
"""
from __future__ import annotations

import datetime as dt
import logging
import secrets as _secrets
import uuid
from typing import Any

from django.conf import settings
from django.core import signing
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone
from fleet.state import FleetUnavailable, UnknownGroup, fleet_group
from jobs.dispatch import send
from notify.services import enqueue
from regressions.models import Dataset
from rollouts.controls import rollback
from rollouts.models import ACTIVE_STATES as ROLLOUT_ACTIVE
from rollouts.models import Rollout
from tuning.service import cancel as cancel_study

from .models import ACTIVE_STATES, FINAL_STATES, Loop, LoopPolicy, LoopState, LoopStep, Mode
from .policy import PolicyError, frozen, parse_policy

log = logging.getLogger(__name__)
LOOP = "loop"  # the actor of what the loop decides itself
APPROVAL_SALT = "loops.approval"
ENGINE_COMPONENTS = ("queue", "prefill", "decode")


class LoopError(ValueError):
    def __init__(self, message: str, status: int = 400, problems: list[str] | None = None, field: str = ""):
        super().__init__(message)
        self.status = status
        self.problems = problems or [message]
        self.field = field


# ---------------------------------------------------------------------------------------------- policies
def managed_group(group: str) -> dict:
    """The fleet's entry of a group the platform runs (not a canary or twin it started itself); LoopError else."""
    try:
        entry, _, _ = fleet_group(group)
    except (FleetUnavailable, UnknownGroup) as exc:
        raise LoopError(f"group {group!r} is not a replica group of the managed fleet: {exc}", field="group") \
            from None
    if entry.get("dynamic"):
        raise LoopError(f"group {group!r} was started by a rollout (a canary or its twin), not a managed group",
                        field="group")
    return entry


def default_dataset(project) -> str | None:
    dataset = Dataset.objects.filter(project=project, versions__isnull=False).order_by("-created_at").first()
    return dataset.name if dataset else None


def set_policy(project, data: Any, *, by: str) -> LoopPolicy:
    """Create or replace the project's (or a group's) policy; LoopError with every problem."""
    try:
        fields = parse_policy(data, default_dataset=default_dataset(project))
    except PolicyError as exc:
        raise LoopError("invalid loop policy: " + "; ".join(exc.problems), problems=exc.problems,
                        field="policy") from None
    group = fields.pop("group")
    if group:
        managed_group(group)
    now = timezone.now()
    policy, _ = LoopPolicy.objects.update_or_create(project=project, group=group, defaults={
        **fields, "updated_by": by[:150], "updated_at": now})
    return policy


def policy_for(project, group: str) -> LoopPolicy | None:
    """The group's policy, else the project's, else None (off)."""
    found = {p.group: p for p in LoopPolicy.objects.filter(project=project, group__in=(group, ""))}
    return found.get(group) or found.get("")


def policy_dict(policy: LoopPolicy) -> dict[str, Any]:
    return {"group": policy.group, "mode": policy.mode, "knobs": policy.knobs,
            "cooldown_seconds": policy.cooldown_seconds, "freeze": policy.freeze,
            "min_confidence": policy.min_confidence, "plan": policy.plan, "study": policy.study,
            "watch_seconds": policy.watch_seconds, "approval_seconds": policy.approval_seconds,
            "updated_by": policy.updated_by, "updated_at": policy.updated_at.isoformat()}


# ---------------------------------------------------------------------------------------------- the start
def trigger_of(alert) -> tuple[str, str] | None:
    """(group, component) when a page's diagnosis points at an engine component of one replica group, else None."""
    diagnosis = alert.diagnosis or {}
    component = diagnosis.get("dominant_component")
    if alert.severity != "page" or alert.kind != "slo_burn" or component not in ENGINE_COMPONENTS:
        return None
    groups = [e.get("value") for e in (diagnosis.get("contributors") or {}).get("replica_group") or []
              if e.get("value")]
    filtered = ((alert.context or {}).get("filters") or {}).get("replica_group") or []
    if len(filtered) == 1:
        return filtered[0], component
    return (groups[0], component) if groups else None


def why_not(project, group: str, at: dt.datetime) -> tuple[LoopPolicy | None, str | None]:
    """(the policy, None) when a loop may start on the group now, else the reason it may not."""
    policy = policy_for(project, group)
    if policy is None or policy.mode == Mode.OFF:
        return policy, f"the loop policy of group {group} is off"
    try:
        managed_group(group)
    except LoopError as exc:
        return policy, str(exc)
    busy = Loop.objects.filter(project=project, group=group, state__in=ACTIVE_STATES).first()
    if busy is not None:
        return policy, f"loop {busy.id} is already {busy.state} on group {group}"
    rollout = Rollout.objects.filter(project=project, group=group, state__in=ROLLOUT_ACTIVE).first()
    if rollout is not None:
        return policy, f"rollout {rollout.id} is {rollout.state} on group {group}"
    last = Loop.objects.filter(project=project, group=group).order_by("-created_at").first()
    if last is not None and at - last.created_at < dt.timedelta(seconds=policy.cooldown_seconds):
        return policy, (f"cooldown: loop {last.id} started at {last.created_at:%Y-%m-%d %H:%M:%S} UTC, less than "
                        f"{policy.cooldown_seconds} s ago")
    window = frozen(policy.freeze, at)
    if window is not None:
        return policy, f"freeze window {window}"
    return policy, None


def start_from_alert(alert, at: dt.datetime | None = None) -> Loop | None:
    """A loop for the page's group when its diagnosis points at an engine component and the policy allows one;
    None otherwise (the reason is logged). Two pages on one group start one loop (a unique constraint)."""
    at = at or timezone.now()
    found = trigger_of(alert)
    if found is None:
        return None
    group, component = found
    project = alert.project
    policy, reason = why_not(project, group, at)
    if reason is not None:
        log.info("no loop for alert %s on %s/%s: %s", alert.fingerprint[:12], project.name, group, reason)
        return None
    diagnosis = alert.diagnosis or {}
    trigger = {"component": component, "summary": diagnosis.get("summary"), "alert_title":
               (alert.annotations or {}).get("title"), "burn_rates": (alert.last_values or {}).get("burn_rates"),
               "slo": (alert.labels or {}).get("slo")}
    try:
        with transaction.atomic():
            loop = Loop.objects.create(project=project, group=group, mode=policy.mode, policy=policy_dict(policy),
                                       alert=alert, alert_fingerprint=alert.fingerprint, slo_id=alert.slo_id,
                                       trigger=trigger, created_at=at, updated_at=at)
            record(loop, "started", LOOP, f"page {trigger['alert_title'] or alert.fingerprint[:12]}: "
                                          f"{component} of group {group} ({policy.mode})", trigger, at=at)
    except IntegrityError:
        return None  # another page on the group started one first
    transaction.on_commit(lambda: advance_soon(loop.id))
    return loop


def advance_soon(loop_id: int) -> None:
    send("loops.advance", loop_id, what="loop")


# ---------------------------------------------------------------------------------------------- the audit
def record(loop: Loop, step: str, actor: str, reason: str, figures: dict | None = None, *,
           at: dt.datetime | None = None, link: str | None = None) -> LoopStep:
    """One step of the timeline, and its notification to the project's channels (in the caller's transaction)."""
    at = at or timezone.now()
    entry = LoopStep.objects.create(loop=loop, at=at, step=step, actor=actor[:150], reason=reason,
                                    figures=figures or {})
    event = event_of(loop, entry, link=link)
    entry.delivery_ids = list(enqueue(loop.project_id, event, severity=settings.LOOPS["NOTIFY_SEVERITY"]))
    entry.save(update_fields=["delivery_ids"])
    return entry


def loop_url(loop: Loop) -> str | None:
    public = (getattr(settings, "ALERTS", {}) or {}).get("PUBLIC_URL") or ""
    return f"{public.rstrip('/')}/loops/{loop.id}" if public else None


def event_of(loop: Loop, entry: LoopStep, *, link: str | None = None) -> dict:
    title = f"Loop {loop.id} on {loop.group}: {entry.step.replace('_', ' ')}"
    description = entry.reason + (f"\nApprove or deny (admins, within the link's time): {link}" if link else "")
    return {
        "event_id": str(uuid.uuid4()), "fingerprint": f"loop-{loop.id}-{entry.id}",
        "status": "resolved" if entry.step in FINAL_STATES or entry.step == "ended" else "firing",
        "severity": settings.LOOPS["NOTIFY_SEVERITY"], "kind": "loop", "project": loop.project.name,
        "title": title, "summary": entry.reason, "description": description,
        "labels": {"alertname": "ObservatoryLoop", "project": loop.project.name, "group": loop.group,
                   "loop": str(loop.id), "step": entry.step},
        "annotations": {"summary": entry.reason, **({"approval_url": link} if link else {})},
        "starts_at": loop.created_at.isoformat(), "ends_at": None, "url": loop_url(loop), "slo": None,
        "diagnosis": None, "repeat": False, "loop": {"id": loop.id, "state": loop.state, "step": entry.step,
                                                     "actor": entry.actor, "figures": entry.figures},
    }


def move(loop: Loop, to: str, *, step: str | None = None, actor: str = LOOP, reason: str, figures: dict | None = None,
         link: str | None = None, **fields) -> bool:
    """Move the loop to state ``to`` (a conditional update on its version: False when another worker or a human
    changed it first) and record the step."""
    now = timezone.now()
    if to in FINAL_STATES:
        fields.setdefault("finished_at", now)
        fields.setdefault("reason", reason)
    with transaction.atomic():
        won = Loop.objects.filter(id=loop.id, version=loop.version).update(
            state=to, version=F("version") + 1, updated_at=now, **fields)
        if won != 1:
            return False
        loop.refresh_from_db()
        record(loop, step or to, actor, reason, figures, at=now, link=link)
    return True


# ---------------------------------------------------------------------------------------------- approval links
def approval_token(loop: Loop) -> str:
    """A signed token naming the loop, its project and a nonce that the approval consumes: it expires with the
    loop's approval, works once, and cannot be made without the platform's secret key."""
    return signing.dumps({"loop": loop.id, "project": loop.project_id, "nonce": loop.approval_nonce},
                         salt=APPROVAL_SALT, compress=True)


def new_nonce() -> str:
    return _secrets.token_urlsafe(16)


def approval_link(loop: Loop) -> str:
    public = (getattr(settings, "ALERTS", {}) or {}).get("PUBLIC_URL") or ""
    return f"{public.rstrip('/')}/loops/approve/{approval_token(loop)}"


def loop_of_token(token: str, project_ids: set[int]) -> Loop:
    """The loop a link names, if the link is genuine, unexpired, unused and of one of ``project_ids``; LoopError
    (403/404/410) otherwise. Nothing is changed."""
    try:
        data = signing.loads(token, salt=APPROVAL_SALT,
                             max_age=dt.timedelta(seconds=settings.LOOPS["MAX_APPROVAL_SECONDS"]))
    except signing.SignatureExpired:
        raise LoopError("the approval link has expired", status=410) from None
    except signing.BadSignature:
        raise LoopError("the approval link is not genuine", status=403) from None
    if not isinstance(data, dict) or data.get("project") not in project_ids:
        raise LoopError("no such loop awaiting approval", status=404)
    loop = Loop.objects.filter(id=data.get("loop"), project_id=data["project"]).select_related("project").first()
    if loop is None:
        raise LoopError("no such loop awaiting approval", status=404)
    if loop.state != LoopState.AWAITING_APPROVAL or not loop.approval_nonce or \
            data.get("nonce") != loop.approval_nonce:
        raise LoopError(f"the approval link was used or replaced: loop {loop.id} is {loop.state}", status=410)
    if loop.approval_expires_at and timezone.now() >= loop.approval_expires_at:
        raise LoopError("the approval link has expired", status=410)
    return loop


# ---------------------------------------------------------------------------------------------- controls
def _fresh(loop: Loop) -> Loop:
    loop.refresh_from_db()
    return loop


def decide(loop: Loop, *, approve: bool, actor: str, reason: str = "") -> Loop:
    """An admin's approval (the rollout starts at the next tick) or denial (the loop ends) of a proposal."""
    if loop.state != LoopState.AWAITING_APPROVAL:
        raise LoopError(f"loop {loop.id} is {loop.state}, not awaiting approval", status=409)
    if approve:
        done = move(loop, LoopState.ROLLING_OUT, step="approved", actor=actor,
                    reason=reason or f"approved by {actor}", approval_nonce="")
    else:
        done = move(loop, LoopState.DENIED, step="denied", actor=actor, reason=reason or f"denied by {actor}",
                    approval_nonce="")
    if not done:
        raise LoopError(f"loop {loop.id} changed meanwhile; look again", status=409)
    if approve:
        transaction.on_commit(lambda: advance_soon(loop.id))
    return _fresh(loop)


def pause(loop: Loop, actor: str) -> Loop:
    if not loop.active or loop.paused:
        raise LoopError(f"loop {loop.id} is {loop.state}{' and paused' if loop.paused else ''}", status=409)
    with transaction.atomic():
        Loop.objects.filter(id=loop.id).update(paused=True, version=F("version") + 1, updated_at=timezone.now())
        record(_fresh(loop), "paused", actor, f"paused by {actor}: it stays {loop.state} until resumed")
    return loop


def resume(loop: Loop, actor: str) -> Loop:
    if not loop.active or not loop.paused:
        raise LoopError(f"loop {loop.id} is not paused", status=409)
    with transaction.atomic():
        Loop.objects.filter(id=loop.id).update(paused=False, version=F("version") + 1, updated_at=timezone.now())
        record(_fresh(loop), "resumed", actor, f"resumed by {actor}")
    transaction.on_commit(lambda: advance_soon(loop.id))
    return loop


def end(loop: Loop, actor: str, reason: str = "") -> Loop:
    """End the loop now: its study is cancelled, its rollout rolled back (a promoted config stays)."""
    if not loop.active:
        raise LoopError(f"loop {loop.id} has already ended ({loop.state})", status=409)
    stop(loop, LoopState.ENDED, actor=actor, reason=reason or f"ended by {actor}")
    return _fresh(loop)


def stop(loop: Loop, to: str, *, actor: str, reason: str) -> bool:
    """End the loop in state ``to``, cancelling what it runs (its study, its rollout)."""
    if loop.study_id and loop.state == LoopState.STUDYING:
        cancel_study(loop.study)
    if loop.rollout_id and loop.state == LoopState.ROLLING_OUT:
        rollout = Rollout.objects.filter(id=loop.rollout_id, state__in=ROLLOUT_ACTIVE).first()
        if rollout is not None:
            rollback(rollout, actor=actor, reason=f"loop {loop.id}: {reason}")
    return move(loop, to, actor=actor, reason=reason, step=to)


# ---------------------------------------------------------------------------------------------- reading
def summary(loop: Loop, *, detail: bool = False) -> dict[str, Any]:
    data = {
        "id": loop.id, "group": loop.group, "state": loop.state, "mode": loop.mode, "paused": loop.paused,
        "alert": loop.alert_fingerprint or None, "slo": loop.trigger.get("slo"), "trigger": loop.trigger,
        "study": loop.study_id, "rollout": loop.rollout_id, "proposal": loop.proposal or None,
        "approval_expires_at": loop.approval_expires_at.isoformat() if loop.approval_expires_at else None,
        "watch_until": loop.watch_until.isoformat() if loop.watch_until else None,
        "restored_at": loop.restored_at.isoformat() if loop.restored_at else None,
        "reason": loop.reason, "created_at": loop.created_at.isoformat(),
        "finished_at": loop.finished_at.isoformat() if loop.finished_at else None,
    }
    if detail:
        data["policy"] = loop.policy
        data["steps"] = [{"at": s.at.isoformat(), "step": s.step, "actor": s.actor, "reason": s.reason,
                          "figures": s.figures, "notified": bool(s.delivery_ids)} for s in loop.steps.all()]
    return data
