"""Rollouts: creation (every input checked), the state machine the beat advances, manual controls, notifications.

Advancing (``advance``): a worker first takes the rollout's short tick lease (``ticking_until``, a conditional
UPDATE), so one worker at a time looks at a rollout; every change it then makes is a conditional UPDATE on
``revision`` that writes its audit row (and its notification) in the same transaction, so a transition happens
exactly once whatever the number of workers and beats. What the fleet must look like at each step (the canary
group and its config, the gateway weights) is reconciled on every tick rather than remembered, so a restarted
platform or fleet controller resumes the same step: a canary group lost with a controller restart is started
again, weights the gateway forgot are sent again.
"""
from __future__ import annotations

import datetime as dt
import logging
import math
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from engine.config import ConfigError, EngineConfig

from . import analysis as A
from .models import ACTIVE_STATES, FINAL_STATES, Rollout, RolloutAnalysis, RolloutState, RolloutTransition
from .plan import PlanError, canary_gateway_weights, parse_plan

log = logging.getLogger(__name__)
SYSTEM = "system"


class RolloutError(ValueError):
    def __init__(self, message: str, status: int = 400, problems: list[str] | None = None, field: str = ""):
        super().__init__(message)
        self.status = status
        self.problems = problems or [message]
        self.field = field


class Conflict(RuntimeError):
    """Another worker (or an admin) changed the rollout first."""


def cfg(name: str) -> Any:
    return settings.ROLLOUTS[name]


# ---------------------------------------------------------------------------------------------- the fleet
def _fleet() -> dict:
    """The fleet's snapshot; raises FleetUnavailable."""
    from observatory.engine_link import FleetUnavailable, fleet_control

    status, body = fleet_control("GET", "/fleet", timeout=5.0)
    if status != 200:
        raise FleetUnavailable(f"the fleet controller answered {status}: {body.get('error', '')}")
    return body


def _group(fleet: dict, name: str) -> dict | None:
    return next((g for g in fleet.get("groups") or [] if g.get("name") == name), None)


def _healthy_replicas(fleet: dict, name: str) -> int:
    return sum(1 for r in fleet.get("replicas") or [] if r.get("group") == name and r.get("state") == "healthy")


def _control(method: str, path: str, body: dict | None = None) -> dict:
    """A control API call that must succeed; raises FleetUnavailable (no answer) or FleetRefused."""
    from observatory.engine_link import fleet_control

    status, payload = fleet_control(method, path, body)
    if status >= 400:
        raise FleetRefused(f"{method} {path}: the fleet controller answered {status}: "
                           f"{payload.get('error') or payload}"
                           + (f" ({'; '.join(payload['problems'])})" if payload.get("problems") else ""))
    return payload


class FleetRefused(RuntimeError):
    pass


def group_config(group: str) -> tuple[EngineConfig, dict[str, float]]:
    """The group's config as the fleet runs it and every group's weight (the fleet file's when no controller
    answers). Raises RolloutError for an unknown group or a canary group."""
    from observatory.engine_link import FleetUnavailable, fleet_groups

    try:
        groups, _ = fleet_groups()
    except FleetUnavailable as exc:
        raise RolloutError(str(exc), field="group") from None
    for entry in groups:
        if entry.get("name") == group:
            if entry.get("dynamic"):
                raise RolloutError(f"{group!r} is a canary group of another rollout, not a group of the fleet",
                                   field="group")
            weights = {g["name"]: float(g.get("weight") or 0) for g in groups if not g.get("dynamic")}
            return EngineConfig.from_dict(entry.get("config") or {}), weights
    names = ", ".join(g.get("name", "?") for g in groups if not g.get("dynamic"))
    raise RolloutError(f"the fleet has no replica group {group!r} (groups: {names or 'none'})", field="group")


# ---------------------------------------------------------------------------------------------- creation
def _config_from_study(project, study_id: Any, group: str) -> tuple[dict, Any]:
    from tuning.models import StudyState, TuningStudy

    if isinstance(study_id, bool) or not isinstance(study_id, int):
        raise RolloutError("from_study must be a tuning study id", field="from_study")
    study = TuningStudy.objects.filter(project=project, id=study_id).first()
    if study is None:
        raise RolloutError(f"no tuning study {study_id} in project {project.name}", status=404, field="from_study")
    if study.group != group:
        raise RolloutError(f"tuning study {study.id} tuned group {study.group!r}, not {group!r}", field="from_study")
    config = (study.proposal or {}).get("config") or (study.result or {}).get("best", {}).get("config")
    if study.state != StudyState.DONE or not config:
        raise RolloutError(f"tuning study {study.id} is {study.state} and proposes no config", field="from_study")
    return config, study


