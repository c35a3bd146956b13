"""JSON API v1: requests of a trace and latency summaries (Authorization: Bearer <api token>)."""
from __future__ import annotations

import datetime as dt
import functools
import re

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from tenancy.keys import ApiIdentity, bearer_token, resolve_api_token

from . import queries
from .store import StoreUnavailable, get_store

_TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")
MAX_RANGE = dt.timedelta(days=400)


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def api_view(fn):
    @functools.wraps(fn)
    @require_GET
    def wrapper(request: HttpRequest, *args, **kwargs):
        identity = resolve_api_token(bearer_token(request.META.get("HTTP_AUTHORIZATION")))
        try:
            if identity is None:
                raise ApiError(401, "missing or invalid API token (Authorization: Bearer <token>)")
            return JsonResponse(fn(request, identity, *args, **kwargs))
        except ApiError as exc:
            return JsonResponse({"error": exc.message}, status=exc.status)
        except StoreUnavailable:
            response = JsonResponse({"error": "the trace store is unavailable; retry shortly"}, status=503)
            response["Retry-After"] = "5"
            return response

    return wrapper


def project_for(request: HttpRequest, identity: ApiIdentity) -> int:
    """The project asked for with ?project=NAME, or the token's only project."""
    name = request.GET.get("project")
    if name is None:
        if len(identity.projects) == 1:
            return next(iter(identity.projects))
        if not identity.projects:
            raise ApiError(403, "this token has no project")
        raise ApiError(400, "this token can read several projects: pass ?project=NAME")
    project_id = identity.project_names.get(name)
    if project_id is None:
        raise ApiError(404, f"no project named {name!r} for this token")
    return project_id


def parse_time(value: str | None, default: dt.datetime, name: str) -> dt.datetime:
    if value is None or value == "":
        return default
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ApiError(400, f"{name} must be an ISO 8601 time, e.g. 2026-01-31T12:00:00Z") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    return parsed.astimezone(dt.timezone.utc)


@api_view
def requests_view(request: HttpRequest, identity: ApiIdentity) -> dict:
    project_id = project_for(request, identity)
    trace_id = request.GET.get("trace_id", "")
    if not _TRACE_ID.match(trace_id):
        raise ApiError(400, "trace_id must be 32 hex characters")
    return {"requests": queries.requests_for_trace(get_store(), project_id, trace_id.lower())}


@api_view
def latency_summary_view(request: HttpRequest, identity: ApiIdentity) -> dict:
    project_id = project_for(request, identity)
    now = dt.datetime.now(dt.timezone.utc)
    until = parse_time(request.GET.get("until"), now, "until")
    since = parse_time(request.GET.get("since"), until - dt.timedelta(hours=1), "since")
    if since >= until:
        raise ApiError(400, "since must be before until")
    if until - since > MAX_RANGE:
        raise ApiError(400, f"the time range is limited to {MAX_RANGE.days} days")
    group_by = [g for g in request.GET.get("group_by", "model").split(",") if g]
    bad = [g for g in group_by if g not in queries.GROUP_DIMENSIONS]
    if bad or len(set(group_by)) != len(group_by):
        raise ApiError(400, f"group_by takes a comma-separated subset of {', '.join(queries.GROUP_DIMENSIONS)}")
    filters = {name: request.GET[name] for name in queries.FILTER_DIMENSIONS if name in request.GET}
    exact = request.GET.get("exact", "").lower() in {"1", "true", "yes"}
    groups = queries.latency_summary(
        get_store(), project_id, since=since, until=until, group_by=group_by, filters=filters, exact=exact
    )
    return {
        "since": since.isoformat().replace("+00:00", "Z"),
        "until": until.isoformat().replace("+00:00", "Z"),
        "group_by": group_by,
        "filters": filters,
        "quantiles": {
            "method": "exact" if exact else "t-digest",
            "error": "exact" if exact else queries.TDIGEST_ERROR_NOTE,
        },
        "groups": groups,
    }
