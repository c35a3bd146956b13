"""JSON API of SLOs: /api/v1/slos (list, create), /api/v1/slos/{name} (read, replace, delete), …/{name}/history.

Viewers read; operators (and admins) create, replace and delete. Definitions are validated exactly like the YAML.
"""
from __future__ import annotations

import datetime as dt
import logging

from django.http import HttpRequest
from observatory.jsonapi import ApiError, json_body, json_view
from tenancy.keys import ApiIdentity
from traces.api import parse_time, project_for
from traces.store import get_store

from . import burn, definitions, queries, services
from .models import SLO

log = logging.getLogger(__name__)
MAX_SERIES_POINTS = 10_000
MAX_SERIES_RANGE = dt.timedelta(days=90)
# Fields of the answer that are not part of a definition: a body read with GET can be sent back with PUT.
READ_ONLY = ("objective_percent", "period_days", "repeat_interval_seconds", "default_tiers", "error_budget",
             "created_at", "updated_at", "status", "series")


def _definition_error(exc: definitions.DefinitionError) -> ApiError:
    return ApiError(400, f"invalid SLO: {'; '.join(exc.problems)}", problems=exc.problems)


# Validation errors are 400 and list the "problems"; a name taken in the project is 409.
_ERRORS = {definitions.DefinitionError: _definition_error, services.SloExists: lambda exc: ApiError(409, str(exc))}


def _definition(request: HttpRequest) -> dict:
    """The JSON body as an SLO definition: the read-only fields of an answer are dropped."""
    body = json_body(request, hint="an SLO definition, see docs/slo.md")
    for key in READ_ONLY:
        body.pop(key, None)
    return body


def _project(request: HttpRequest, identity: ApiIdentity, body: dict | None = None) -> tuple[int, str]:
    """The project from ?project=, or from the body's "project", or the token's only project."""
    if body is not None and "project" in body:
        name = body.pop("project")
        if request.GET.get("project") not in (None, name):
            raise ApiError(400, "?project= and the body's project differ")
        if not isinstance(name, str) or name not in identity.project_names:
            raise ApiError(404, f"no project named {name!r} for this token")
        project_id = identity.project_names[name]
    else:
        project_id = project_for(request, identity)
    names = {pid: n for n, pid in identity.project_names.items()}
    return project_id, names[project_id]


def _require(identity: ApiIdentity, project_id: int, project_name: str, role: str) -> None:
    if not identity.can(project_id, role):
        raise ApiError(403, f"this token needs the {role} role in project {project_name} for that")


def _slo(project_id: int, name: str) -> SLO:
    slo = SLO.objects.filter(project_id=project_id, name=name).first()
    if slo is None:
        raise ApiError(404, f"no SLO named {name!r} in this project")
    return slo


@json_view("GET", "POST", errors=_ERRORS)
def slos_view(request: HttpRequest, identity: ApiIdentity):
    if request.method == "POST":
        body = _definition(request)
        project_id, project_name = _project(request, identity, body)
        _require(identity, project_id, project_name, "operator")
        slo = services.create(project_id, body)
        log.info("SLO %s/%s created by %s", project_name, slo.name, identity.username)
        return services.describe(slo, project_name), 201
    project_id, project_name = _project(request, identity)
    slos = SLO.objects.filter(project_id=project_id).order_by("name")
    return {"project": project_name, "slos": [services.describe(s, project_name) for s in slos]}


@json_view("GET", "PUT", "DELETE", errors=_ERRORS)
def slo_view(request: HttpRequest, identity: ApiIdentity, name: str):
    if request.method == "PUT":
        body = _definition(request)
        project_id, project_name = _project(request, identity, body)
        _require(identity, project_id, project_name, "operator")
        slo = _slo(project_id, name)
        body.setdefault("name", name)
        slo, changed = services.replace(slo, body)
        log.info("SLO %s/%s replaced by %s (%s)", project_name, name, identity.username, ", ".join(changed) or "no change")
        return services.describe(slo, project_name)
    project_id, project_name = _project(request, identity)
    slo = _slo(project_id, name)
    if request.method == "DELETE":
        _require(identity, project_id, project_name, "operator")
        slo.delete()
        log.info("SLO %s/%s deleted by %s", project_name, name, identity.username)
        return {"deleted": name, "project": project_name}
    body = services.describe(slo, project_name)
    series = request.GET.get("series")
    if series:
        try:
            span = burn.parse_window(series)
        except ValueError as exc:
            raise ApiError(400, f"series: {exc}") from None
        if span > MAX_SERIES_RANGE:
            raise ApiError(400, f"series covers at most {MAX_SERIES_RANGE.days}d")
        until = dt.datetime.now(dt.timezone.utc)
        body["series"] = queries.status_series(get_store(), project_id, slo.id, until - span, until, MAX_SERIES_POINTS)
    return body


@json_view("GET", errors=_ERRORS)
def slo_history_view(request: HttpRequest, identity: ApiIdentity, name: str):
    project_id, project_name = _project(request, identity)
    slo = _slo(project_id, name)
    until = parse_time(request.GET.get("until"), "until") or dt.datetime.now(dt.timezone.utc)
    since = parse_time(request.GET.get("since"), "since") or until - dt.timedelta(hours=24)
    if since >= until:
        raise ApiError(400, "since must be before until")
    if until - since > MAX_SERIES_RANGE:
        raise ApiError(400, f"the time range is limited to {MAX_SERIES_RANGE.days} days")
    raw_limit = request.GET.get("limit", "1440")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_SERIES_POINTS:
        raise ApiError(400, f"limit must be a whole number from 1 to {MAX_SERIES_POINTS}")
    points = queries.status_series(get_store(), project_id, slo.id, since, until, int(raw_limit))
    return {
        "project": project_name, "slo": slo.name,
        "since": since.isoformat().replace("+00:00", "Z"), "until": until.isoformat().replace("+00:00", "Z"),
        "points": points,
    }
