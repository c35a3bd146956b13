"""JSON API of alerts and silences (router of apikit.api): viewers read, operators create and expire silences."""
from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal, Optional, Union

from apikit.api import PROJECT_DESCRIPTION, ApiError, ApiRouter, declared, project_for, require
from apikit.inputs import DurationOrSeconds, Fingerprint, Matching, ProjectName, QueryInt, Subset, Text, Time
from django.http import HttpRequest
from django.utils import timezone
from ninja import Path, Query, Schema
from ninja.responses import Status
from pydantic import ConfigDict, Field, StrictBool
from tenancy.keys import ApiIdentity

from .matchers import MAX_MATCHERS, MAX_VALUE_LENGTH, OPERATORS, MatcherError, matches_all, parse_matchers
from .models import Alert as AlertRow
from .models import AlertKind, AlertState, Severity
from .models import Silence as SilenceRow

router = ApiRouter(tags=["alerts"])
MAX_LIMIT = 500
MAX_SILENCE = dt.timedelta(days=90)
MAX_COMMENT = 1000
_STATE_ORDER = {AlertState.FIRING: 0, AlertState.PENDING: 1, AlertState.RESOLVED: 2, AlertState.INACTIVE: 3}


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


# -- alerts ------------------------------------------------------------------------------------------------------
class _Muting:
    """What mutes the alerts of one project now: its active silences and the SLOs whose page fires, read once."""

    def __init__(self, project_ids, now: dt.datetime):
        self.silences = [(s, s.parsed_matchers()) for s in SilenceRow.objects.filter(
            project_id__in=list(project_ids), starts_at__lte=now, ends_at__gt=now).order_by("id")]
        self.pages = dict(AlertRow.objects.filter(
            project_id__in=list(project_ids), kind=AlertKind.SLO_BURN, severity=Severity.PAGE,
            state=AlertState.FIRING, slo__isnull=False).values_list("slo_id", "fingerprint"))

    def of(self, alert: AlertRow) -> dict:
        if alert.state not in (AlertState.PENDING, AlertState.FIRING):
            return {}
        silences = [s.id for s, matchers in self.silences
                    if s.project_id == alert.project_id and matches_all(matchers, alert.labels)]
        if silences:
            return {"silences": silences}
        if alert.severity == Severity.TICKET and alert.slo_id in self.pages:
            return {"inhibited_by": self.pages[alert.slo_id]}
        return {}


def alert_json(alert: AlertRow, muting: _Muting, *, with_transitions: bool = False) -> dict:
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


class AlertsQuery(Schema):
    state: Optional[Subset("pending", "firing", "resolved", "inactive")] = None
    severity: Optional[Subset("page", "ticket")] = None
    kind: Optional[Subset("slo_burn", "latency_regression", "engine_model_drift")] = None
    slo: Optional[Text(100)] = Field(None, description="only the alerts of this SLO (by name)")
    limit: QueryInt(1, MAX_LIMIT, "at most this many alerts") = 100
    project: Optional[ProjectName] = Field(None, description=PROJECT_DESCRIPTION)


class AlertQuery(Schema):
    project: Optional[ProjectName] = Field(None, description="look in this project only (default: every project "
                                                             "of the token)")


class AlertPath(Schema):
    fingerprint: Fingerprint


class AlertTransition(Schema):
    model_config = ConfigDict(populate_by_name=True)
    from_state: Optional[str] = Field(alias="from")
    to: str
    at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    episode: int
    reason: str
    event_id: Optional[str] = Field(description="the notification event (unique)")
    notified: bool
    muted: Optional[dict[str, Any]] = Field(description='{"silences": [ids]} or {"inhibited_by": fingerprint}')
    delivery_ids: list[int]
    values: Optional[dict[str, Any]]


