"""The control client of the fleet controller's API (weights, groups, canaries): one call, answered or refused
with the controller's reason."""
from __future__ import annotations

from engine.launcher.control_client import ControlUnavailable, control_request
from engine.launcher.fleet_spec import FleetSpecError

from .state import FleetUnavailable, fleet_spec


def fleet_control(method: str, path: str, body: dict | None = None, *, timeout: float = 10.0) -> tuple[int, dict]:
    """One call to the fleet controller's control API: (HTTP status, JSON body). Raises FleetUnavailable, with the
    reason, when no controller answers."""
    try:
        spec = fleet_spec()
    except FleetSpecError as exc:
        raise FleetUnavailable(f"the fleet file cannot be read: {'; '.join(exc.problems)}") from None
    try:
        return control_request(spec, method, path, body, timeout=timeout)
    except ControlUnavailable as exc:
        raise FleetUnavailable(str(exc)) from None


class FleetRefused(RuntimeError):
    """The fleet controller answered, and refused the call (4xx/5xx); the message has its reason."""


def control(method: str, path: str, body: dict | None = None, *, timeout: float = 10.0) -> dict:
    """A control call that must succeed: its JSON body. FleetUnavailable when no controller answers, FleetRefused
    when it refuses."""
    status, payload = fleet_control(method, path, body, timeout=timeout)
    if status >= 400:
        raise FleetRefused(f"{method} {path}: the fleet controller answered {status}: "
                           f"{payload.get('error') or payload}"
                           + (f" ({'; '.join(payload['problems'])})" if payload.get("problems") else ""))
    return payload


def snapshot(timeout: float = 5.0) -> dict:
    """The running controller's report (`GET /fleet`); FleetUnavailable when none answers or it fails."""
    status, body = fleet_control("GET", "/fleet", timeout=timeout)
    if status != 200:
        raise FleetUnavailable(f"the fleet controller answered {status}: {body.get('error', '')}")
    return body


def group_of(fleet: dict, name: str) -> dict | None:
    """The group ``name`` in a controller's report."""
    return next((g for g in fleet.get("groups") or [] if g.get("name") == name), None)


def healthy_replicas(fleet: dict, group: str) -> int:
    """How many of the group's replicas the report calls healthy."""
    return sum(1 for r in fleet.get("replicas") or [] if r.get("group") == group and r.get("state") == "healthy")
