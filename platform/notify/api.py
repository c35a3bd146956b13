"""JSON API for channels and their delivery log (router of apikit.api): viewers read, admins manage.

Delivery answers (the first 500 characters a destination answered) are shown to the project's admins only: a
channel pointed at an internal service would otherwise let anyone who reads the log read that service.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from apikit.api import PROJECT_DESCRIPTION, ApiError, ApiRouter, declared, project_for, require, union_tags
from apikit.inputs import Matching, ProjectName, QueryInt, Text
from django.db import IntegrityError, transaction
from django.http import HttpRequest
from django.utils import timezone
from ninja import Path, Query, Schema
from ninja.responses import Status
from pydantic import ConfigDict, Field, StrictBool
from tenancy.keys import ApiIdentity
from tenancy.models import Project

from . import services
from .channels import (
    MAX_MATCHERS,
    MAX_SECRETS,
    ChannelInputError,
    channel_json,
    clean_input,
    redact_url,
    without_answer,
)
from .models import Channel as ChannelRow
from .models import ChannelKind, DeliveryStatus
from .models import Delivery as DeliveryRow

router = ApiRouter(tags=["channels"])
DELIVERY_PAGE_MAX = 200


def _channel_for(identity: ApiIdentity, channel_id: int) -> ChannelRow:
    """The channel, if it belongs to one of the token's projects; otherwise 404 (existence is not revealed)."""
    channel = ChannelRow.objects.select_related("project").filter(id=channel_id).first()
    if channel is None or identity.role_in(channel.project_id) is None:
        raise ApiError(404, f"no channel {channel_id} for this token")
    return channel


def _managed(identity: ApiIdentity, channel_id: int) -> ChannelRow:
    """The token's channel ``channel_id`` (as _channel_for), which the token must be able to manage (admins)."""
    channel = _channel_for(identity, channel_id)
    require(identity, channel.project_id, "admin", "managing channels")
    return channel


def _iso(value) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value else None


def delivery_json(delivery: DeliveryRow, with_log: bool = True, *, show_answers: bool = False) -> dict:
    """A delivery and its attempts; the destination's answers (response_excerpt) only with show_answers (admins)."""
    out = {
        "id": delivery.id,
        "channel": delivery.channel_id,
        "webhook_id": delivery.webhook_id,
        "event_id": delivery.event_id,
        "fingerprint": delivery.fingerprint,
        "event_status": (delivery.event or {}).get("status"),
        "severity": delivery.severity,
        "status": delivery.status,
        "attempts": delivery.attempts,
        "next_attempt_at": _iso(delivery.next_attempt_at) if delivery.status == DeliveryStatus.PENDING else None,
        "last_status_code": delivery.last_status_code,
        "last_error": (delivery.last_error if show_answers else without_answer(delivery.last_error)) or None,
        "last_duration_ms": delivery.last_duration_ms,
        "is_test": delivery.is_test,
        "created_at": _iso(delivery.created_at),
        "updated_at": _iso(delivery.updated_at),
        "delivered_at": _iso(delivery.delivered_at),
    }
    if with_log:
        out["log"] = [
            {"attempt": a.number, "started_at": _iso(a.started_at), "duration_ms": a.duration_ms,
             "outcome": a.outcome, "status_code": a.status_code,
             "error": (a.error if show_answers else without_answer(a.error)) or None,
             "url": a.url or None, "response_excerpt": (a.response_excerpt or None) if show_answers else None}
            for a in delivery.attempt_log.all()
        ]
    return out


ChannelName = Text(100, min_length=1, pattern=r"^[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x1f\x7f]*$",
                   reason="1 to 100 characters, not only spaces", description="1 to 100 characters, unique in the project")
Url = Text(2048, min_length=1, pattern=r"^[hH][tT][tT][pP][sS]?://[^\s\x00-\x1f\x7f]+$",
           reason="an http:// or https:// URL (only http and https), without spaces",
           description="http:// or https://; private, loopback, link-local and metadata addresses are refused unless "
                       "NOTIFY_ALLOW_PRIVATE_DESTINATIONS opens them (with their port)")
Secret = Matching(r"^whsec_[A-Za-z0-9+/]{32,88}={0,2}$", "a webhook secret: 'whsec_' and standard base64 of 24 to 64 "
                                                          "bytes", max_length=100)
