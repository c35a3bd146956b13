"""JSON API of the closed loop (router of apikit.api): viewers read; operators pause; admins set policies, resume,
end, approve and deny.

    GET  /loop-policies                    the project's policy and its groups' ones
    PUT  /loop-policies                    create or replace one (the body's group; empty: the project's)
    GET  /loops                            loops, newest first
    GET  /loops/{id}                       state, trigger, study, proposal, rollout, and the timeline of its steps
    POST /loops/{id}/pause|resume|end|approve|deny
    GET  /loop-approvals/{token}           what a signed approval link names (admins of its project; nothing changes)
    POST /loop-approvals/{token}           {"approve": true|false}: the link's decision (admins; once, before expiry)
"""
from __future__ import annotations

import json
import logging
from typing import Any, Literal, Optional

from apikit.api import PROJECT_DESCRIPTION, ApiError, ApiRouter, acting_in, declared, project_object, refused, require
from apikit.inputs import ProjectName, QueryInt, Text
from django.http import HttpRequest
from ninja import Path, Query, Schema
from ninja.responses import Status
from pydantic import ConfigDict, Field, StrictBool

from . import service
from .models import Loop, LoopPolicy, LoopState

log = logging.getLogger(__name__)
router = ApiRouter(tags=["loops"])
STATES = tuple(LoopState.values)


class ProjectQuery(Schema):
    project: Optional[ProjectName] = Field(None, description=PROJECT_DESCRIPTION)


class LoopsQuery(ProjectQuery):
    state: Optional[Literal[STATES]] = None  # type: ignore[valid-type]
    group: Optional[Text(100, min_length=1)] = None
    limit: QueryInt(1, 200, "loops returned") = 50


class LoopPath(Schema):
    loop_id: QueryInt(1, 2**63 - 1, "loop id")


class TokenPath(Schema):
    token: Text(1000, min_length=10)


class Reason(Schema):
    model_config = ConfigDict(extra="forbid")
    reason: Text(500) = Field("", description="why (kept in the audit)")


class Decision(Schema):
    model_config = ConfigDict(extra="forbid")
    approve: StrictBool = Field(..., description="true: start the rollout; false: end the loop (denied)")
    reason: Text(500) = ""


class PolicyIn(Schema):
    """Checked by loops.policy.parse_policy, which names every problem (an unknown field among them)."""

    model_config = ConfigDict(extra="allow")
    group: Optional[Any] = Field(None, description="a replica group of the managed fleet; empty: the project's")
    mode: Optional[Any] = Field(None, description="off | propose | approve | auto")
    knobs: Optional[Any] = Field(None, description='{"max_num_seqs": {"max_factor": 2}, ...}')
    cooldown: Optional[Any] = Field(None, description="seconds or 30m/6h/1d; one loop per group per cooldown")
    freeze: Optional[Any] = Field(None, description='[{"start", "end"}] or [{"days", "from", "to"}] (UTC)')
    min_confidence: Optional[Any] = Field(None, description='{"model_error": 0.2, "confirmation": true}')
    plan: Optional[Any] = Field(None, description="the rollouts' plan (docs/rollouts.md)")
    study: Optional[Any] = Field(None, description='{"trials": 30, "window_hours": 1}')
    watch: Optional[Any] = Field(None, description="how long the SLO is watched after a promotion (1h)")
    approval_expires: Optional[Any] = Field(None, description="how long an approval link works (1h)")


class PolicyOut(Schema):
    model_config = ConfigDict(extra="allow")
    group: str
    mode: str


class PolicyList(Schema):
    project: str
    policies: list[PolicyOut]


class LoopOut(Schema):
    model_config = ConfigDict(extra="allow")
    id: int
    group: str
    state: Literal[STATES]  # type: ignore[valid-type]
    mode: str
    paused: bool
    reason: str
    steps: list[dict[str, Any]] = []


class LoopList(Schema):
    project: str
    loops: list[LoopOut]


def _loop(identity, loop_id: int) -> Loop:
    loop = Loop.objects.select_related("project").filter(id=loop_id, project_id__in=list(identity.projects)).first()
    if loop is None:
        raise ApiError(404, f"no loop {loop_id} for this token")
    return loop


@router.get("/loop-policies", response=declared(ok={200: PolicyList}), summary="The project's loop policies")
def list_policies(request: HttpRequest, query: Query[ProjectQuery]):
    project = project_object(request.auth, query.project)
    return {"project": project.name,
            "policies": [service.policy_dict(p) for p in LoopPolicy.objects.filter(project=project)]}


@router.put("/loop-policies", response=declared(413, ok={200: PolicyOut}),
            summary="Create or replace the project's (or a group's) loop policy (admins); every problem at once")