def _default_dataset(project) -> str | None:
    from regressions.models import Dataset

    dataset = Dataset.objects.filter(project=project, versions__isnull=False).order_by("-created_at").first()
    return dataset.name if dataset else None


def create_rollout(project, *, group: str, config: Any = None, from_study: Any = None, plan: Any = None,
                   created_by: str = "", source: str = "api") -> Rollout:
    """A new pending rollout, every input checked (RolloutError names each problem). The beat starts it."""
    if not isinstance(group, str) or not group.strip():
        raise RolloutError("group: the name of a replica group of the fleet", field="group")
    if (config is None) == (from_study is None):
        raise RolloutError("give a config (vLLM knobs) or a tuning study to take it from (from_study), one of them",
                           field="config")
    study = None
    if from_study is not None:
        config, study = _config_from_study(project, from_study, group)
        source = f"study:{study.id}"
    if not isinstance(config, dict):
        raise RolloutError("config: a mapping of vLLM knobs (model, max_num_seqs, ...)", field="config")
    current, weights = group_config(group)
    merged = {**current.to_dict(), **config}
    try:
        new = EngineConfig.from_dict(merged)
    except ConfigError as exc:
        raise RolloutError("invalid engine config: " + "; ".join(exc.problems), problems=exc.problems,
                           field="config") from None
    if new.version == current.version:
        raise RolloutError(f"the config is identical to what group {group!r} runs now (version {current.version}): "
                           f"nothing to roll out", field="config")
    try:
        parsed = parse_plan(plan, default_dataset=_default_dataset(project))
    except PlanError as exc:
        raise RolloutError("invalid plan: " + "; ".join(exc.problems), problems=exc.problems, field="plan") from None
    _check_gate(project, parsed)
    if weights.get(group, 0) <= 0 and any(s["kind"] == "canary" for s in parsed["steps"]):
        raise RolloutError(f"group {group!r} takes no traffic (weight 0): its canary would get none either",
                           field="group")
    busy = Rollout.objects.filter(project=project, group=group, state__in=ACTIVE_STATES).first()
    if busy is not None:
        raise RolloutError(f"group {group!r} is busy: rollout {busy.id} is {busy.state}", status=409, field="group")
    try:
        with transaction.atomic():
            rollout = Rollout.objects.create(
                project=project, group=group, canary_group="", config=new.to_dict(),
                baseline_config=current.to_dict(), baseline_weights=weights, config_version=new.version,
                source=source[:64], study=study, plan=parsed, created_by=created_by[:150])
            rollout.canary_group = f"{group[:40]}-canary-{rollout.id}"
            rollout.save(update_fields=["canary_group"])
            RolloutTransition.objects.create(
                rollout=rollout, actor=created_by or SYSTEM, action="created", from_state="", to_state="pending",
                step=0, revision=0, reason=f"rollout of config {new.version} to group {group!r} "
                                           f"({_changes_text(current, new)})",
                figures={"changes": {k: [a, b] for k, (a, b) in current.diff(new).items()}, "plan": parsed})
    except IntegrityError:
        raise RolloutError(f"group {group!r} is busy: another rollout was started on it", status=409,
                           field="group") from None
    transaction.on_commit(lambda: enqueue(rollout.id))
    return rollout


def _changes_text(old: EngineConfig, new: EngineConfig) -> str:
    changes = old.diff(new)
    return ", ".join(f"{k}: {a} → {b}" for k, (a, b) in changes.items()) or "no knob changed"


def _check_gate(project, plan: dict) -> None:
    from regressions.datasets import resolve_version

    for step in plan["steps"]:
        if step["kind"] != "gate":
            continue
        if not step.get("dataset"):
            raise RolloutError("the regression gate needs a golden dataset of the project (steps[0].dataset); the "
                               "project has none", field="plan")
        try:
            resolve_version(project, step["dataset"], step.get("version"))
        except LookupError as exc:
            raise RolloutError(f"regression gate: {exc}", field="plan") from None


def enqueue(rollout_id: int) -> None:
    from .tasks import advance

    try:
        advance.delay(rollout_id)
    except Exception:  # broker away: the beat's sweep advances it too
        log.warning("could not enqueue rollout %s; the sweep will advance it", rollout_id, exc_info=True)


