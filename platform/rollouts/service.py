"""Rollouts: creation, every input checked, and what is read of them (a rollout's summary, the overview's
annotations, the rollouts during an alert). The state machine that advances them is machine.py; the controls that
pause, resume or stop them are controls.py."""
from __future__ import annotations

import datetime as dt
from typing import Any

from apikit.inputs import iso
from django.db import IntegrityError, transaction
from django.db.models import Q
from fleet.state import FleetUnavailable, UnknownGroup, fleet_group
from jobs.dispatch import send
from regressions.datasets import resolve_version
from regressions.models import Dataset
from tuning.models import StudyState, TuningStudy

from engine.config import ConfigError, EngineConfig

from .models import ACTIVE_STATES, FINAL_STATES, Rollout, RolloutState, RolloutTransition
from .plan import PlanError, parse_plan
from .transitions import SYSTEM


class RolloutError(ValueError):
    """A request the rollout (or its creation) cannot take: HTTP status, problems, and the field they are about."""

    def __init__(self, message: str, status: int = 400, problems: list[str] | None = None, field: str = ""):
        super().__init__(message)
        self.status = status
        self.problems = problems or [message]
        self.field = field


# ---------------------------------------------------------------------------------------------- the fleet
def group_config(group: str) -> tuple[EngineConfig, dict[str, float]]:
    """The group's config as the fleet runs it and every group's weight (the fleet file's when no controller
    answers). Raises RolloutError for an unknown group or a canary group."""
    try:
        entry, groups, _ = fleet_group(group)
    except (FleetUnavailable, UnknownGroup) as exc:
        raise RolloutError(str(exc), field="group") from None
    weights = {g["name"]: float(g.get("weight") or 0) for g in groups if not g.get("dynamic")}
    return EngineConfig.from_dict(entry.get("config") or {}), weights


# ---------------------------------------------------------------------------------------------- creation
def _config_from_study(project, study_id: Any, group: str) -> tuple[dict, Any]:
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
    no_gain = (study.result or {}).get("no_gain")
    if no_gain and not study.proposal:  # its winner does not beat the current config on fresh seeds
        raise RolloutError(f"tuning study {study.id} proposes no config: {no_gain}", status=409, field="from_study")
    return config, study


def _default_dataset(project) -> str | None:
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
    """Ask a worker for a tick now (by the task's name); with the broker away the beat's sweep advances it too."""
    send("rollouts.advance", rollout_id, what="rollout")


# ---------------------------------------------------------------------------------------------- reading
def summary(rollout: Rollout, *, detail: bool = False) -> dict:
    """What the API, the pages and the command show of a rollout (with ``detail``: configs, audit, analyses)."""
    steps = rollout.plan["steps"]
    out = {
        "id": rollout.id, "project": rollout.project.name, "group": rollout.group,
        "canary_group": rollout.canary_group, "baseline_group": rollout.baseline_group,
        "twin_group": rollout.twin_group, "state": rollout.state, "step": rollout.step,
        "step_kind": steps[rollout.step]["kind"] if rollout.step < len(steps) else None,
        "canary_weight": rollout.canary_weight, "reason": rollout.reason, "config_version": rollout.config_version,
        "source": rollout.source, "created_by": rollout.created_by, "created_at": iso(rollout.created_at),
        "updated_at": iso(rollout.updated_at), "finished_at": iso(rollout.finished_at),
        "step_started_at": iso(rollout.step_started_at), "step_extensions": rollout.step_extensions,
        "gate_run": rollout.gate_run_id, "steps": [{**s, "index": i, "status": _step_status(rollout, i)}
                                                   for i, s in enumerate(steps)],
    }
    if detail:
        out["config"] = rollout.config
        out["baseline_config"] = rollout.baseline_config
        out["changes"] = {k: [a, b] for k, (a, b) in EngineConfig.from_dict(rollout.baseline_config).diff(
            EngineConfig.from_dict(rollout.config)).items()}
        out["analysis_config"] = rollout.plan["analysis"]
        out["transitions"] = [{"at": iso(t.at), "actor": t.actor, "action": t.action, "from": t.from_state,
                               "to": t.to_state, "step": t.step, "reason": t.reason, "figures": t.figures}
                              for t in rollout.transitions.all()]
        out["analyses"] = [{"id": a.id, "step": a.step, "at": iso(a.at), "since": iso(a.since),
                            "until": iso(a.until), "verdict": a.verdict, "final": a.final, "summary": a.summary}
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
             "config_version": r.config_version, "canary_weight": r.canary_weight, "step": r.step,
             "url": f"/rollouts/{r.id}/"} for r in found]