class Diagnosis(Schema):
    """Why the SLO burns (docs/alerts.md#diagnosis); `error` instead of the figures when it failed."""

    model_config = ConfigDict(extra="allow")
    sli: Optional[str] = None
    threshold_ms: Optional[float] = None
    burning: Optional[dict[str, Any]] = None
    baseline: Optional[dict[str, Any]] = None
    baseline_usable: Optional[bool] = None
    components: Optional[dict[str, Any]] = Field(None, description="network, overhead, queue, prefill, decode: p50, "
                                                                   "p95, mean and share of e2e per window, and deltas")
    prefix_cache: Optional[dict[str, Any]] = Field(
        None, description="vLLM's prefix-cache token hit ratio per window, its change, direction and change point; "
                          "null when no request reported cached prompt tokens")
    dominant_component: Optional[str] = None
    dominant_reason: Optional[str] = None
    top_contributors: Optional[list[dict[str, Any]]] = None
    contributors: Optional[dict[str, Any]] = None
    suggestion: Optional[str] = None
    suggestion_detail: Optional[dict[str, Any]] = None
    summary: Optional[str] = None
    error: Optional[str] = None


class Alert(Schema):
    fingerprint: str = Field(description="sha256 of project, kind, SLO id (or regression key) and severity")
    kind: Literal["slo_burn", "latency_regression", "engine_model_drift"]
    severity: Literal["page", "ticket"]
    state: Literal["pending", "firing", "resolved", "inactive"]
    project: str
    slo: Optional[str]
    episode: int
    labels: dict[str, str]
    annotations: dict[str, Any]
    title: str
    values: Optional[dict[str, Any]] = Field(description="the newest evaluation's figures (burn rates, budget, p50s)")
    started_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    fired_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    resolved_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    last_evaluated_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    last_notified_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    silenced_by: list[int]
    inhibited_by: Optional[str]
    diagnosis: Optional[Diagnosis] = Field(description="docs/alerts.md#diagnosis")
    transitions: Optional[list[AlertTransition]] = Field(None, description="only on GET /api/v1/alerts/{fingerprint}")


class AlertList(Schema):
    alerts: list[Alert]


class OneAlert(Schema):
    alert: Alert


def _choices(value: str | None) -> list[str] | None:
    return [v for v in value.split(",") if v] if value else None


@router.get("/alerts", response=declared(ok={200: AlertList}), summary="The project's alerts, firing first")
def alerts_view(request: HttpRequest, query: Query[AlertsQuery]):
    project_id = project_for(request.auth, query.project)
    alerts = AlertRow.objects.filter(project_id=project_id).select_related("project", "slo")
    for field, values in (("state", _choices(query.state)), ("severity", _choices(query.severity)),
                          ("kind", _choices(query.kind))):
        if values:
            alerts = alerts.filter(**{f"{field}__in": values})
    if query.slo:
        alerts = alerts.filter(slo__name=query.slo)
    rows = sorted(alerts.order_by("-updated_at", "-id")[: MAX_LIMIT * 4],
                  key=lambda a: (_STATE_ORDER.get(a.state, 9), -a.started_at.timestamp(), -a.id))[:query.limit]
    muting = _Muting([project_id], timezone.now())
    return {"alerts": [alert_json(a, muting) for a in rows]}


@router.get("/alerts/{fingerprint}", response=declared(ok={200: OneAlert}),
            summary="One alert of a project the token reads, with its transitions")
def alert_view(request: HttpRequest, path: Path[AlertPath], query: Query[AlertQuery]):
    identity = request.auth
    projects = [project_for(identity, query.project)] if query.project is not None else list(identity.projects)
    alert = (AlertRow.objects.filter(fingerprint=path.fingerprint, project_id__in=projects)
             .select_related("project", "slo").first())
    if alert is None:
        raise ApiError(404, "no such alert")
    return {"alert": alert_json(alert, _Muting([alert.project_id], timezone.now()), with_transitions=True)}


# -- silences ----------------------------------------------------------------------------------------------------
def silence_json(silence: SilenceRow, now: dt.datetime) -> dict:
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


LabelName = Matching(r"^[A-Za-z_][A-Za-z0-9_]*$", "a label name ([A-Za-z_][A-Za-z0-9_]*)", max_length=200)