# ---------------------------------------------------------------------------------------------- transitions
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
    _metrics_changed(updated, action)
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
    from notify import services as notify

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
        "starts_at": _iso(rollout.created_at),
        "ends_at": _iso(rollout.finished_at) if rollout.state == RolloutState.PROMOTED else None,
        "url": f"{public.rstrip('/')}/rollouts/{rollout.id}/" if public else None,
        "rollout": {"id": rollout.id, "group": rollout.group, "canary_group": rollout.canary_group,
                    "baseline_group": rollout.baseline_group, "state": rollout.state, "step": rollout.step, "config_version": rollout.config_version,
                    "action": action, "figures": finite(figures)},
        "diagnosis": None,
        "repeat": False,
    }
    notify.enqueue(rollout.project_id, event, severity=severity)


def _iso(t: dt.datetime | None) -> str | None:
    return t.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z") if t else None


def _metrics_changed(rollout: Rollout, action: str) -> None:
    from . import metrics

    metrics.TRANSITIONS.labels(action, rollout.state).inc()


# ---------------------------------------------------------------------------------------------- advancing
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
            _cleanup(rollout)
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


def _status(rollout: Rollout, **changes) -> dict:
    return {**(rollout.step_status or {}), **changes}


def _tick(rollout: Rollout) -> None:
    from observatory.engine_link import FleetUnavailable

    if rollout.state == RolloutState.PAUSED:
        if (rollout.step_status or {}).get("pause") == "fleet":
            try:
                _fleet()
            except FleetUnavailable:
                return
            transition(rollout, to_state=rollout.paused_from or RolloutState.PROGRESSING, action="resumed",
                       reason="the fleet controller answers again", paused_from="",
                       step_status=_status(rollout, pause=None, fleet_unreachable_since=None))
        return
    try:
        fleet = _fleet()
    except FleetUnavailable as exc:
        since = (rollout.step_status or {}).get("fleet_unreachable_since")
        now = timezone.now()
        if since is None:
            Rollout.objects.filter(id=rollout.id, revision=rollout.revision).update(
                step_status=_status(rollout, fleet_unreachable_since=now.isoformat()))
            return
        if (now - dt.datetime.fromisoformat(since)).total_seconds() >= cfg("FLEET_GRACE_SECONDS"):
            pause(rollout, actor=SYSTEM, reason=f"cannot reach the fleet: {exc}", kind="fleet")
        return
    if (rollout.step_status or {}).get("fleet_unreachable_since"):
        rollout = transition(rollout, action="fleet-back", reason="the fleet controller answers again",
                             step_status=_status(rollout, fleet_unreachable_since=None))
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


def _ensure_canary(rollout: Rollout, fleet: dict, weight_percent: float) -> bool:
    """The canary group runs the new config (and the baseline twin, when the plan has one, the group's config on as
    many replicas) and the gateway gives each ``weight_percent`` % of the group's traffic; True once their replicas
    are healthy."""
    wanted = [(rollout.canary_group, rollout.config, rollout.config_version)]
    if rollout.twin_group:
        wanted.append((rollout.twin_group, rollout.baseline_config,
                       EngineConfig.from_dict(rollout.baseline_config).version))
    ready = True
    for name, config, version in wanted:
        group = _group(fleet, name)
        if group is not None and group.get("config_version") != version:
            _control("DELETE", f"/fleet/groups/{name}")
            group = None
        if group is None:
            _control("PUT", f"/fleet/groups/{name}",
                     {"base": rollout.group, "config": config, "replicas": rollout.plan["canary_replicas"],
                      "weight": 0})
            ready = False
        elif _healthy_replicas(fleet, name) < rollout.plan["canary_replicas"]:
            ready = False
    if not ready:
        return False
    _ensure_weights(rollout, fleet, weight_percent)
    return True