Secrets = Annotated[list[Secret], Field(min_length=1, max_length=MAX_SECRETS)]
RoutingKey = Matching(r"^[A-Za-z0-9]{8,64}$", "the PagerDuty integration key (8-64 letters/digits)")
Severities = Annotated[list[Literal["page", "ticket"]], Field(max_length=2, description="empty: every severity")]


class Matcher(Schema):
    model_config = ConfigDict(extra="forbid")
    name: Matching(r"^[A-Za-z_][A-Za-z0-9_]*$", "a label name ([A-Za-z_][A-Za-z0-9_]*)", max_length=200)
    op: Literal["=", "!=", "=~", "!~"] = "="
    value: Text(1000)


MatcherText = Text(1300, pattern=r'^ *[A-Za-z_][A-Za-z0-9_]* *(=~|!~|!=|=) *"([^"\\\x00-\x1f\x7f]|\\[^\x00-\x1f\x7f])*" *$',
                   reason='a matcher: name="value" (operators =, !=, =~, !~) or {"name", "op", "value"}',
                   description='the text form name="value" (operators =, !=, =~, !~)')
Matchers = Annotated[list[Union[Matcher, MatcherText]], Field(max_length=MAX_MATCHERS)]


class _NewChannel(Schema):
    model_config = ConfigDict(extra="forbid")
    name: ChannelName
    severities: Optional[Severities] = None
    matchers: Optional[Matchers] = Field(None, description="label matchers the event must all satisfy")
    send_resolved: Optional[StrictBool] = None
    enabled: Optional[StrictBool] = None


class SignedChannel(_NewChannel):
    """A generic webhook (Standard Webhooks signed JSON) or an Alertmanager-format webhook."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"name": "oncall", "kind": "webhook", "url": "https://hooks.example.com/observatory", "severities": ["page"]}]})
    kind: Literal["webhook", "alertmanager"]
    url: Url
    secrets: Optional[Secrets] = Field(None, description="default: one generated and shown once")


class SlackChannel(_NewChannel):
    """A Slack incoming webhook."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"name": "alerts-room", "kind": "slack", "url": "https://hooks.slack.com/services/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"}]})
    kind: Literal["slack"]
    url: Url