class Matcher(Schema):
    """A label matcher as Alertmanager reads it; `op` or Alertmanager's isRegex/isEqual."""

    model_config = ConfigDict(extra="forbid")
    name: LabelName
    op: Optional[Literal[OPERATORS]] = None  # type: ignore[valid-type]
    value: Text(MAX_VALUE_LENGTH, description="a regular expression with =~ and !~ (anchored at both ends)")
    isRegex: Optional[StrictBool] = None
    isEqual: Optional[StrictBool] = None


MatcherText = Text(MAX_VALUE_LENGTH + 210, pattern=r"^ *[A-Za-z_][A-Za-z0-9_]* *(=~|!~|!=|=)[^\x00-\x1f\x7f]*$",
                   reason='a matcher: name=value, name!=value, name=~regex or name!~regex',
                   description='the text form: name="value", name!=value, name=~regex, name!~regex')
Comment = Text(MAX_COMMENT, min_length=1, multiline=True, pattern=r"^[^\x00-\x08\x0b-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x08\x0b-\x1f\x7f]*$",
               reason="say why the alerts are silenced (not only spaces)", description="why the alerts are silenced")
SilenceDuration = DurationOrSeconds(dt.timedelta(seconds=1), MAX_SILENCE, "e.g. 30m, 2h or 1d, or seconds; at most 90d")


class SilenceIn(Schema):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"matchers": ['slo="chat-ttft"', {"name": "severity", "op": "=~", "value": "page|ticket"}], "duration": "2h",
         "comment": "deploying the new gateway"}],
        # ends_at or duration, exactly one (null is the same as left out).
        "oneOf": [
            {"required": ["ends_at"], "properties": {"ends_at": {"type": "string"}, "duration": {"type": "null"}}},
            {"required": ["duration"], "properties": {"ends_at": {"type": "null"}, "duration": {"not": {"type": "null"}}}},
        ]})
    matchers: Annotated[list[Union[Matcher, MatcherText]], Field(min_length=1, max_length=MAX_MATCHERS)] = Field(
        description="all must match; at least one must not match the empty value (a silence never mutes everything)")
    comment: Comment
    starts_at: Optional[Time] = Field(None, description="default: now")
    ends_at: Optional[Time] = Field(None, description="after starts_at and now; give ends_at or duration")
    duration: Optional[SilenceDuration] = Field(None, description="instead of ends_at")


class Silence(Schema):
    id: int
    project: str
    matchers: list[dict[str, str]]
    starts_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    ends_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    status: Literal["active", "pending", "expired"]
    created_by: str
    comment: str
    created_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    expired_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    expired_by: Optional[str]


class SilenceCreated(Schema):
    silence: Silence
    silences_alerts: list[str] = Field(description="fingerprints of the pending or firing alerts it mutes now")


class OneSilence(Schema):
    silence: Silence


class SilenceList(Schema):
    silences: list[Silence]


class SilencesQuery(Schema):
    status: Optional[Subset("active", "pending", "expired")] = None
    limit: QueryInt(1, MAX_LIMIT, "at most this many silences") = 100
    project: Optional[ProjectName] = Field(None, description=PROJECT_DESCRIPTION)


class ProjectQuery(Schema):
    project: Optional[ProjectName] = Field(None, description=PROJECT_DESCRIPTION)


class SilencePath(Schema):
    silence_id: Annotated[int, Field(ge=1, le=2**63 - 1)]


