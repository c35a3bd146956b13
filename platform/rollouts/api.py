"""JSON API of rollouts (router of apikit.api): viewers read; operators pause; admins start, resume, approve,
promote, abort and retry.

    GET  /rollouts                      rollouts, newest first
    POST /rollouts                      a new rollout of a group (config or from_study; plan optional)
    GET  /rollouts/{id}                 state, step, reason, steps, transitions (the audit), analyses
    GET  /rollouts/{id}/analyses/{aid}  one analysis with every figure (quantiles of both sides per metric)
    POST /rollouts/{id}/pause|resume|approve|promote|abort|retry
"""
from __future__ import annotations

import logging
from typing import Any, Literal, Optional

from apikit.api import PROJECT_DESCRIPTION, ApiError, ApiRouter, acting_in, declared, project_object, refused, require
from apikit.inputs import ProjectName, QueryInt, Text
from django.http import HttpRequest
from ninja import Path, Query, Schema
from ninja.responses import Status
from pydantic import ConfigDict, Field, StrictInt

from . import controls, service
from .models import Rollout, RolloutAnalysis
from .transitions import Conflict

log = logging.getLogger(__name__)
router = ApiRouter(tags=["rollouts"])

STATES = ("pending", "gating", "progressing", "paused", "promoted", "rolled_back", "aborted", "failed")


class NewRollout(Schema):
    model_config = ConfigDict(extra="forbid")
    group: Text(64, min_length=1) = Field(..., description="the replica group of the managed fleet to change")
    config: Optional[dict[str, Any]] = Field(
        None, description="the new engine config (vLLM knob names); knobs left out keep the group's values")
    from_study: Optional[StrictInt] = Field(None, ge=1, description="take the config a tuning study proposes")
    plan: Optional[dict[str, Any]] = Field(
        None, description="steps (gate, canary, approval, promote) and analysis; default: docs/rollouts.md")


class ProjectQuery(Schema):
    project: Optional[ProjectName] = Field(None, description=PROJECT_DESCRIPTION)


class RolloutsQuery(ProjectQuery):
    state: Optional[Literal[STATES]] = None  # type: ignore[valid-type]
    group: Optional[Text(64, min_length=1)] = None
    limit: QueryInt(1, 200, "rollouts returned") = 50


class RolloutPath(Schema):
    rollout_id: QueryInt(1, 2**63 - 1, "rollout id")


class AnalysisPath(RolloutPath):
    analysis_id: QueryInt(1, 2**63 - 1, "analysis id")


class Reason(Schema):
    model_config = ConfigDict(extra="forbid")
    reason: Text(500) = Field("", description="why (kept in the audit)")


class RolloutOut(Schema):
    model_config = ConfigDict(extra="allow")
    id: int
    project: str
    group: str
    canary_group: str
    baseline_group: str = Field(description="the group the canary is compared with: its baseline twin, or the "
                                            "group itself (plan baseline: group)")
    state: Literal[STATES]  # type: ignore[valid-type]
    step: int
    reason: str
    steps: list[dict[str, Any]]
    transitions: list[dict[str, Any]] = []


class RolloutList(Schema):
    project: str
    rollouts: list[RolloutOut]


class AnalysisOut(Schema):
    model_config = ConfigDict(extra="allow")
    id: int
    rollout_id: int
    step: int
    verdict: str
    summary: str
    figures: dict[str, Any]


def _rollout(identity, rollout_id: int) -> Rollout:
    rollout = Rollout.objects.select_related("project").filter(
        id=rollout_id, project_id__in=list(identity.projects)).first()
    if rollout is None:
        raise ApiError(404, f"no rollout {rollout_id} for this token")
    return rollout


def _detail(identity, rollout_id: int) -> dict:
    return service.summary(_rollout(identity, rollout_id), detail=True)


_LINKS = {"GetRollout": {"operationId": "rollouts_api_read_rollout",
                         "parameters": {"rollout_id": "$response.body#/id"}}}


@router.get("/rollouts", response=declared(ok={200: RolloutList}), summary="Rollouts, newest first")
def list_rollouts(request: HttpRequest, query: Query[RolloutsQuery]):
    project = project_object(request.auth, query.project)
    rollouts = Rollout.objects.filter(project=project).select_related("project")
    if query.state:
        rollouts = rollouts.filter(state=query.state)
    if query.group:
        rollouts = rollouts.filter(group=query.group)
    return {"project": project.name, "rollouts": [service.summary(r) for r in rollouts.order_by("-id")[: query.limit]]}