class PagerdutyChannel(_NewChannel):
    """PagerDuty's Events API v2: the integration key routes the events; the url defaults to PagerDuty's."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"name": "pager", "kind": "pagerduty", "routing_key": "R0UT1NGKEY0123456789abcdef012345"}]})
    kind: Literal["pagerduty"]
    routing_key: RoutingKey
    url: Optional[Url] = Field(None, description="default: PagerDuty's Events API v2")


# The kind decides which fields apply (secrets: signed kinds; routing_key: pagerduty): one form per kind.
ChannelIn = Annotated[Union[SignedChannel, SlackChannel, PagerdutyChannel], Field(discriminator="kind")]
union_tags.update(ChannelKind.values)


class ChannelChange(Schema):
    model_config = ConfigDict(extra="forbid")
    name: Optional[ChannelName] = None
    kind: Optional[Literal[tuple(ChannelKind.values)]] = Field(None, description="cannot change; if given, the "  # type: ignore[valid-type]
                                                                                 "channel's own")
    url: Optional[Url] = None
    secrets: Optional[Secrets] = None
    routing_key: Optional[RoutingKey] = None
    severities: Optional[Severities] = None
    matchers: Optional[Matchers] = None
    send_resolved: Optional[StrictBool] = None
    enabled: Optional[StrictBool] = None
    rotate_secret: Optional[StrictBool] = Field(None, description="add a new secret (shown once); both sign until "
                                                                  "retire_secrets")
    retire_secrets: Optional[StrictBool] = Field(None, description="keep only the newest secret")


class Channel(Schema):
    id: int
    project: str
    name: str
    kind: str
    url: str = Field(description="redacted: no password, query values or Slack path")
    enabled: bool
    disabled_reason: Optional[str]
    severities: list[str]
    matchers: list[dict[str, str]]
    send_resolved: bool
    secret_hints: list[str]
    last_error: Optional[str]
    last_error_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    last_success_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    created_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    updated_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    routing_key_hint: Optional[str] = None


class ChannelCreated(Schema):
    channel: Channel
    secrets: Optional[list[str]] = Field(None, description="generated secrets, shown only now")
    note: Optional[str] = None


class ChannelChanged(Schema):
    channel: Channel
    new_secret: Optional[str] = Field(None, description="the rotated-in secret, shown only now")
    note: Optional[str] = None


class OneChannel(Schema):
    channel: Channel


class ChannelList(Schema):
    channels: list[Channel]


class DeliveryAttempt(Schema):
    attempt: int
    started_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    duration_ms: Optional[float]
    outcome: str
    status_code: Optional[int]
    error: Optional[str]
    url: Optional[str]
    response_excerpt: Optional[str] = Field(description="what the destination answered (500 characters); the "
                                                        "project's admins only, else null")


class Delivery(Schema):
    id: int
    channel: int
    webhook_id: str
    event_id: str
    fingerprint: str
    event_status: Optional[str]
    severity: str
    status: Literal[tuple(DeliveryStatus.values)]  # type: ignore[valid-type]
    attempts: int
    next_attempt_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    last_status_code: Optional[int]
    last_error: Optional[str]
    last_duration_ms: Optional[float]
    is_test: bool
    created_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    updated_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    delivered_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    log: Optional[list[DeliveryAttempt]] = None


class TestSent(Schema):
    delivery: Delivery
    url: str


class DeliveryPage(Schema):
    channel: int
    deliveries: list[Delivery]
    next_before: Optional[int] = Field(description="pass as ?before= for the next (older) page")


class ProjectQuery(Schema):
    project: Optional[ProjectName] = Field(None, description=PROJECT_DESCRIPTION)


class ChannelPath(Schema):
    channel_id: Annotated[int, Field(ge=1, le=2**63 - 1)]


class DeliveriesQuery(Schema):
    status: Optional[Literal[tuple(DeliveryStatus.values)]] = None  # type: ignore[valid-type]
    limit: QueryInt(1, DELIVERY_PAGE_MAX, "deliveries per page, newest first") = 50
    before: Optional[QueryInt(1, 2**63 - 1, "only deliveries with a smaller id (the previous page's next_before)")] = None


def _fields(body: Schema) -> dict:
    return body.model_dump(mode="python", exclude_unset=True)


def _matchers_as_given(data: dict, body: Schema) -> dict:
    if data.get("matchers") is not None:
        data["matchers"] = [m.model_dump() if isinstance(m, Matcher) else m for m in body.matchers]
    return data


_CHANNEL_LINKS = {
    "GetChannel": {"operationId": "notify_api_read_channel", "parameters": {"channel_id": "$response.body#/channel/id"}},
    "ChangeChannel": {"operationId": "notify_api_change_channel",
                      "parameters": {"channel_id": "$response.body#/channel/id"}},
    "TestChannel": {"operationId": "notify_api_test_channel", "parameters": {"channel_id": "$response.body#/channel/id"}},
    "ChannelDeliveries": {"operationId": "notify_api_channel_deliveries",
                          "parameters": {"channel_id": "$response.body#/channel/id"}},
    "DeleteChannel": {"operationId": "notify_api_delete_channel",
                      "parameters": {"channel_id": "$response.body#/channel/id"}},
}


@router.get("/channels", response=declared(ok={200: ChannelList}), summary="The project's notification channels")
def list_channels(request: HttpRequest, query: Query[ProjectQuery]):
    identity = request.auth
    project_id = project_for(identity, query.project)
    project_name = Project.objects.get(id=project_id).name
    show = identity.can(project_id, "admin")
    return {"channels": [channel_json(c, project_name, show_answers=show)
                         for c in ChannelRow.objects.filter(project_id=project_id)]}


@router.post("/channels", response=declared(409, 413, ok={201: ChannelCreated}), summary="Create a channel (admins)",
             openapi_extra={"responses": {201: {"description": "the channel", "links": _CHANNEL_LINKS}}})
def create_channel(request: HttpRequest, body: ChannelIn, query: Query[ProjectQuery]):
    identity = request.auth
    project_id = project_for(identity, query.project)
    require(identity, project_id, "admin", "managing channels")
    try:
        fields, generated = clean_input({k: v for k, v in _matchers_as_given(_fields(body), body).items()
                                         if v is not None})
    except ChannelInputError as exc:
        raise ApiError(400, str(exc)) from None
    now = timezone.now()
    try:
        with transaction.atomic():
            channel = ChannelRow.objects.create(project_id=project_id, created_at=now, updated_at=now, **fields)
    except IntegrityError:
        raise ApiError(409, f"a channel named {fields['name']!r} already exists in this project") from None
    answer = {"channel": channel_json(channel, Project.objects.get(id=project_id).name)}
    if generated:
        answer["secrets"] = generated
        answer["note"] = "the secret is shown only now; store it where your receiver verifies signatures"
    return Status(201, answer)


@router.get("/channels/{channel_id}", response=declared(ok={200: OneChannel}), summary="One channel")
def read_channel(request: HttpRequest, path: Path[ChannelPath]):
    channel = _channel_for(request.auth, path.channel_id)
    return {"channel": channel_json(channel, show_answers=request.auth.can(channel.project_id, "admin"))}


@router.patch("/channels/{channel_id}", response=declared(409, 413, ok={200: ChannelChanged}),
              summary="Change a channel (admins): any field but its kind; rotate or retire secrets")
def change_channel(request: HttpRequest, path: Path[ChannelPath], body: ChannelChange):
    identity = request.auth
    channel = _managed(identity, path.channel_id)
    try:
        fields, generated = clean_input({k: v for k, v in _matchers_as_given(_fields(body), body).items()
                                         if v is not None}, channel)
    except ChannelInputError as exc:
        raise ApiError(400, str(exc)) from None
    now = timezone.now()
    disabling = fields.get("enabled") is False and channel.enabled
    if fields.get("enabled") is True:
        fields["disabled_reason"] = ""
    if disabling:
        del fields["enabled"]  # disable_channel sets it with a reason and ends the pending deliveries
    for name, value in fields.items():
        setattr(channel, name, value)
    channel.updated_at = now
    try:
        with transaction.atomic():
            channel.save()
            if disabling:
                services.disable_channel(channel, f"disabled by {identity.username}", now)
    except IntegrityError:
        raise ApiError(409, f"a channel named {channel.name!r} already exists in this project") from None
    channel.refresh_from_db()
    answer = {"channel": channel_json(channel)}
    if generated:
        answer["new_secret"] = generated[-1]
        answer["note"] = ("the new secret is shown only now; every listed secret signs until you retire the old ones "
                          "(PATCH {\"retire_secrets\": true})")
    return answer


@router.delete("/channels/{channel_id}", response=declared(ok={204: None}), summary="Delete a channel (admins)")
def delete_channel(request: HttpRequest, path: Path[ChannelPath]):
    channel = _managed(request.auth, path.channel_id)
    with transaction.atomic():
        # Write first, collect after: the write takes the database's write lock (SQLite) or the row's lock
        # (PostgreSQL), so a delivery the worker queues meanwhile cannot slip in between the collection of the
        # channel's deliveries and their deletion (SQLite then failed the commit on the foreign key: a 500).
        ChannelRow.objects.filter(pk=channel.pk).update(enabled=False)
        channel.delete()
    return Status(204, None)


@router.post("/channels/{channel_id}/test", response=declared(ok={200: TestSent}),
             summary="Send a test notification now (admins); not retried")
def test_channel(request: HttpRequest, path: Path[ChannelPath]):
    channel = _managed(request.auth, path.channel_id)
    delivery = services.send_test(channel)
    return {"delivery": delivery_json(delivery, show_answers=True), "url": redact_url(channel.url, channel.kind)}


@router.get("/channels/{channel_id}/deliveries", response=declared(ok={200: DeliveryPage}),
            summary="The channel's deliveries, newest first, with their attempts",
            description="What the destinations answered (`response_excerpt`) is shown to the project's admins only.")
def channel_deliveries(request: HttpRequest, path: Path[ChannelPath], query: Query[DeliveriesQuery]):
    identity = request.auth
    channel = _channel_for(identity, path.channel_id)
    show_answers = identity.can(channel.project_id, "admin")
    deliveries = DeliveryRow.objects.filter(channel=channel)
    if query.status:
        deliveries = deliveries.filter(status=query.status)
    if query.before is not None:
        deliveries = deliveries.filter(id__lt=query.before)
    page = list(deliveries.order_by("-id").prefetch_related("attempt_log")[: query.limit + 1])
    more = len(page) > query.limit
    page = page[:query.limit]
    return {
        "channel": channel.id,
        "deliveries": [delivery_json(d, show_answers=show_answers) for d in page],
        "next_before": page[-1].id if more and page else None,
    }