def _ensure_weights(rollout: Rollout, fleet: dict, weight_percent: float | None) -> None:
    """Gateway weights as the step wants them (None: the weights from before the rollout, canary and twin at 0)."""
    current = {g["name"]: float(g.get("weight") or 0) for g in fleet.get("groups") or []}
    base = {name: float(w) for name, w in (rollout.baseline_weights or {}).items() if name in current}
    if weight_percent:
        wanted = canary_gateway_weights(base, rollout.group, rollout.canary_group, weight_percent,
                                        twin=rollout.twin_group)
    else:
        wanted = dict(base)
        for name in (rollout.canary_group, rollout.twin_group):
            if name and name in current:
                wanted[name] = 0.0
    if all(abs(current.get(name, -1) - w) < 1e-9 for name, w in wanted.items()):
        return
    _control("PUT", "/fleet/weights", {"weights": wanted})


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
    from regressions.models import RegressionRun, RunState
    from regressions.service import RunError, create_run

    if not _ensure_canary(rollout, fleet, 0):
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
    if not _ensure_canary(rollout, fleet, step["weight"]):
        return
    now = timezone.now()
    if not status.get("traffic_since"):
        # The step's clock starts when the canary takes its weight, not when the step was entered (replicas start).
        rollout = transition(rollout, action="canary-weight",
                             reason=f"canary takes {step['weight']:g}% of group {rollout.group}'s traffic"
                                    f"{' (its baseline twin as much)' if rollout.twin_group else ''} for "
                                    f"{step['interval_seconds']:g} s",
                             step_started_at=now, step_status=_status(rollout, traffic_since=now.isoformat()),
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
            step_status=_status(rollout, last_look=now.isoformat()))
        return
    if result["verdict"] == "pass":
        _next_step(rollout, action="step-passed", reason=f"canary at {step['weight']:g}% passed: {result['reason']}",
                   figures=figures)
    elif rollout.step_extensions < config["max_extensions"]:
        transition(rollout, action="step-extended",
                   reason=f"canary at {step['weight']:g}% inconclusive, step extended by {step['interval_seconds']:g} s "
                          f"({rollout.step_extensions + 1} of {config['max_extensions']}): {result['reason']}",
                   step_extensions=rollout.step_extensions + 1, figures=figures,
                   step_status=_status(rollout, last_look=now.isoformat()))
    else:
        pause(rollout, actor=SYSTEM, kind="inconclusive", figures=figures,
              reason=f"canary at {step['weight']:g}% inconclusive after {config['max_extensions']} extension(s): "
                     f"{result['reason']}")


def _brief(metric: dict) -> dict:
    return {k: metric.get(k) for k in ("metric", "verdict", "statistic", "baseline", "canary", "hl_shift", "ci", "p",
                                       "tolerance_ms", "n_canary", "n_baseline", "explained_by", "needed")}


def look(rollout: Rollout, since: dt.datetime, until: dt.datetime) -> dict:
    """The canary's requests against the baseline's (the twin's, or the group's) over [since, until)."""
    from traces.store import get_store

    samples = A.fetch(get_store(), rollout.project_id, (rollout.baseline_group, rollout.canary_group), since, until)
    return A.analyse(samples, baseline_group=rollout.baseline_group, canary_group=rollout.canary_group,
                     config=rollout.plan["analysis"], slos=scoped_slos(rollout))


def scoped_slos(rollout: Rollout) -> list[dict]:
    """The project's enabled SLOs scoped to the rollout's group (their replica_group filter names it)."""
    from slo.models import SLO

    out = []
    for slo in SLO.objects.filter(project_id=rollout.project_id, enabled=True):
        groups = (slo.filters or {}).get("replica_group") or []
        if rollout.group in groups:
            out.append({"name": slo.name, "sli": slo.sli, "threshold_ms": slo.threshold_ms,
                        "objective": slo.objective})
    return out


# -- approval
def _approval_step(rollout: Rollout, step: dict, fleet: dict) -> None:
    previous = _previous_canary_weight(rollout)
    if previous and not _ensure_canary(rollout, fleet, previous):
        return
    if rollout.approved:
        _next_step(rollout, action="approved-step", reason="approved")


def _previous_canary_weight(rollout: Rollout) -> float | None:
    weights = [s["weight"] for s in rollout.plan["steps"][:rollout.step] if s["kind"] == "canary"]
    return weights[-1] if weights else None


