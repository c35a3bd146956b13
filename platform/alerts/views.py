"""JSON API of alerts and silences: viewers read, operators create and expire silences (Bearer API token)."""
from __future__ import annotations

import datetime as dt
import re

from django.http import HttpRequest
from django.utils import timezone
from observatory.jsonapi import ApiError, json_body, json_view
from tenancy.keys import ApiIdentity
from traces.api import parse_time, project_for

from .models import Alert, AlertKind, AlertState, Severity, Silence
from .silences import MatcherError, matches_all, parse_matchers

MAX_LIMIT = 500
MAX_SILENCE = dt.timedelta(days=90)
MAX_COMMENT = 1000
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
_STATE_ORDER = {AlertState.FIRING: 0, AlertState.PENDING: 1, AlertState.RESOLVED: 2, AlertState.INACTIVE: 3}
_DURATION = re.compile(r"\s*(\d+)\s*([smhd])\s*")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _choices(request: HttpRequest, name: str, allowed) -> list[str] | None:
    raw = request.GET.get(name)
    if raw is None or raw == "":
        return None
    values = [v.strip() for v in raw.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ApiError(400, f"{name} takes a comma-separated subset of {', '.join(allowed)}; not {', '.join(bad)}")
    return values


def _limit(request: HttpRequest, default: int = 100) -> int:
    raw = request.GET.get("limit")
    if raw in (None, ""):
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise ApiError(400, f"limit must be a whole number from 1 to {MAX_LIMIT}")
    return int(raw)


# -- alerts ------------------------------------------------------------------------------------------------------
class _Muting:
    """What mutes the alerts of one project now: its active silences and the SLOs whose page fires, read once."""

    def __init__(self, project_ids, now: dt.datetime):
        self.silences = [(s, s.parsed_matchers()) for s in Silence.objects.filter(
            project_id__in=list(project_ids), starts_at__lte=now, ends_at__gt=now).order_by("id")]
        self.pages = dict(Alert.objects.filter(
            project_id__in=list(project_ids), kind=AlertKind.SLO_BURN, severity=Severity.PAGE,
            state=AlertState.FIRING, slo__isnull=False).values_list("slo_id", "fingerprint"))

    def of(self, alert: Alert) -> dict:
        if alert.state not in (AlertState.PENDING, AlertState.FIRING):
            return {}
        silences = [s.id for s, matchers in self.silences
                    if s.project_id == alert.project_id and matches_all(matchers, alert.labels)]
        if silences:
            return {"silences": silences}
        if alert.severity == Severity.TICKET and alert.slo_id in self.pages:
            return {"inhibited_by": self.pages[alert.slo_id]}
        return {}


def alert_json(alert: Alert, muting: _Muting, *, with_transitions: bool = False) -> dict:
    muted = muting.of(alert)
    data = {
        "fingerprint": alert.fingerprint,
        "kind": alert.kind,
        "severity": alert.severity,
        "state": alert.state,
        "project": alert.project.name,
        "slo": alert.slo.name if alert.slo_id and alert.slo else None,
        "episode": alert.episode,
        "labels": alert.labels,
        "annotations": {k: v for k, v in (alert.annotations or {}).items() if k != "title"},
        "title": (alert.annotations or {}).get("title", ""),
        "values": alert.last_values,
        "started_at": _iso(alert.started_at),
        "fired_at": _iso(alert.fired_at),
        "resolved_at": _iso(alert.resolved_at),
        "last_evaluated_at": _iso(alert.last_evaluated_at),
        "last_notified_at": _iso(alert.last_notified_at),
        "silenced_by": muted.get("silences", []),
        "inhibited_by": muted.get("inhibited_by"),
        "diagnosis": alert.diagnosis,
    }
    if with_transitions:
        data["transitions"] = [
            {"from": t.from_state or None, "to": t.to_state, "at": _iso(t.at), "episode": t.episode,
             "reason": t.reason, "event_id": str(t.event_id) if t.event_id else None, "notified": t.notified,
             "muted": t.muted or None, "delivery_ids": t.delivery_ids, "values": t.values}
            for t in alert.transitions.order_by("at", "id")
        ]
    return data


@json_view("GET")
def alerts_view(request: HttpRequest, identity: ApiIdentity) -> dict:
    """GET /api/v1/alerts?state=&severity=&slo=&kind=&limit=: the project's alerts, firing first."""
    project_id = project_for(request, identity)
    alerts = Alert.objects.filter(project_id=project_id).select_related("project", "slo")
    states = _choices(request, "state", AlertState.values)
    severities = _choices(request, "severity", Severity.values)
    kinds = _choices(request, "kind", AlertKind.values)
    if states:
        alerts = alerts.filter(state__in=states)
    if severities:
        alerts = alerts.filter(severity__in=severities)
    if kinds:
        alerts = alerts.filter(kind__in=kinds)
    slo = request.GET.get("slo")
    if slo:
        alerts = alerts.filter(slo__name=slo)
    limit = _limit(request)
    rows = sorted(alerts.order_by("-updated_at", "-id")[: MAX_LIMIT * 4],
                  key=lambda a: (_STATE_ORDER.get(a.state, 9), -a.started_at.timestamp(), -a.id))[:limit]
    muting = _Muting([project_id], timezone.now())
    return {"alerts": [alert_json(a, muting) for a in rows]}


@json_view("GET")
def alert_view(request: HttpRequest, identity: ApiIdentity, fingerprint: str) -> dict:
    """GET /api/v1/alerts/{fingerprint}: one alert of a project the token reads, with its transitions."""
    if not _FINGERPRINT.fullmatch(fingerprint):
        raise ApiError(404, "no such alert (a fingerprint is 64 lower-case hex characters)")
    projects = [project_for(request, identity)] if "project" in request.GET else list(identity.projects)
    alert = (Alert.objects.filter(fingerprint=fingerprint, project_id__in=projects)
             .select_related("project", "slo").first())
    if alert is None:
        raise ApiError(404, "no such alert")
    return {"alert": alert_json(alert, _Muting([alert.project_id], timezone.now()), with_transitions=True)}


# -- silences ----------------------------------------------------------------------------------------------------
def silence_json(silence: Silence, now: dt.datetime) -> dict:
    return {
        "id": silence.id,
        "project": silence.project.name,
        "matchers": silence.matchers,
        "starts_at": _iso(silence.starts_at),
        "ends_at": _iso(silence.ends_at),
        "status": silence.status(now),
        "created_by": silence.created_by_name,
        "comment": silence.comment,
        "created_at": _iso(silence.created_at),
        "expired_at": _iso(silence.expired_at),
        "expired_by": silence.expired_by_name or None,
    }


def _project_of_body(request: HttpRequest, identity: ApiIdentity, data: dict) -> int:
    if "project" in data and "project" not in request.GET:
        name = data["project"]
        if not isinstance(name, str) or name not in identity.project_names:
            raise ApiError(404, f"no project named {name!r} for this token")
        return identity.project_names[name]
    return project_for(request, identity)


def _require_operator(identity: ApiIdentity, project_id: int) -> None:
    if not identity.can(project_id, "operator"):
        raise ApiError(403, "managing silences needs the operator role in this project")


def _duration(value) -> dt.timedelta:
    if isinstance(value, bool):
        raise ApiError(400, "duration is a number of seconds or a text such as 30m, 2h, 1d")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and _DURATION.fullmatch(value):
        number, unit = _DURATION.fullmatch(value).groups()
        seconds = int(number) * _UNITS[unit]
    else:
        raise ApiError(400, "duration is a number of seconds or a text such as 30m, 2h, 1d")
    if not 0 < seconds <= MAX_SILENCE.total_seconds():
        raise ApiError(400, f"duration must be positive and at most {MAX_SILENCE.days} days")
    return dt.timedelta(seconds=seconds)


def create_silence(project_id: int, identity: ApiIdentity, data: dict, now: dt.datetime) -> Silence:
    unknown = set(data) - {"matchers", "starts_at", "ends_at", "duration", "comment", "project"}
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(sorted(unknown))}")
    try:
        matchers = parse_matchers(data.get("matchers"))
    except MatcherError as exc:
        raise ApiError(400, str(exc)) from None
    comment = data.get("comment")
    if not isinstance(comment, str) or not comment.strip():
        raise ApiError(400, "comment is required: say why the alerts are silenced")
    if len(comment) > MAX_COMMENT:
        raise ApiError(400, f"comment is longer than {MAX_COMMENT} characters")
    for name in ("starts_at", "ends_at"):
        if name in data and not isinstance(data[name], str):
            raise ApiError(400, f"{name} must be an ISO 8601 time, e.g. 2026-01-31T12:00:00Z")
    starts_at = parse_time(data.get("starts_at"), "starts_at") or now
    if "ends_at" in data and "duration" in data:
        raise ApiError(400, "give ends_at or duration, not both")
    if "ends_at" in data:
        ends_at = parse_time(data["ends_at"], "ends_at")
        if ends_at is None:
            raise ApiError(400, "ends_at must be an ISO 8601 time")
    elif "duration" in data:
        ends_at = starts_at + _duration(data["duration"])
    else:
        raise ApiError(400, "ends_at or duration is required (a silence always expires)")
    if ends_at <= starts_at:
        raise ApiError(400, "ends_at must be after starts_at")
    if ends_at <= now:
        raise ApiError(400, "ends_at is in the past")
    if ends_at - starts_at > MAX_SILENCE:
        raise ApiError(400, f"a silence lasts at most {MAX_SILENCE.days} days")
    return Silence.objects.create(
        project_id=project_id, matchers=[m.to_dict() for m in matchers], starts_at=starts_at, ends_at=ends_at,
        created_by_id=identity.user_id, created_by_name=identity.username, comment=comment.strip(), created_at=now,
    )


