"""GET /api/v1/engine: the managed engine fleet. Viewers see its models, groups and replica states; the fleet's
internals (paths, pids, argv, ports, URLs, logs, engine configs) need a token with the admin role in some project."""
from __future__ import annotations

from typing import Any, Optional

from apikit.api import ApiError, ApiRouter, declared
from django.http import HttpRequest
from ninja import Schema
from pydantic import Field

from .state import fleet_state, summary_of

router = ApiRouter(tags=["engine"])


class GroupView(Schema):
    name: str
    weight: Optional[float] = None
    replicas: Optional[int] = None
    backend: Optional[str] = None
    served_model_name: Optional[str] = None
    config_version: Optional[str] = None
    changing: bool = Field(False, description="a config change (drain-and-replace) is in progress")


class ReplicaView(Schema):
    name: str
    group: Optional[str] = None
    state: Optional[str] = None
    config_version: Optional[str] = None
    restarts: Optional[int] = None
    since: Optional[str] = None


class FleetView(Schema):
    name: Optional[str] = None
    state: Optional[str] = None
    updated_at: Optional[str] = None
    groups: list[GroupView]
    replicas: list[ReplicaView]


class Engine(Schema):
    running: bool
    detail: str = Field(description="'summary' (models and replica states) or 'full' (a project admin's token: the "
                                    "controller's whole report, with paths, pids, argv and ports)")
    fleet: Optional[dict[str, Any]] = Field(description="with detail 'summary', a FleetView")
    last_state: Optional[dict[str, Any]] = None
    error: Optional[str] = None


@router.get("/engine", response=declared(ok={200: Engine}),
            summary="The managed engine fleet: groups, models, weights, config versions, replica states",
            description="What the fleet controller reports (`manage.py engine status --json`); `running` is false, "
                        "with the last recorded state, when no controller answers. Tokens with the admin role in "
                        "some project get the whole report (`detail: full`); others its models, groups and replica "
                        "states (`detail: summary`).")
def engine_view(request: HttpRequest):
    identity = request.auth
    if not identity.projects:
        raise ApiError(403, "this token has no role in any project")
    state = fleet_state()
    if any(role == "admin" for role in identity.projects.values()):
        return {**state, "detail": "full", "last_state": state.get("last_state"), "error": state.get("error")}
    return {"running": state.get("running", False), "detail": "summary", "fleet": summary_of(state.get("fleet")),
            "last_state": summary_of(state.get("last_state")), "error": state.get("error")}