# -- promote
def _promote_step(rollout: Rollout, step: dict, fleet: dict, *, actor: str = SYSTEM) -> None:
    status = rollout.step_status or {}
    group = _group(fleet, rollout.group)
    if group is None:
        pause(rollout, actor=SYSTEM, reason=f"the fleet has no group {rollout.group!r} any more", kind="fleet")
        return
    if not status.get("replacing"):
        _control("PUT", f"/fleet/groups/{rollout.group}/config", {"config": rollout.config})
        transition(rollout, action="promoting", actor=actor,
                   reason=f"group {rollout.group} takes config {rollout.config_version} (drain-and-replace)",
                   step_status=_status(rollout, replacing=timezone.now().isoformat()))
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
        _control("PUT", f"/fleet/groups/{rollout.group}/config", {"config": rollout.config})
        return
    if not _restore_fleet(rollout, fleet, keep_config=True):
        return
    transition(rollout, to_state=RolloutState.PROMOTED, action="promoted", actor=actor, notify="ticket",
               reason=f"group {rollout.group} runs config {rollout.config_version}; canary group"
                      f"{' and baseline twin' if rollout.twin_group else ''} removed, weights restored",
               step=len(rollout.plan["steps"]), step_status=_status(rollout, cleanup="done"))


# ---------------------------------------------------------------------------------------------- rollback, cleanup
def _restore_fleet(rollout: Rollout, fleet: dict, *, keep_config: bool) -> bool:
    """Weights as before the rollout, the canary group removed, the group on its old config unless kept; False while
    something is still under way (a replacement of the group), to be looked at again."""
    _ensure_weights(rollout, fleet, None)
    for name in (rollout.canary_group, rollout.twin_group):
        if name and _group(fleet, name) is not None:
            _control("DELETE", f"/fleet/groups/{name}")
    if keep_config:
        return True
    group = _group(fleet, rollout.group)
    baseline = EngineConfig.from_dict(rollout.baseline_config)
    if group is None or group.get("config_version") in (None, baseline.version):
        return True
    if group.get("transition"):
        return False  # a promotion's replacement is under way: put the old config back once it is done
    _control("PUT", f"/fleet/groups/{rollout.group}/config", {"config": rollout.baseline_config})
    return False


def rollback(rollout: Rollout, *, actor: str, reason: str, figures: dict | None = None,
             to_state: str = RolloutState.ROLLED_BACK, action: str = "rolled-back") -> Rollout:
    """Decide the rollback (audited, notified), then take the canary out of the fleet: weight 0, replicas
    stopped, the group on its old config. When the fleet cannot be reached now, the cleanup is retried by every
    sweep until it is done (``step_status.cleanup``)."""
    updated = transition(rollout, to_state=to_state, action=action, actor=actor, reason=reason, figures=figures,
                         notify="page" if to_state in (RolloutState.ROLLED_BACK, RolloutState.FAILED) else "ticket",
                         step_status=_status(rollout, cleanup="pending"))
    _cleanup(updated)
    return updated


def _cleanup(rollout: Rollout) -> None:
    from observatory.engine_link import FleetUnavailable

    if (rollout.step_status or {}).get("cleanup") != "pending":
        return
    try:
        complete = _restore_fleet(rollout, _fleet(), keep_config=False)
    except (FleetUnavailable, FleetRefused) as exc:
        log.warning("rollout %s: fleet cleanup not done yet (%s); the sweep retries", rollout.id, exc)
        return
    if complete:
        Rollout.objects.filter(id=rollout.id).update(step_status=_status(rollout, cleanup="done"),
                                                     updated_at=timezone.now())


def pause(rollout: Rollout, *, actor: str, reason: str, kind: str = "manual", figures: dict | None = None) -> Rollout:
    """Pause where it is: the canary keeps its weight (an inconclusive canary is neither promoted nor rolled back);
    an admin resumes, promotes or aborts."""
    return transition(rollout, to_state=RolloutState.PAUSED, action="paused", actor=actor, reason=reason,
                      figures=figures, notify="ticket" if actor == SYSTEM else None,
                      paused_from=rollout.state if rollout.state != RolloutState.PAUSED else rollout.paused_from,
                      step_status=_status(rollout, pause=kind))


# ---------------------------------------------------------------------------------------------- manual controls
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
    status = _status(rollout, pause=None, last_look=None, fleet_unreachable_since=None)
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


# ---------------------------------------------------------------------------------------------- reading
def current_weight(rollout: Rollout) -> float:
    """The canary's share (%) of the group's traffic the step asks for (0 outside canary steps)."""
    if rollout.state not in (RolloutState.PROGRESSING, RolloutState.PAUSED, RolloutState.GATING):
        return 0.0
    steps = rollout.plan["steps"]
    if rollout.step < len(steps) and steps[rollout.step]["kind"] == "canary":
        return steps[rollout.step]["weight"] if (rollout.step_status or {}).get("traffic_since") else \
            (_previous_canary_weight(rollout) or 0.0)
    return _previous_canary_weight(rollout) or 0.0


