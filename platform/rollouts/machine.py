"""The rollout state machine the beat advances: a tick of one rollout reconciles the fleet with its step, judges
the step (regression gate, canary analysis, approval, promotion) and moves on, pauses or rolls back.

A worker first takes the rollout's short tick lease (``ticking_until``, a conditional UPDATE), so one worker at a
time looks at a rollout; every change it then makes is a transition (transitions.py), made exactly once whatever
the number of workers and beats. What the fleet must look like at each step is made so on every tick
(reconcile.py), so a restarted platform or fleet controller resumes the same step.
"""
from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.utils import timezone
from fleet.control import FleetRefused, control, group_of, snapshot
from fleet.state import FleetUnavailable
from regressions.models import RegressionRun, RunState
from regressions.service import RunError, create_run
from slo.models import REQUEST_SLIS, SLO
from traces.store import get_store

from . import analysis
from .controls import cleanup, pause, rollback
from .models import ACTIVE_STATES, FINAL_STATES, Rollout, RolloutAnalysis, RolloutState
from .reconcile import ensure_canary, restore_fleet
from .transitions import SYSTEM, Conflict, finite, transition, with_status

log = logging.getLogger(__name__)


def cfg(name: str) -> Any:
    """A setting of ROLLOUTS (read when used: tests change them)."""
    return settings.ROLLOUTS[name]


def claim_tick(rollout_id: int) -> Rollout | None:
    """Take the rollout's tick lease (None when another worker holds it or the rollout is finished). The lease's
    expiry, to the microsecond, is its holder's token (see release_tick)."""
    now = timezone.now()
    until = now + dt.timedelta(seconds=cfg("TICK_LEASE_SECONDS"))
    got = Rollout.objects.filter(Q(ticking_until__isnull=True) | Q(ticking_until__lt=now), id=rollout_id).filter(
        Q(state__in=ACTIVE_STATES) | Q(step_status__cleanup="pending")).update(ticking_until=until)
    return Rollout.objects.get(id=rollout_id) if got else None


def release_tick(rollout: Rollout) -> None:
    """Give the lease back, unless it expired and another worker holds it now."""
    Rollout.objects.filter(id=rollout.id, ticking_until=rollout.ticking_until).update(ticking_until=None)


def advance(rollout_id: int) -> str | None:
    """One tick of one rollout: reconcile the fleet with the step, judge it, move on when it is done."""
    rollout = claim_tick(rollout_id)
    if rollout is None:
        return None
    try:
        if rollout.state in FINAL_STATES:
            cleanup(rollout)
        else:
            _tick(rollout)
    except Conflict:
        log.info("rollout %s changed under this worker; the next tick looks again", rollout_id)
    except Exception:
        log.exception("rollout %s: tick failed", rollout_id)
    finally:
        release_tick(rollout)
    return Rollout.objects.filter(id=rollout_id).values_list("state", flat=True).first()


def sweep() -> int:
    """Advance every active rollout (and finish rollbacks whose fleet cleanup is pending); the beat calls it."""
    ids = list(Rollout.objects.filter(Q(state__in=ACTIVE_STATES) | Q(step_status__cleanup="pending"))
               .values_list("id", flat=True))
    for rollout_id in ids:
        advance(rollout_id)
    return len(ids)


def _tick(rollout: Rollout) -> None:
    if rollout.state == RolloutState.PAUSED:
        if (rollout.step_status or {}).get("pause") == "fleet":
            try:
                snapshot()
            except FleetUnavailable:
                return
            transition(rollout, to_state=rollout.paused_from or RolloutState.PROGRESSING, action="resumed",
                       reason="the fleet controller answers again", paused_from="",
                       step_status=with_status(rollout, pause=None, fleet_unreachable_since=None))
        return
    try:
        fleet = snapshot()
    except FleetUnavailable as exc:
        since = (rollout.step_status or {}).get("fleet_unreachable_since")
        now = timezone.now()
        if since is None:
            Rollout.objects.filter(id=rollout.id, revision=rollout.revision).update(
                step_status=with_status(rollout, fleet_unreachable_since=now.isoformat()))
            return
        if (now - dt.datetime.fromisoformat(since)).total_seconds() >= cfg("FLEET_GRACE_SECONDS"):
            pause(rollout, actor=SYSTEM, reason=f"cannot reach the fleet: {exc}", kind="fleet")
        return
    if (rollout.step_status or {}).get("fleet_unreachable_since"):
        rollout = transition(rollout, action="fleet-back", reason="the fleet controller answers again",
                             step_status=with_status(rollout, fleet_unreachable_since=None))
    if rollout.state == RolloutState.PENDING:
        rollout = _begin(rollout)
    steps = rollout.plan["steps"]
    if rollout.step >= len(steps):
        return
    step = steps[rollout.step]
    try:
        handler = {"gate": _gate_step, "canary": _canary_step, "approval": _approval_step,
                   "promote": _promote_step}[step["kind"]]
        handler(rollout, step, fleet)
    except FleetRefused as exc:
        pause(Rollout.objects.get(id=rollout.id), actor=SYSTEM, reason=f"the fleet refused a change: {exc}",
              kind="fleet-refused")