@json_view("GET", "POST")
def silences_view(request: HttpRequest, identity: ApiIdentity):
    """GET /api/v1/silences?status=active,pending,expired&limit=; POST /api/v1/silences (operators)."""
    now = timezone.now()
    if request.method == "POST":
        data = json_body(request)
        project_id = _project_of_body(request, identity, data)
        _require_operator(identity, project_id)
        silence = create_silence(project_id, identity, data, now)
        silence = Silence.objects.select_related("project").get(pk=silence.pk)
        affected = [a.fingerprint for a in Alert.objects.filter(
            project_id=project_id, state__in=(AlertState.PENDING, AlertState.FIRING))
            if matches_all(silence.parsed_matchers(), a.labels)]
        return {"silence": silence_json(silence, now), "silences_alerts": affected}, 201
    project_id = project_for(request, identity)
    statuses = _choices(request, "status", ("active", "pending", "expired"))
    silences = Silence.objects.filter(project_id=project_id).select_related("project").order_by("-id")
    if statuses:
        silences = [s for s in silences[: MAX_LIMIT * 4] if s.status(now) in statuses]
    return {"silences": [silence_json(s, now) for s in list(silences)[: _limit(request)]]}


@json_view("GET", "DELETE")
def silence_view(request: HttpRequest, identity: ApiIdentity, silence_id: int):
    """GET /api/v1/silences/{id}; DELETE expires it now (operators)."""
    silence = (Silence.objects.filter(pk=silence_id, project_id__in=list(identity.projects))
               .select_related("project").first())
    if silence is None:
        raise ApiError(404, "no such silence")
    now = timezone.now()
    if request.method == "DELETE":
        _require_operator(identity, silence.project_id)
        if silence.ends_at > now:
            Silence.objects.filter(pk=silence.pk, ends_at__gt=now).update(
                ends_at=now, expired_at=now, expired_by_name=identity.username)
            silence.refresh_from_db()
    return {"silence": silence_json(silence, now)}