def summary(rollout: Rollout, *, detail: bool = False) -> dict:
    steps = rollout.plan["steps"]
    out = {
        "id": rollout.id, "project": rollout.project.name, "group": rollout.group,
        "canary_group": rollout.canary_group, "baseline_group": rollout.baseline_group,
        "twin_group": rollout.twin_group, "state": rollout.state, "step": rollout.step, "step_kind": steps[rollout.step]["kind"] if rollout.step < len(steps) else None,
        "canary_weight": current_weight(rollout), "reason": rollout.reason, "config_version": rollout.config_version,
        "source": rollout.source, "created_by": rollout.created_by, "created_at": _iso(rollout.created_at),
        "updated_at": _iso(rollout.updated_at), "finished_at": _iso(rollout.finished_at),
        "step_started_at": _iso(rollout.step_started_at), "step_extensions": rollout.step_extensions,
        "gate_run": rollout.gate_run_id, "steps": [{**s, "index": i, "status": _step_status(rollout, i)}
                                                   for i, s in enumerate(steps)],
    }
    if detail:
        out["config"] = rollout.config
        out["baseline_config"] = rollout.baseline_config
        out["changes"] = {k: [a, b] for k, (a, b) in EngineConfig.from_dict(rollout.baseline_config).diff(
            EngineConfig.from_dict(rollout.config)).items()}
        out["analysis_config"] = rollout.plan["analysis"]
        out["transitions"] = [{"at": _iso(t.at), "actor": t.actor, "action": t.action, "from": t.from_state,
                               "to": t.to_state, "step": t.step, "reason": t.reason, "figures": t.figures}
                              for t in rollout.transitions.all()]
        out["analyses"] = [{"id": a.id, "step": a.step, "at": _iso(a.at), "since": _iso(a.since),
                            "until": _iso(a.until), "verdict": a.verdict, "final": a.final, "summary": a.summary}
                           for a in rollout.analyses.all()]
    return out


def _step_status(rollout: Rollout, index: int) -> str:
    if index < rollout.step:
        return "done"
    if index > rollout.step:
        return "waiting"
    if rollout.state in FINAL_STATES:
        return {RolloutState.PROMOTED: "done"}.get(rollout.state, rollout.state)
    return "paused" if rollout.state == RolloutState.PAUSED else "running"



ANNOTATED_ACTIONS = ("started", "canary-weight", "gate-started", "promoting", "promoted", "rolled-back", "aborted",
                     "gate-failed", "promote-failed", "paused")


def annotations(project_id: int, since: dt.datetime, until: dt.datetime, limit: int = 200) -> list[dict]:
    """Rollout events of the project in [since, until] for the overview's time series: {t (epoch s), label}."""
    out = []
    for t in (RolloutTransition.objects.filter(rollout__project_id=project_id, at__gte=since, at__lte=until,
                                               action__in=ANNOTATED_ACTIONS)
              .select_related("rollout").order_by("at")[:limit]):
        rollout = t.rollout
        what = {"canary-weight": f"canary {_weight_of(rollout, t.step):g}%", "rolled-back": "rolled back",
                "gate-started": "regression gate"}.get(t.action, t.action.replace("-", " "))
        out.append({"t": t.at.timestamp(), "label": f"rollout #{rollout.id} ({rollout.group}): {what}",
                    "action": t.action, "rollout": rollout.id})
    return out


def _weight_of(rollout: Rollout, step: int) -> float:
    steps = rollout.plan["steps"]
    return steps[step]["weight"] if step < len(steps) and steps[step]["kind"] == "canary" else 0.0


def rollouts_during(project_id: int, since: dt.datetime, until: dt.datetime) -> list[dict]:
    """Rollouts of the project that ran at some time in [since, until] (or finished up to 10 minutes before
    ``since``: their effect may outlast them), newest first, for an alert's diagnosis."""
    grace = since - dt.timedelta(minutes=10)
    found = (Rollout.objects.filter(project_id=project_id, created_at__lte=until)
             .filter(Q(finished_at__isnull=True) | Q(finished_at__gte=grace)).order_by("-created_at")[:3])
    return [{"id": r.id, "group": r.group, "canary_group": r.canary_group, "state": r.state,
             "config_version": r.config_version, "canary_weight": current_weight(r), "step": r.step,
             "url": f"/rollouts/{r.id}/"} for r in found]