def _begin(rollout: Rollout) -> Rollout:
    first = rollout.plan["steps"][0]["kind"]
    return transition(rollout, to_state=RolloutState.GATING if first == "gate" else RolloutState.PROGRESSING,
                      action="started", reason=f"step 1 of {len(rollout.plan['steps'])}: {first}",
                      step=0, step_started_at=timezone.now(), step_extensions=0, step_status={})


def _next_step(rollout: Rollout, *, action: str, reason: str, figures: dict | None = None,
               actor: str = SYSTEM) -> Rollout:
    steps = rollout.plan["steps"]
    nxt = rollout.step + 1
    kind = steps[nxt]["kind"] if nxt < len(steps) else None
    return transition(rollout, to_state=RolloutState.PROGRESSING, action=action, actor=actor,
                      reason=reason + (f"; step {nxt + 1} of {len(steps)}: {kind}" if kind else ""), figures=figures,
                      step=nxt, step_started_at=timezone.now(), step_extensions=0, step_status={}, approved=False)


# -- gate
def _gate_step(rollout: Rollout, step: dict, fleet: dict) -> None:
    if not ensure_canary(rollout, fleet, 0):
        return
    if rollout.gate_run_id is None:
        try:
            run = create_run(rollout.project, dataset=step["dataset"], version=step.get("version"),
                             target=f"group:{rollout.canary_group}", baseline=f"group:{rollout.baseline_group}",
                             gates=step.get("gates"), options=step.get("options"),
                             created_by=f"rollout {rollout.id}")
        except RunError as exc:
            pause(rollout, actor=SYSTEM, reason=f"the regression gate cannot start: {exc}", kind="gate")
            return
        transition(rollout, action="gate-started", reason=f"regression run {run.id}: {step['dataset']} replayed on "
                                                          f"the canary group and the group, paired",
                   gate_run=run, figures={"run": run.id})
        return
    run = RegressionRun.objects.get(id=rollout.gate_run_id)
    if run.state in (RunState.QUEUED, RunState.RUNNING, RunState.ANALYSING):
        return
    figures = {"run": run.id, "verdict": run.verdict, "gates": (run.comparison or {}).get("gates", [])}
    if run.state != RunState.DONE:
        pause(rollout, actor=SYSTEM, reason=f"regression run {run.id} ended {run.state}: {run.error or 'no verdict'}",
              kind="gate", figures=figures)
        return
    # The gates that decided: failed ones (passed False) for a fail, undecided ones (passed None) otherwise.
    deciding = [g for g in figures["gates"] if g.get("passed") is (False if run.verdict == "fail" else None)]
    gate_reasons = "; ".join(f"{g.get('metric')}: {g['reason']}" if g.get("metric") else g["reason"]
                             for g in deciding if g.get("reason"))
    if run.verdict == "pass":
        _next_step(rollout, action="gate-passed", reason=f"regression run {run.id} passed", figures=figures)
    elif run.verdict == "fail":
        rollback(rollout, actor=SYSTEM, reason=f"regression gate failed (run {run.id}): {gate_reasons or 'see the run'}",
                 figures=figures, to_state=RolloutState.FAILED, action="gate-failed")
    else:
        pause(rollout, actor=SYSTEM, reason=f"regression gate inconclusive (run {run.id}): "
                                            f"{gate_reasons or 'too few items to judge'}", kind="gate", figures=figures)


# -- canary
def _canary_step(rollout: Rollout, step: dict, fleet: dict) -> None:
    status = rollout.step_status or {}
    if not ensure_canary(rollout, fleet, step["weight"]):
        return
    now = timezone.now()
    if not status.get("traffic_since"):
        # The step's clock starts when the canary takes its weight, not when the step was entered (replicas start).
        rollout = transition(rollout, action="canary-weight",
                             reason=f"canary takes {step['weight']:g}% of group {rollout.group}'s traffic"
                                    f"{' (its baseline twin as much)' if rollout.twin_group else ''} for "
                                    f"{step['interval_seconds']:g} s",
                             step_started_at=now, step_status=with_status(rollout, traffic_since=now.isoformat()),
                             figures={"weight": step["weight"]})
        return
    config = rollout.plan["analysis"]
    started = rollout.step_started_at
    elapsed = (now - started).total_seconds()
    if elapsed < config["settle_seconds"] + config["window_seconds"]:
        return
    last_look = status.get("last_look")
    ends_at = step["interval_seconds"] * (1 + rollout.step_extensions)
    at_end = elapsed >= ends_at
    if not at_end and last_look and (now - dt.datetime.fromisoformat(last_look)).total_seconds() < \
            config["look_every_seconds"]:
        return
    since = started + dt.timedelta(seconds=config["settle_seconds"])
    result = look(rollout, since, now)
    record = RolloutAnalysis.objects.create(rollout=rollout, step=rollout.step, since=since, until=now,
                                            verdict=result["verdict"], final=at_end or result["verdict"] == "fail",
                                            summary=result["reason"][:4000], figures=finite(result))
    figures = {"analysis": record.id, "verdict": result["verdict"], "counts": result["counts"],
               "metrics": [_brief(m) for m in result["metrics"]], "errors": result.get("errors"),
               "slos": result.get("slos")}
    if result["verdict"] == "fail":
        rollback(rollout, actor=SYSTEM, reason=f"canary at {step['weight']:g}%: {result['reason']}", figures=figures)
        return
    if not at_end:
        Rollout.objects.filter(id=rollout.id, revision=rollout.revision).update(
            step_status=with_status(rollout, last_look=now.isoformat()))
        return
    if result["verdict"] == "pass":
        _next_step(rollout, action="step-passed", reason=f"canary at {step['weight']:g}% passed: {result['reason']}",
                   figures=figures)
    elif rollout.step_extensions < config["max_extensions"]:
        transition(rollout, action="step-extended",
                   reason=f"canary at {step['weight']:g}% inconclusive, step extended by {step['interval_seconds']:g} s "
                          f"({rollout.step_extensions + 1} of {config['max_extensions']}): {result['reason']}",
                   step_extensions=rollout.step_extensions + 1, figures=figures,
                   step_status=with_status(rollout, last_look=now.isoformat()))
    else:
        pause(rollout, actor=SYSTEM, kind="inconclusive", figures=figures,
              reason=f"canary at {step['weight']:g}% inconclusive after {config['max_extensions']} extension(s): "
                     f"{result['reason']}")


