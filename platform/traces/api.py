"""JSON API v1: requests of a trace and latency summaries (Authorization: Bearer <api token>)."""
from __future__ import annotations

import datetime as dt
import re

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from observatory.jsonapi import ApiError, json_view
from tenancy.keys import ApiIdentity

from . import queries
from .store import get_store

_TRACE_ID = re.compile(r"[0-9a-fA-F]{32}")  # used with fullmatch: "$" would let a trailing newline through
MAX_RANGE = dt.timedelta(days=400)
# What the store's DateTime64 columns can hold; outside it a time is refused instead of being clamped or
# overflowing Python's datetime (year 1 minus one hour).
EARLIEST = dt.datetime(1900, 1, 1, tzinfo=dt.timezone.utc)
LATEST = dt.datetime(2299, 12, 31, 23, 59, 59, tzinfo=dt.timezone.utc)


@csrf_exempt
def not_found_view(request: HttpRequest, *args, **kwargs) -> JsonResponse:
    """Unknown paths under /api/ answer in JSON like the rest of the API."""
    return JsonResponse({"error": f"no API endpoint at {request.path}"}, status=404)


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


def parse_time(value: str | None, name: str) -> dt.datetime | None:
    """An ISO 8601 time as an aware UTC datetime (a naive time is UTC), or None when absent or empty."""
    if value is None or value == "":
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=dt.timezone.utc)
        parsed = parsed.astimezone(dt.timezone.utc)
    except (ValueError, OverflowError):
        raise ApiError(400, f"{name} must be an ISO 8601 time, e.g. 2026-01-31T12:00:00Z") from None
    if not EARLIEST <= parsed <= LATEST:
        raise ApiError(400, f"{name} must be between {EARLIEST:%Y-%m-%d} and {LATEST:%Y-%m-%d}")
    return parsed


@json_view("GET")
def requests_view(request: HttpRequest, identity: ApiIdentity) -> dict:
    project_id = project_for(request, identity)
    trace_id = request.GET.get("trace_id", "")
    if not _TRACE_ID.fullmatch(trace_id):
        raise ApiError(400, "trace_id must be 32 hex characters")
    return {"requests": queries.requests_for_trace(get_store(), project_id, trace_id.lower())}


@json_view("GET")
def latency_summary_view(request: HttpRequest, identity: ApiIdentity) -> dict:
    project_id = project_for(request, identity)
    until = parse_time(request.GET.get("until"), "until") or dt.datetime.now(dt.timezone.utc)
    since = parse_time(request.GET.get("since"), "since") or max(until - dt.timedelta(hours=1), EARLIEST)
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
