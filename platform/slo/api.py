"""JSON API of SLOs: /api/v1/slos (list, create), /api/v1/slos/{name} (read, replace, delete), …/{name}/history.

Viewers read; operators (and admins) create, replace and delete. Definitions are validated exactly like the YAML.
"""
from __future__ import annotations

import datetime as dt
import functools
import json
import logging

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from tenancy.keys import ApiIdentity, bearer_token, resolve_api_token
from traces.api import ApiError, parse_time, project_for
from traces.store import StoreUnavailable, get_store

from . import burn, definitions, queries, services
from .models import SLO

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024
MAX_SERIES_POINTS = 10_000
MAX_SERIES_RANGE = dt.timedelta(days=90)
# Fields of the answer that are not part of a definition: a body read with GET can be sent back with PUT.
READ_ONLY = ("objective_percent", "period_days", "repeat_interval_seconds", "default_tiers", "error_budget",
             "created_at", "updated_at", "status", "series")


def json_api(*methods: str):
    """Bearer-token auth, JSON in and out; errors are {"error": …} (validation errors add "problems")."""
    allowed = tuple(methods) + (("HEAD",) if "GET" in methods else ())

    def decorate(fn):
        @functools.wraps(fn)
        @csrf_exempt
        def wrapper(request: HttpRequest, *args, **kwargs):
            if request.method not in allowed:
                response = JsonResponse({"error": f"method {request.method} not allowed; use {', '.join(methods)}"},
                                        status=405)
                response["Allow"] = ", ".join(allowed)
                return response
            try:
                identity = resolve_api_token(bearer_token(request.META.get("HTTP_AUTHORIZATION")))
                if identity is None:
                    raise ApiError(401, "missing or invalid API token (Authorization: Bearer <token>)")
                status, body = fn(request, identity, *args, **kwargs)
                return JsonResponse(body, status=status)
            except ApiError as exc:
                return JsonResponse({"error": exc.message}, status=exc.status)
            except definitions.DefinitionError as exc:
                return JsonResponse({"error": f"invalid SLO: {'; '.join(exc.problems)}", "problems": exc.problems},
                                    status=400)
            except services.SloExists as exc:
                return JsonResponse({"error": str(exc)}, status=409)
            except StoreUnavailable:
                response = JsonResponse({"error": "the trace store is unavailable; retry shortly"}, status=503)
                response["Retry-After"] = "5"
                return response
            except Exception:
                log.exception("API request failed: %s %s", request.method, request.get_full_path())
                return JsonResponse({"error": "internal error"}, status=500)

        return wrapper

    return decorate


def _body(request: HttpRequest) -> dict:
    if len(request.body) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is limited to {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(request.body or b"")
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the body must be a JSON object (an SLO definition, see docs/slo.md)") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object (an SLO definition, see docs/slo.md)")
    for key in READ_ONLY:
        data.pop(key, None)
    return data


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


@json_api("GET", "POST")
def slos_view(request: HttpRequest, identity: ApiIdentity):
    if request.method == "POST":
        body = _body(request)
        project_id, project_name = _project(request, identity, body)
        _require(identity, project_id, project_name, "operator")
        slo = services.create(project_id, body)
        log.info("SLO %s/%s created by %s", project_name, slo.name, identity.username)
        return 201, services.describe(slo, project_name)
    project_id, project_name = _project(request, identity)
    slos = SLO.objects.filter(project_id=project_id).order_by("name")
    return 200, {"project": project_name, "slos": [services.describe(s, project_name) for s in slos]}


@json_api("GET", "PUT", "DELETE")
def slo_view(request: HttpRequest, identity: ApiIdentity, name: str):
    if request.method == "PUT":
        body = _body(request)
        project_id, project_name = _project(request, identity, body)
        _require(identity, project_id, project_name, "operator")
        slo = _slo(project_id, name)
        body.setdefault("name", name)
        slo, changed = services.replace(slo, body)
        log.info("SLO %s/%s replaced by %s (%s)", project_name, name, identity.username, ", ".join(changed) or "no change")
        return 200, services.describe(slo, project_name)
    project_id, project_name = _project(request, identity)
    slo = _slo(project_id, name)
    if request.method == "DELETE":
        _require(identity, project_id, project_name, "operator")
        slo.delete()
        log.info("SLO %s/%s deleted by %s", project_name, name, identity.username)
        return 200, {"deleted": name, "project": project_name}
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
    return 200, body


@json_api("GET")
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
    return 200, {
        "project": project_name, "slo": slo.name,
        "since": since.isoformat().replace("+00:00", "Z"), "until": until.isoformat().replace("+00:00", "Z"),
        "points": points,
    }
