"""What stops or holds a rollout, decided by the state machine or an admin: rollback (and its fleet cleanup, retried
until done), pause; and the manual controls (pause, resume, retry, approve, promote now, abort), each checking that
the rollout is in a state it acts on (RolloutError, 409) and asking a worker for a tick."""
from __future__ import annotations

import logging
from typing import Any

from django.utils import timezone
from fleet.control import FleetRefused, snapshot
from fleet.state import FleetUnavailable

from .models import FINAL_STATES, Rollout, RolloutState
from .reconcile import restore_fleet
from .service import RolloutError, enqueue
from .transitions import SYSTEM, transition, with_status

log = logging.getLogger(__name__)


def rollback(rollout: Rollout, *, actor: str, reason: str, figures: dict | None = None,
             to_state: str = RolloutState.ROLLED_BACK, action: str = "rolled-back") -> Rollout:
    """Decide the rollback (audited, notified), then take the canary out of the fleet: weight 0, replicas
    stopped, the group on its old config. When the fleet cannot be reached now, the cleanup is retried by every
    sweep until it is done (``step_status.cleanup``)."""
    updated = transition(rollout, to_state=to_state, action=action, actor=actor, reason=reason, figures=figures,
                         notify="page" if to_state in (RolloutState.ROLLED_BACK, RolloutState.FAILED) else "ticket",
                         step_status=with_status(rollout, cleanup="pending"))
    cleanup(updated)
    return updated


def cleanup(rollout: Rollout) -> None:
    """Take a finished rollout's canary out of the fleet if that is still pending (the sweep retries it)."""
    if (rollout.step_status or {}).get("cleanup") != "pending":
        return
    try:
        complete = restore_fleet(rollout, snapshot(), keep_config=False)
    except (FleetUnavailable, FleetRefused) as exc:
        log.warning("rollout %s: fleet cleanup not done yet (%s); the sweep retries", rollout.id, exc)
        return
    if complete:
        Rollout.objects.filter(id=rollout.id).update(step_status=with_status(rollout, cleanup="done"),
                                                     updated_at=timezone.now())


def pause(rollout: Rollout, *, actor: str, reason: str, kind: str = "manual", figures: dict | None = None) -> Rollout:
    """Pause where it is: the canary keeps its weight (an inconclusive canary is neither promoted nor rolled back);
    an admin resumes, promotes or aborts."""
    return transition(rollout, to_state=RolloutState.PAUSED, action="paused", actor=actor, reason=reason,
                      figures=figures, notify="ticket" if actor == SYSTEM else None,
                      paused_from=rollout.state if rollout.state != RolloutState.PAUSED else rollout.paused_from,
                      step_status=with_status(rollout, pause=kind))


def _fresh(rollout: Rollout) -> Rollout:
    return Rollout.objects.get(id=rollout.id)


def manual_pause(rollout: Rollout, actor: str, reason: str = "") -> Rollout:
    rollout = _fresh(rollout)
    if rollout.state not in (RolloutState.PENDING, RolloutState.GATING, RolloutState.PROGRESSING):
        raise RolloutError(f"rollout {rollout.id} is {rollout.state}: only a running rollout can be paused",
                           status=409)
    return pause(rollout, actor=actor, reason=reason or f"paused by {actor}")


def resume(rollout: Rollout, actor: str) -> Rollout:
    rollout = _fresh(rollout)
    if rollout.state != RolloutState.PAUSED:
        raise RolloutError(f"rollout {rollout.id} is {rollout.state}, not paused", status=409)
    status = with_status(rollout, pause=None, last_look=None, fleet_unreachable_since=None)
    fields: dict[str, Any] = {}
    if status.get("traffic_since"):
        # An inconclusive step starts over with its data (the step is judged on fresh requests).
        status["traffic_since"] = None
        fields.update(step_extensions=0)
    updated = transition(rollout, to_state=rollout.paused_from or RolloutState.PROGRESSING, action="resumed",
                         actor=actor, reason=f"resumed by {actor}", paused_from="", step_status=status, **fields)
    enqueue(updated.id)
    return updated


def retry(rollout: Rollout, actor: str) -> Rollout:
    """Run the current step again from its start (a paused gate: a new regression run)."""
    rollout = _fresh(rollout)
    if rollout.state != RolloutState.PAUSED:
        raise RolloutError(f"rollout {rollout.id} is {rollout.state}: only a paused rollout's step can be retried",
                           status=409)
    updated = transition(rollout, to_state=rollout.paused_from or RolloutState.PROGRESSING, action="retried",
                         actor=actor, reason=f"step {rollout.step + 1} retried by {actor}", paused_from="",
                         step_status={}, step_extensions=0, step_started_at=timezone.now(), gate_run=None)
    enqueue(updated.id)
    return updated


def approve(rollout: Rollout, actor: str) -> Rollout:
    rollout = _fresh(rollout)
    steps = rollout.plan["steps"]
    if rollout.state != RolloutState.PROGRESSING or rollout.step >= len(steps) or \
            steps[rollout.step]["kind"] != "approval":
        raise RolloutError(f"rollout {rollout.id} is not waiting for an approval", status=409)
    updated = transition(rollout, action="approved", actor=actor, reason=f"approved by {actor}", approved=True)
    enqueue(updated.id)
    return updated


def promote_now(rollout: Rollout, actor: str) -> Rollout:
    """Skip the remaining steps: the group takes the config now (audited)."""
    rollout = _fresh(rollout)
    if rollout.state in (RolloutState.ROLLED_BACK, RolloutState.FAILED, RolloutState.ABORTED):
        raise RolloutError(f"rollout {rollout.id} is {rollout.state}: a {rollout.state.replace('_', ' ')} rollout "
                           f"cannot be promoted; start a new one", status=409)
    if rollout.state == RolloutState.PROMOTED:
        raise RolloutError(f"rollout {rollout.id} is already promoted", status=409)
    last = len(rollout.plan["steps"]) - 1
    updated = transition(rollout, to_state=RolloutState.PROGRESSING, action="promote-now", actor=actor,
                         reason=f"promoted now by {actor} (skipping step(s) {rollout.step + 1}–{last})",
                         step=last, step_started_at=timezone.now(), step_status={}, paused_from="")
    enqueue(updated.id)
    return updated


def abort(rollout: Rollout, actor: str, reason: str = "") -> Rollout:
    rollout = _fresh(rollout)
    if rollout.state in FINAL_STATES:
        raise RolloutError(f"rollout {rollout.id} is already {rollout.state}", status=409)
    return rollback(rollout, actor=actor, reason=reason or f"aborted by {actor}", to_state=RolloutState.ABORTED,
                    action="aborted")