@router.post("/rollouts", response=declared(409, 413, ok={201: RolloutOut}),
             summary="Start a rollout of a new config to a replica group (admins)",
             openapi_extra={"responses": {201: {"description": "the rollout, pending", "links": _LINKS}}})
def create_rollout(request: HttpRequest, body: NewRollout, query: Query[ProjectQuery]):
    identity, project = acting_in(request, query.project, "admin", "starting a rollout")
    try:
        rollout = service.create_rollout(project, group=body.group, config=body.config, from_study=body.from_study,
                                         plan=body.plan, created_by=identity.username)
    except service.RolloutError as exc:
        raise refused(exc) from None
    log.info("rollout %s of %s/%s started by %s", rollout.id, project.name, body.group, identity.username)
    return Status(201, _detail(identity, rollout.id))


@router.get("/rollouts/{rollout_id}", response=declared(ok={200: RolloutOut}),
            summary="A rollout: state, step, reason, steps, the audit of its transitions, its analyses")
def read_rollout(request: HttpRequest, path: Path[RolloutPath]):
    return _detail(request.auth, path.rollout_id)


@router.get("/rollouts/{rollout_id}/analyses/{analysis_id}", response=declared(ok={200: AnalysisOut}),
            summary="One analysis of a canary step with every figure")
def read_analysis(request: HttpRequest, path: Path[AnalysisPath]):
    rollout = _rollout(request.auth, path.rollout_id)
    found = RolloutAnalysis.objects.filter(rollout=rollout, id=path.analysis_id).first()
    if found is None:
        raise ApiError(404, f"no analysis {path.analysis_id} of rollout {rollout.id}")
    return {"id": found.id, "rollout_id": rollout.id, "step": found.step, "verdict": found.verdict,
            "summary": found.summary, "figures": found.figures}


def _control(request, rollout_id: int, role: str, what: str, action, *args) -> Status:
    """``action(rollout, "user:<name>", *args)`` on a rollout of the token's projects, by a token with ``role``."""
    identity = request.auth
    rollout = _rollout(identity, rollout_id)
    require(identity, rollout.project_id, role, what)
    try:
        action(rollout, f"user:{identity.username}", *args)
    except Conflict:
        raise ApiError(409, f"rollout {rollout.id} changed meanwhile; look again") from None
    except service.RolloutError as exc:
        raise refused(exc) from None
    log.info("rollout %s: %s by %s", rollout.id, what, identity.username)
    return Status(202, _detail(identity, rollout.id))


def _reason(body: Reason | None) -> str:
    return body.reason if body else ""


@router.post("/rollouts/{rollout_id}/pause", response=declared(409, ok={202: RolloutOut}),
             summary="Pause a running rollout where it is (operators)")
def pause(request: HttpRequest, path: Path[RolloutPath], body: Reason = None):
    return _control(request, path.rollout_id, "operator", "pausing a rollout", controls.manual_pause, _reason(body))


@router.post("/rollouts/{rollout_id}/resume", response=declared(409, ok={202: RolloutOut}),
             summary="Resume a paused rollout (admins); a canary step starts over on fresh requests")
def resume(request: HttpRequest, path: Path[RolloutPath]):
    return _control(request, path.rollout_id, "admin", "resuming a rollout", controls.resume)


@router.post("/rollouts/{rollout_id}/approve", response=declared(409, ok={202: RolloutOut}),
             summary="Approve the rollout's manual approval step (admins)")
def approve(request: HttpRequest, path: Path[RolloutPath]):
    return _control(request, path.rollout_id, "admin", "approving a rollout step", controls.approve)


@router.post("/rollouts/{rollout_id}/promote", response=declared(409, ok={202: RolloutOut}),
             summary="Promote now, skipping the remaining steps (admins, audited)")
def promote(request: HttpRequest, path: Path[RolloutPath]):
    return _control(request, path.rollout_id, "admin", "promoting a rollout", controls.promote_now)


@router.post("/rollouts/{rollout_id}/abort", response=declared(409, ok={202: RolloutOut}),
             summary="Abort: roll back (canary weight 0, its replicas stopped, the group untouched) (admins)")
def abort(request: HttpRequest, path: Path[RolloutPath], body: Reason = None):
    return _control(request, path.rollout_id, "admin", "aborting a rollout", controls.abort, _reason(body))


@router.post("/rollouts/{rollout_id}/retry", response=declared(409, ok={202: RolloutOut}),
             summary="Run a paused rollout's step again from its start (admins)")
def retry(request: HttpRequest, path: Path[RolloutPath]):
    return _control(request, path.rollout_id, "admin", "retrying a rollout step", controls.retry)