def create_silence(project_id: int, identity: ApiIdentity, data: SilenceIn, now: dt.datetime) -> SilenceRow:
    try:
        matchers = parse_matchers([m.model_dump(exclude_none=True) if isinstance(m, Matcher) else m
                                   for m in data.matchers])
    except MatcherError as exc:
        raise ApiError(400, str(exc)) from None
    starts_at = data.starts_at or now
    if data.ends_at is not None and data.duration is not None:
        raise ApiError(400, "give ends_at or duration, not both")
    if data.ends_at is not None:
        ends_at = data.ends_at
    elif data.duration is not None:
        ends_at = starts_at + data.duration
    else:
        raise ApiError(400, "ends_at or duration is required (a silence always expires)")
    if ends_at <= starts_at:
        raise ApiError(400, "ends_at must be after starts_at")
    if ends_at <= now:
        raise ApiError(400, "ends_at is in the past")
    if ends_at - starts_at > MAX_SILENCE:
        raise ApiError(400, f"a silence lasts at most {MAX_SILENCE.days} days")
    return SilenceRow.objects.create(
        project_id=project_id, matchers=[m.to_dict() for m in matchers], starts_at=starts_at, ends_at=ends_at,
        created_by_id=identity.user_id, created_by_name=identity.username, comment=data.comment.strip(), created_at=now,
    )


_SILENCE_LINKS = {
    "GetSilence": {"operationId": "alerts_api_read_silence", "parameters": {"silence_id": "$response.body#/silence/id"}},
    "ExpireSilence": {"operationId": "alerts_api_expire_silence",
                      "parameters": {"silence_id": "$response.body#/silence/id"}},
}


@router.get("/silences", response=declared(ok={200: SilenceList}), summary="The project's silences, newest first")
def list_silences(request: HttpRequest, query: Query[SilencesQuery]):
    now = timezone.now()
    project_id = project_for(request.auth, query.project)
    statuses = _choices(query.status)
    silences = SilenceRow.objects.filter(project_id=project_id).select_related("project").order_by("-id")
    if statuses:
        silences = [s for s in silences[: MAX_LIMIT * 4] if s.status(now) in statuses]
    return {"silences": [silence_json(s, now) for s in list(silences)[: query.limit]]}


@router.post("/silences", response=declared(413, ok={201: SilenceCreated}), summary="Create a silence (operators)",
             openapi_extra={"responses": {201: {"description": "the silence", "links": _SILENCE_LINKS}}})
def create_silence_view(request: HttpRequest, body: SilenceIn, query: Query[ProjectQuery]):
    identity = request.auth
    now = timezone.now()
    project_id = project_for(identity, query.project)
    require(identity, project_id, "operator", "managing silences")
    silence = create_silence(project_id, identity, body, now)
    silence = SilenceRow.objects.select_related("project").get(pk=silence.pk)
    affected = [a.fingerprint for a in AlertRow.objects.filter(
        project_id=project_id, state__in=(AlertState.PENDING, AlertState.FIRING))
        if matches_all(silence.parsed_matchers(), a.labels)]
    return Status(201, {"silence": silence_json(silence, now), "silences_alerts": affected})


def _silence_for(identity: ApiIdentity, silence_id: int) -> SilenceRow:
    silence = (SilenceRow.objects.filter(pk=silence_id, project_id__in=list(identity.projects))
               .select_related("project").first())
    if silence is None:
        raise ApiError(404, "no such silence")
    return silence


@router.get("/silences/{silence_id}", response=declared(ok={200: OneSilence}), summary="One silence")
def read_silence(request: HttpRequest, path: Path[SilencePath]):
    return {"silence": silence_json(_silence_for(request.auth, path.silence_id), timezone.now())}


@router.delete("/silences/{silence_id}", response=declared(ok={200: OneSilence}),
               summary="Expire a silence now (operators); it stays listed as expired")
def expire_silence(request: HttpRequest, path: Path[SilencePath]):
    identity = request.auth
    silence = _silence_for(identity, path.silence_id)
    require(identity, silence.project_id, "operator", "managing silences")
    now = timezone.now()
    expire_now(silence, identity.username, now)
    return {"silence": silence_json(silence, now)}


def expire_now(silence: SilenceRow, username: str, now: dt.datetime) -> None:
    """End a silence now (it stays listed, as expired by `username`); one already over is left as it is."""
    if silence.ends_at > now:
        SilenceRow.objects.filter(pk=silence.pk, ends_at__gt=now).update(
            ends_at=now, expired_at=now, expired_by_name=username)
        silence.refresh_from_db()