def put_policy(request: HttpRequest, body: PolicyIn, query: Query[ProjectQuery]):
    identity, project = acting_in(request, query.project, "admin", "setting a loop policy")
    try:
        # The JSON as sent (ninja has parsed it into ``body`` already): parse_policy names unknown fields too.
        policy = service.set_policy(project, json.loads(request.body), by=identity.username)
    except service.LoopError as exc:
        raise refused(exc) from None
    log.info("loop policy of %s/%s set to %s by %s", project.name, policy.group or "*", policy.mode,
             identity.username)
    return service.policy_dict(policy)


@router.get("/loops", response=declared(ok={200: LoopList}), summary="Loops, newest first")
def list_loops(request: HttpRequest, query: Query[LoopsQuery]):
    project = project_object(request.auth, query.project)
    loops = Loop.objects.filter(project=project)
    if query.state:
        loops = loops.filter(state=query.state)
    if query.group:
        loops = loops.filter(group=query.group)
    return {"project": project.name, "loops": [service.summary(x) for x in loops[: query.limit]]}


@router.get("/loops/{loop_id}", response=declared(ok={200: LoopOut}),
            summary="A loop: its state, trigger, study, proposal, rollout and the timeline of its steps")
def read_loop(request: HttpRequest, path: Path[LoopPath]):
    return service.summary(_loop(request.auth, path.loop_id), detail=True)


def _control(request, loop_id: int, role: str, what: str, action, *args) -> Status:
    identity = request.auth
    loop = _loop(identity, loop_id)
    require(identity, loop.project_id, role, what)
    try:
        action(loop, identity.username, *args)
    except service.LoopError as exc:
        raise refused(exc) from None
    log.info("loop %s: %s by %s", loop.id, what, identity.username)
    return Status(202, service.summary(_loop(identity, loop_id), detail=True))


@router.post("/loops/{loop_id}/pause", response=declared(409, ok={202: LoopOut}),
             summary="Pause a loop where it is (operators); its study or rollout runs on")
def pause(request: HttpRequest, path: Path[LoopPath]):
    return _control(request, path.loop_id, "operator", "pausing a loop", service.pause)


@router.post("/loops/{loop_id}/resume", response=declared(409, ok={202: LoopOut}), summary="Resume a loop (admins)")
def resume(request: HttpRequest, path: Path[LoopPath]):
    return _control(request, path.loop_id, "admin", "resuming a loop", service.resume)


@router.post("/loops/{loop_id}/end", response=declared(409, ok={202: LoopOut}),
             summary="End a loop now: its study cancelled, its rollout rolled back (admins)")
def end(request: HttpRequest, path: Path[LoopPath], body: Reason = None):
    return _control(request, path.loop_id, "admin", "ending a loop", service.end, body.reason if body else "")


@router.post("/loops/{loop_id}/approve", response=declared(409, ok={202: LoopOut}),
             summary="Approve the loop's proposal: its rollout starts (admins)")
def approve(request: HttpRequest, path: Path[LoopPath], body: Reason = None):
    return _control(request, path.loop_id, "admin", "approving a loop's rollout",
                    lambda loop, who: service.decide(loop, approve=True, actor=who, reason=body.reason if body else ""))


@router.post("/loops/{loop_id}/deny", response=declared(409, ok={202: LoopOut}),
             summary="Deny the loop's proposal: the loop ends (admins)")
def deny(request: HttpRequest, path: Path[LoopPath], body: Reason = None):
    return _control(request, path.loop_id, "admin", "denying a loop's rollout",
                    lambda loop, who: service.decide(loop, approve=False, actor=who, reason=body.reason if body else ""))


def _by_token(request, token: str) -> Loop:
    identity = request.auth
    try:
        loop = service.loop_of_token(token, set(identity.projects))
    except service.LoopError as exc:
        raise ApiError(exc.status, str(exc)) from None
    require(identity, loop.project_id, "admin", "deciding a loop's rollout")
    return loop


@router.get("/loop-approvals/{token}", response=declared(410, ok={200: LoopOut}),
            summary="What a signed approval link names (admins of its project); nothing changes")
def read_approval(request: HttpRequest, path: Path[TokenPath]):
    return service.summary(_by_token(request, path.token), detail=True)


@router.post("/loop-approvals/{token}", response=declared(409, 410, ok={202: LoopOut}),
             summary="The link's decision: approve (the rollout starts) or deny (admins; once, before it expires)")
def decide_approval(request: HttpRequest, path: Path[TokenPath], body: Decision):
    identity = request.auth
    loop = _by_token(request, path.token)
    try:
        service.decide(loop, approve=body.approve, actor=identity.username, reason=body.reason)
    except service.LoopError as exc:
        raise refused(exc) from None
    log.info("loop %s: %s through its link by %s", loop.id, "approved" if body.approve else "denied",
             identity.username)
    return Status(202, service.summary(_loop(identity, loop.id), detail=True))
