"""The managed fleet as the platform reads it: the fleet file (as `manage.py engine` reads it), the controller's
report (`GET /fleet`) or its last recorded state, and its replica groups."""
from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings

from engine.launcher.fleet_spec import FleetSpec, FleetSpecError
from engine.launcher.run_dir import read_state_file


class FleetUnavailable(RuntimeError):
    """No fleet controller answers (not started, stopped, restarting), or the fleet file cannot be read."""


class UnknownGroup(LookupError):
    """The fleet has no replica group of that name (a rollout's canary group is not one of the fleet's)."""


def _launcher_cli():
    """engine.launcher.cli, imported on first use: it brings the fleet's controller and the gateway (aiohttp,
    redis), ~0.4 s that every Django process (each manage.py command, each worker) would pay at start."""
    from engine.launcher import cli

    return cli


def fleet_spec():
    """The fleet file the platform manages, read the way ``manage.py engine`` reads it (FleetSpecError)."""
    env = dict(os.environ)
    if not env.get("ENGINE_FLEET"):
        # The default fleet runs from the platform's data directory (as `manage.py engine up` starts it);
        # a fleet file of one's own keeps its own run_dir.
        env.setdefault("ENGINE_RUN_DIR", str(Path(settings.DATA_DIR) / "engine"))
    return FleetSpec.load(_launcher_cli().default_fleet_file(), env=env)


def fleet_state() -> dict:
    """The managed engine fleet as its controller reports it (``GET /fleet``), for the platform's API.

    ``running`` is False, with the last recorded state if there is one, when no controller
    answers. Reads the fleet file and run directory the way ``manage.py engine`` does.
    """
    try:
        spec = fleet_spec()
    except FleetSpecError as exc:
        return {"running": False, "fleet": None, "error": "invalid fleet file", "problems": exc.problems}
    snapshot = _launcher_cli().fetch_fleet(spec, timeout=2.0)
    if snapshot is not None:
        return {"running": True, "fleet": snapshot}
    return {"running": False, "fleet": None, "last_state": read_state_file(spec.run_dir)}


def fleet_groups() -> tuple[list[dict], bool]:
    """The fleet's replica groups (dicts with name, config, weight, and upstreams and dynamic when a controller
    reported them) and whether a controller answered: the running controller's, else its last recorded state's,
    else the fleet file's. Raises FleetUnavailable when the fleet file cannot be read."""
    state = fleet_state()
    fleet = state.get("fleet") or state.get("last_state") or {}
    groups = [g for g in fleet.get("groups") or [] if isinstance(g, dict)]
    if groups:
        return groups, bool(state.get("running"))
    try:
        spec = fleet_spec()
    except FleetSpecError as exc:
        raise FleetUnavailable(f"the fleet file cannot be read: {'; '.join(exc.problems)}") from None
    return [g.to_dict() for g in spec.groups], False


def fleet_group(name: str) -> tuple[dict, list[dict], bool]:
    """(the replica group ``name``, every group, whether a controller answered), as fleet_groups() reads them.
    UnknownGroup when the fleet has no such group or it is a rollout's canary group; FleetUnavailable when the fleet
    file cannot be read."""
    groups, live = fleet_groups()
    entry = next((g for g in groups if g.get("name") == name), None)
    if entry is not None and entry.get("dynamic"):
        raise UnknownGroup(f"{name!r} is a canary group of a rollout, not a group of the fleet")
    if entry is None:
        names = ", ".join(g.get("name", "?") for g in groups if not g.get("dynamic"))
        raise UnknownGroup(f"the fleet has no replica group {name!r} (groups: {names or 'none'})")
    return entry, groups, live


def group_names() -> list[str]:
    """The names of the fleet's replica groups (not rollouts' canary groups); [] when the fleet cannot be read."""
    try:
        groups, _ = fleet_groups()
    except FleetUnavailable:
        return []
    return [g.get("name") for g in groups if not g.get("dynamic")]


def summary_of(fleet: dict | None) -> dict | None:
    """What any reader may see of a fleet report: its models, groups and replica states."""
    if not isinstance(fleet, dict):
        return None
    groups = []
    for group in fleet.get("groups") or []:
        groups.append({
            "name": group.get("name"), "weight": group.get("weight"), "replicas": group.get("replicas"),
            "backend": group.get("backend"),
            "served_model_name": group.get("served_model_name") or (group.get("config") or {}).get("served_model_name"),
            "config_version": group.get("config_version"), "changing": bool(group.get("transition")),
        })
    replicas = [{"name": r.get("name"), "group": r.get("group"), "state": r.get("state"),
                 "config_version": r.get("config_version"), "restarts": r.get("restarts"), "since": r.get("since")}
                for r in fleet.get("replicas") or fleet.get("processes") or [] if r.get("role", "replica") == "replica"]
    return {"name": fleet.get("fleet") or fleet.get("name"), "state": fleet.get("state"),
            "updated_at": fleet.get("updated_at"), "groups": groups, "replicas": replicas}