def _brief(metric: dict) -> dict:
    return {k: metric.get(k) for k in ("metric", "verdict", "statistic", "baseline", "canary", "hl_shift", "ci", "p",
                                       "tolerance_ms", "expected_ms", "n_canary", "n_baseline", "explained_by", "needed")}


def look(rollout: Rollout, since: dt.datetime, until: dt.datetime) -> dict:
    """The canary's requests against the baseline's (the twin's, or the group's) over [since, until)."""
    samples = analysis.fetch(get_store(), rollout.project_id, (rollout.baseline_group, rollout.canary_group), since, until)
    return analysis.analyse(samples, baseline_group=rollout.baseline_group, canary_group=rollout.canary_group,
                     config=rollout.plan["analysis"], slos=scoped_slos(rollout))


def scoped_slos(rollout: Rollout) -> list[dict]:
    """The project's enabled SLOs on requests scoped to the rollout's group (their replica_group filter names it);
    an engine_model_error SLO counts checks of the group's engine model, which a canary's requests cannot judge."""
    out = []
    for slo in SLO.objects.filter(project_id=rollout.project_id, enabled=True, sli__in=REQUEST_SLIS):
        groups = (slo.filters or {}).get("replica_group") or []
        if rollout.group in groups:
            out.append({"name": slo.name, "sli": slo.sli, "threshold_ms": slo.threshold_ms,
                        "objective": slo.objective})
    return out


# -- approval
def _approval_step(rollout: Rollout, step: dict, fleet: dict) -> None:
    previous = rollout.previous_canary_weight
    if previous and not ensure_canary(rollout, fleet, previous):
        return
    if rollout.approved:
        _next_step(rollout, action="approved-step", reason="approved")


# -- promote
def _promote_step(rollout: Rollout, step: dict, fleet: dict, *, actor: str = SYSTEM) -> None:
    status = rollout.step_status or {}
    group = group_of(fleet, rollout.group)
    if group is None:
        pause(rollout, actor=SYSTEM, reason=f"the fleet has no group {rollout.group!r} any more", kind="fleet")
        return
    if not status.get("replacing"):
        control("PUT", f"/fleet/groups/{rollout.group}/config", {"config": rollout.config})
        transition(rollout, action="promoting", actor=actor,
                   reason=f"group {rollout.group} takes config {rollout.config_version} (drain-and-replace)",
                   step_status=with_status(rollout, replacing=timezone.now().isoformat()))
        return
    if group.get("transition"):
        return  # the replacement is under way
    if group.get("config_version") != rollout.config_version:
        last = group.get("last_transition") or {}
        if last.get("to_version") == rollout.config_version and last.get("phase") == "failed":
            rollback(rollout, actor=SYSTEM, to_state=RolloutState.FAILED, action="promote-failed",
                     reason=f"the group's drain-and-replace failed: {last.get('error') or 'see the fleet log'}")
            return
        # The controller restarted (it runs the fleet file's config again) or forgot the change: ask again.
        control("PUT", f"/fleet/groups/{rollout.group}/config", {"config": rollout.config})
        return
    if not restore_fleet(rollout, fleet, keep_config=True):
        return
    transition(rollout, to_state=RolloutState.PROMOTED, action="promoted", actor=actor, notify="ticket",
               reason=f"group {rollout.group} runs config {rollout.config_version}; canary group"
                      f"{' and baseline twin' if rollout.twin_group else ''} removed, weights restored",
               step=len(rollout.plan["steps"]), step_status=with_status(rollout, cleanup="done"))
